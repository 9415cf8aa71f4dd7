// Linear layers for CPU: y[m, n] = sum_k x[m, k] * W[n, k], float32 activations, with W in float32, bfloat16 or
// float16 (linear_f32; the GEMM itself is cpu_gemm.cpp's) or weight-only int8 / int4 (linear_int8 / linear_int4:
// y = x dequant(W)^T).
//
// Decoding reads every weight once per step, so the kernels are built to stream weights at memory speed:
// weights are repacked at load into blocks of 64 output channels, stored k-major inside a block
// ([N/64, K, 64] float32 or int8, or [N/64, K, 32] bytes of two nibbles for int4), so one step of k reads one
// contiguous run of 256 (float32), 64 (int8) or 32 (int4) bytes, converts it to floats in registers and
// multiplies it into the accumulators of up to MR rows of x at once (x broadcast: no horizontal sums). Nothing
// is dequantised into memory. Prefill on quantised weights dequantises each block once into a float32 buffer and
// runs the float32 GEMM's tiles on it (cpu_gemm.cpp).
// int8: the per-channel scale is applied once at the end; int8 in groups of G along k (GGUF's Q8_0): per group,
// acc += scale[g, n] * sum_k x[m, k] * q[n, k]. int4 (symmetric, nibble = q + 8, groups of G along k): per group,
// acc += scale[g, n] * (sum_k x[m, k] * nibble[n, k] - 8 * sum_k x[m, k]); with offsets (GGUF's Q4_1),
// acc += scale[g, n] * sum_k x[m, k] * nibble[n, k] + offset[g, n] * sum_k x[m, k].
// Written with GCC vector extensions (-march=native: AVX-512 / AVX2 / SSE as the machine has); the widening
// int8 -> float conversions use intrinsics where available, as GCC 12 does not vectorise them itself.
// Where the CPU has AVX512-VNNI, int4 multiplies nibbles by x quantised to two int8 parts per group instead
// (layout 1, block_int4_vnni): a third of the instructions per weight of the float path; `int4_layout(G)` tells
// the packing code which layout to write.
// Threads: the blocks of 64 channels are handed out to torch's threads (OpenMP; torch.set_num_threads) a few at a
// time as each asks for more (pmx_cpu::for_blocks, cpu_kernels.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_kernels.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef uint8_t v16u __attribute__((vector_size(16)));

constexpr int64_t NB = 64;  // output channels per block
constexpr int MR_MAX = 6;   // rows of x per pass over a block

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

inline float sum_floats(const float* p, int64_t n) {  // vectorised where the compiler can (-O3 -march=native)
  v16f acc = v16f{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load<v16f>(p + i);
  float s = 0;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += p[i];
  return s;
}

// 16 signed bytes -> 16 floats.
inline v16f cvt_i8(const int8_t* p) {
#if defined(__AVX512F__)
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  v16f r;
  __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
  std::memcpy(&r, &lo, 32);
  std::memcpy((char*)&r + 32, &hi, 32);
  return r;
#else
  v16f r;
  for (int i = 0; i < 16; ++i) r[i] = p[i];
  return r;
#endif
}

// 16 bytes holding values 0..15 -> 16 floats.
inline v16f cvt_u8(v16u b) {
#if defined(__AVX512F__)
  __m128i v;
  std::memcpy(&v, &b, 16);
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
#elif defined(__AVX2__)  // from the register, not through memory (a store and two reloads per 16 values)
  __m128i v;
  std::memcpy(&v, &b, 16);
  v16f r;
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
  std::memcpy(&r, &lo, 32);
  std::memcpy((char*)&r + 32, &hi, 32);
  return r;
#else
  int8_t t[16];
  std::memcpy(t, &b, 16);
  return cvt_i8(t);  // values < 16: the signed conversion is the same
#endif
}

// a[m][.] += x[m, k] * (w0 | w1 | w2 | w3): one k for 64 channels and MR rows of x (row stride K).
template <int MR>
inline void fma_rows(v16f (&a)[MR][4], const float* x, int64_t K, int64_t k, v16f w0, v16f w1, v16f w2, v16f w3) {
  for (int m = 0; m < MR; ++m) {
    const float xv = x[m * K + k];
    a[m][0] += xv * w0;
    a[m][1] += xv * w1;
    a[m][2] += xv * w2;
    a[m][3] += xv * w3;
  }
}

constexpr int64_t PF_INT8 = 128;  // rows of 64 bytes (8 KiB) prefetched ahead, as PF_F32

// int8: acc[m][0..63] = sum_k x[m, k] * w[k][0..63] for MR rows; w points at one block [K, 64].
template <int MR>
inline void block_int8(const float* x, int64_t K, const int8_t* w, float* out, int64_t ldo, const float* scale,
                       int64_t ncols) {
  v16f a[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) a[m][j] = v16f{};
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* wk = w + k * NB;
    _mm_prefetch((const char*)(wk + PF_INT8 * NB), _MM_HINT_T0);
    fma_rows<MR>(a, x, K, k, cvt_i8(wk), cvt_i8(wk + 16), cvt_i8(wk + 32), cvt_i8(wk + 48));
  }
  for (int m = 0; m < MR; ++m) {
    float tmp[NB];
    std::memcpy(tmp, a[m], sizeof(tmp));
    for (int64_t j = 0; j < ncols; ++j) out[m * ldo + j] = tmp[j] * scale[j];
  }
}

// int4: w points at one block [K, 32] of bytes (byte j: channel j in the low nibble, j + 32 in the high one),
// scale (and with OFFSET offs) at [K / G, Npad] (this block's column 0), xsum at [M, K / G] (this pass's row 0).
template <int MR, bool OFFSET = false>
inline void block_int4(const float* x, int64_t K, const uint8_t* w, int64_t G, const float* scale, int64_t lds,
                       const float* xsum, float* out, int64_t ldo, int64_t ncols, const float* offs = nullptr) {
  float acc[MR][NB] = {};
  const int64_t groups = K / G;
  for (int64_t g = 0; g < groups; ++g) {
    v16f a[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) a[m][j] = v16f{};
    for (int64_t k = g * G; k < (g + 1) * G; ++k) {
      const uint8_t* wk = w + k * (NB / 2);
      const v16u p0 = load<v16u>(wk), p1 = load<v16u>(wk + 16);
      // channels 0..15, 16..31 in the low nibbles, 32..47, 48..63 in the high ones
      fma_rows<MR>(a, x, K, k, cvt_u8(p0 & 15), cvt_u8(p1 & 15), cvt_u8(p0 >> 4), cvt_u8(p1 >> 4));
    }
    const float* s = scale + g * lds;
    for (int m = 0; m < MR; ++m) {
      const float xs = xsum[m * groups + g], off = 8.0f * xs;
      for (int j = 0; j < 4; ++j) {
        v16f sv = load<v16f>(s + 16 * j), cur = load<v16f>(&acc[m][16 * j]);
        if constexpr (OFFSET)
          cur += sv * a[m][j] + load<v16f>(offs + g * lds + 16 * j) * xs;
        else
          cur += sv * (a[m][j] - off);
        std::memcpy(&acc[m][16 * j], &cur, sizeof(cur));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < ncols; ++j) out[m * ldo + j] = acc[m][j];
}

#if defined(__AVX2__) && !defined(__AVX512F__)
#define PMX_AVX2_ROWS 1
// AVX2 (16 registers of 8 floats): the generic kernels above hold MR x 4 vectors of 16 floats, which GCC lowers
// through the stack here (per-channel int8, 2816 x 1024, one row of x: 2.4 ms a call on one Zen 3 core, 1.2 GMAC/s).
// These take the int8 and int4 weights one row of x at a time, the block's 64 channels in 8 registers, each k's
// weights converted once (the same call: 0.51 ms; int4 in groups of 32: 3.8 -> 0.30 ms).
namespace avx2 {

constexpr int64_t PF_BYTES = 8192;  // prefetched ahead of the weight stream, as the generic kernels'

// Up to this many rows of x the row kernels below run; above, each block is dequantised once and the float GEMM's
// tiles run on it (dequant_into), whatever the caller's dequant_above: one row at a time converts every weight once
// per row, and from 4 rows on the dequantised GEMM took less time (1536..5632 x 576..2816 weights, every scheme:
// dequant / rows time at 3 rows 1.11, 4 rows 0.90, 6 rows 0.60, medians on one Zen 3 core).
constexpr int64_t ROWS_MAX = 3;

inline __m256 low8(__m128i b, bool is_signed) {  // the first 8 bytes of b as floats
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// a[i] (channels 8i .. 8i + 7 of the block) += sum_{k0 <= k < k1} x[k] * W[k][8i ..]: KIND 8 int8 rows of 64 bytes,
// KIND 4 int4 rows of 32 bytes (byte j: channel j in the low nibble, j + 32 in the high one).
template <int KIND>
inline void dot_rows(const float* x, const void* w, int64_t k0, int64_t k1, __m256 (&a)[8]) {
  const __m128i nib = _mm_set1_epi8(15);
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 xb = _mm256_broadcast_ss(x + k);
    if constexpr (KIND == 8) {
      const int8_t* wk = static_cast<const int8_t*>(w) + k * NB;
      _mm_prefetch((const char*)wk + PF_BYTES, _MM_HINT_T0);
      for (int i = 0; i < 4; ++i) {
        const __m128i b = _mm_loadu_si128((const __m128i*)(wk + 16 * i));
        a[2 * i] = _mm256_fmadd_ps(low8(b, true), xb, a[2 * i]);
        a[2 * i + 1] = _mm256_fmadd_ps(low8(_mm_srli_si128(b, 8), true), xb, a[2 * i + 1]);
      }
    } else {
      const uint8_t* wk = static_cast<const uint8_t*>(w) + k * (NB / 2);
      if (k % 2 == 0) _mm_prefetch((const char*)wk + PF_BYTES, _MM_HINT_T0);
      for (int i = 0; i < 2; ++i) {  // bytes 16i ..: channels 16i .. (low nibbles), 32 + 16i .. (high)
        const __m128i b = _mm_loadu_si128((const __m128i*)(wk + 16 * i));
        const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
        a[2 * i] = _mm256_fmadd_ps(low8(lo, false), xb, a[2 * i]);
        a[2 * i + 1] = _mm256_fmadd_ps(low8(_mm_srli_si128(lo, 8), false), xb, a[2 * i + 1]);
        a[4 + 2 * i] = _mm256_fmadd_ps(low8(hi, false), xb, a[4 + 2 * i]);
        a[5 + 2 * i] = _mm256_fmadd_ps(low8(_mm_srli_si128(hi, 8), false), xb, a[5 + 2 * i]);
      }
    }
  }
}

inline void store_cols(const float* v, float* out, int64_t ncols) {
  std::memcpy(out, v, ncols * sizeof(float));
}

// One row of x against a block of per-channel int8: out[j] = scale[j] sum_k x[k] W[k][j].
inline void block_int8(const float* x, int64_t K, const int8_t* w, const float* scale, float* out, int64_t ncols) {
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  dot_rows<8>(x, w, 0, K, a);
  alignas(32) float r[NB];
  float s[NB] = {};
  std::memcpy(s, scale, ncols * sizeof(float));
  for (int i = 0; i < 8; ++i) _mm256_store_ps(r + 8 * i, _mm256_mul_ps(a[i], _mm256_loadu_ps(s + 8 * i)));
  store_cols(r, out, ncols);
}

// One row of x against a block of weights in groups of G along k: KIND 8 int8 (acc += scale sum), KIND 4 int4
// (acc += scale (sum - 8 xsum), or with offsets acc += scale sum + offset xsum); scale / offs at [K/G, lds] (this
// block's column 0), xsum the row's sums of x per group.
template <int KIND>
inline void block_grouped(const float* x, int64_t K, const void* w, int64_t G, const float* scale, int64_t lds,
                          const float* offs, const float* xsum, float* out, int64_t ncols) {
  alignas(32) float tot[NB] = {};
  for (int64_t g = 0; g < K / G; ++g) {
    __m256 a[8];
    for (auto& v : a) v = _mm256_setzero_ps();
    dot_rows<KIND>(x, w, g * G, (g + 1) * G, a);
    const float* s = scale + g * lds;
    const __m256 xs = _mm256_set1_ps(KIND == 4 ? xsum[g] : 0.0f);
    for (int i = 0; i < 8; ++i) {
      __m256 t = _mm256_load_ps(tot + 8 * i), sv = _mm256_loadu_ps(s + 8 * i);
      if (KIND == 4 && offs)
        t = _mm256_fmadd_ps(_mm256_loadu_ps(offs + g * lds + 8 * i), xs, _mm256_fmadd_ps(sv, a[i], t));
      else if (KIND == 4)
        t = _mm256_fmadd_ps(sv, _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), xs, a[i]), t);
      else
        t = _mm256_fmadd_ps(sv, a[i], t);
      _mm256_store_ps(tot + 8 * i, t);
    }
  }
  store_cols(tot, out, ncols);
}

}  // namespace avx2
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(PMX_NO_VNNI)
// int4 with AVX512-VNNI integer dot products (layout 1). x is quantised per row and group into two int8 parts,
// x ~= s (q1 + q2 / 256) with s = max|x| / 127 (error at most s / 512 per element, about 15 bits: finer than
// the bfloat16 activations of a GPU W4A16 kernel), and vpdpbusd sums nibble (unsigned) x q (signed) over 4 k at
// a time into int32, exactly: per group, sum_k x_k (n_k - 8) = s (256 d1 + d2 - 8 (256 sum q1 + sum q2)) / 256,
// all of it in int32 (|.| < 2^31 for groups of up to VNNI_MAX_GROUP) and one float conversion per group.
// w points at one block [K/2, 64] of bytes: row 2 j + h (j: the j-th quad of k, h = 0, 1) holds at byte 4 c + t
// channel 32 h + c in its low nibble and 32 h + 16 + c in its high one, of k = 4 j + t (c < 16, t < 4): one
// 64-byte row is one vpdpbusd operand for 16 channels x 4 k per nibble half.
// q: the two parts [2][M][K] (int8); xs: s / 256 per [M][K / G]; off: 8 (256 sum q1 + sum q2) per [M][K / G].
constexpr int64_t VNNI_MAX_GROUP = 2048;
constexpr int MR_VNNI = 3;
constexpr int64_t PF_INT4 = 128;  // rows of 64 bytes (8 KiB) prefetched ahead, as PF_F32: 15-25% faster at batch 1

// With OFFSET, off is 0 (no -8) and offs [K/G, Npad] times the float sums of x per group (xsum [M][K/G]) is added.
template <int MR, bool OFFSET = false>
inline void block_int4_vnni(const int8_t* q, int64_t ldq, int64_t K, const uint8_t* w, int64_t G, const float* scale,
                            int64_t lds, const float* xs, const int32_t* off, float* out, int64_t ldo, int64_t ncols,
                            const float* offs = nullptr, const float* xsum = nullptr) {
  float acc[MR][NB] = {};
  const int64_t groups = K / G;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i a[MR][2][4];
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < 2; ++p)
        for (int i = 0; i < 4; ++i) a[m][p][i] = _mm512_setzero_si512();
    for (int64_t j = g * G / 4; j < (g + 1) * G / 4; ++j) {
      _mm_prefetch((const char*)(w + (2 * j + PF_INT4) * NB), _MM_HINT_T0);
      _mm_prefetch((const char*)(w + (2 * j + PF_INT4 + 1) * NB), _MM_HINT_T0);
      const __m512i v0 = _mm512_loadu_si512(w + 2 * j * NB), v1 = _mm512_loadu_si512(w + (2 * j + 1) * NB);
      const __m512i wv[4] = {_mm512_and_si512(v0, nib), _mm512_and_si512(_mm512_srli_epi16(v0, 4), nib),
                             _mm512_and_si512(v1, nib), _mm512_and_si512(_mm512_srli_epi16(v1, 4), nib)};
      for (int m = 0; m < MR; ++m)
        for (int p = 0; p < 2; ++p) {
          int32_t x4;
          std::memcpy(&x4, q + p * ldq + m * K + 4 * j, 4);
          const __m512i xb = _mm512_set1_epi32(x4);
          for (int i = 0; i < 4; ++i) a[m][p][i] = _mm512_dpbusd_epi32(a[m][p][i], wv[i], xb);
        }
    }
    const float* s = scale + g * lds;
    for (int m = 0; m < MR; ++m) {
      const __m512i o = _mm512_set1_epi32(off[m * groups + g]);
      const __m512 sx = _mm512_set1_ps(xs[m * groups + g]);
      for (int i = 0; i < 4; ++i) {
        const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(a[m][0][i], 8), a[m][1][i]), o);
        __m512 cur = _mm512_loadu_ps(&acc[m][16 * i]);
        if constexpr (OFFSET)
          cur = _mm512_fmadd_ps(_mm512_loadu_ps(offs + g * lds + 16 * i), _mm512_set1_ps(xsum[m * groups + g]), cur);
        _mm512_storeu_ps(&acc[m][16 * i],
                         _mm512_fmadd_ps(_mm512_loadu_ps(s + 16 * i), _mm512_mul_ps(_mm512_cvtepi32_ps(d), sx), cur));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < ncols; ++j) out[m * ldo + j] = acc[m][j];
}

// x [M, K] -> the two int8 parts q [2][M][K], xs [M][K/G] (s / 256) and off [M][K/G] of block_int4_vnni.
inline void quantize_x2(const float* x, int64_t M, int64_t K, int64_t G, int8_t* q, float* xs, int32_t* off) {
  const int64_t groups = K / G;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* p = x + m * K + g * G;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t i = 0; i < G; i += 16) {
        const __mmask16 k = G - i >= 16 ? 0xFFFF : (__mmask16)((1u << (G - i)) - 1);
        mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, _mm512_maskz_loadu_ps(k, p + i)));
      }
      const float amax = _mm512_reduce_max_ps(mx);
      const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
      int8_t* q1 = q + m * K + g * G;
      int8_t* q2 = q1 + M * K;
      for (int64_t i = 0; i < G; i += 16) {
        const __mmask16 k = G - i >= 16 ? 0xFFFF : (__mmask16)((1u << (G - i)) - 1);
        const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + i), inv);
        const __m512i a = _mm512_cvtps_epi32(y);  // round to nearest even; |y| <= 127
        const __m512i b = _mm512_min_epi32(
            _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(y, _mm512_cvtepi32_ps(a)), _mm512_set1_ps(256.0f))),
            _mm512_set1_epi32(127));  // (y - a) 256 in [-128, 128]: 128 saturates to 127
        _mm512_mask_cvtepi32_storeu_epi8(q1 + i, k, a);
        _mm512_mask_cvtepi32_storeu_epi8(q2 + i, k, b);
        s1 = _mm512_add_epi32(s1, a);
        s2 = _mm512_add_epi32(s2, b);
      }
      xs[m * groups + g] = amax > 0 ? amax / 127.0f / 256.0f : 0.0f;
      off[m * groups + g] = 8 * (256 * _mm512_reduce_add_epi32(s1) + _mm512_reduce_add_epi32(s2));
    }
}
#endif

using pmx_cpu::for_blocks;

template <typename F>
inline void rows_of(int64_t M, F&& run) {  // run(m0, mr) over row passes of at most MR_MAX rows
  for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) run(m0, std::min<int64_t>(MR_MAX, M - m0));
}

#define PMX_DISPATCH_MR(mr, CALL) \
  switch (mr) {                   \
    case 1: CALL(1); break;       \
    case 2: CALL(2); break;       \
    case 3: CALL(3); break;       \
    case 4: CALL(4); break;       \
    case 5: CALL(5); break;       \
    default: CALL(6); break;      \
  }

void check(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t bytes_per_k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 3 && w.size(1) == x.size(1) && w.size(2) == bytes_per_k && w.is_contiguous(),
              "packed weight must be contiguous [N/64, K, ", bytes_per_k, "]");
  TORCH_CHECK(w.size(0) * NB >= N && (w.size(0) - 1) * NB < N, "packed weight holds ", w.size(0), " blocks for N=", N);
}

pmx_cpu::FloatWeight float_weight(const at::Tensor& w) {  // the element type of a packed float weight
  return w.scalar_type() == at::kBFloat16 ? pmx_cpu::FloatWeight::bf16
         : w.scalar_type() == at::kHalf   ? pmx_cpu::FloatWeight::f16
                                          : pmx_cpu::FloatWeight::f32;
}

// The RMSNorm weight a linear op takes (null where none), checked: contiguous float32 [K].
const float* norm_weight(const c10::optional<at::Tensor>& norm, int64_t K, const char* what) {
  TORCH_CHECK(!norm.has_value() || (norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == K),
              what, ": norm must be a contiguous float32 weight of ", K, " values");
  return norm ? norm->data_ptr<float>() : nullptr;
}

bool is_float_weight(const at::Tensor& w) {
  return w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf;
}

// x W^T (+ residual) for x [M, K] normed by `norm` (eps) on the way in, or x [M, 2 K] = gate | up activated
// (swiglu): see pmx_cpu::float_linear_fused_into. On bfloat16 blocks with AVX512-BF16 (bf16_k_pairs) also: x
// bfloat16 [M, K] (K even), taken as the dot products' pairs as it is. glu_out (N = 2 F, F a multiple of 64): the
// layer is a gate | up projection and the result is silu(gate) * up [M, F], computed a block at a time in cache:
// bfloat16 where the dot products are (pmx_cpu::bf16_linear_dot_into), else float32 (float_linear_glu_into).
at::Tensor linear_f32_fused(const at::Tensor& x, const at::Tensor& w, int64_t N, bool swiglu,
                            const c10::optional<at::Tensor>& norm, double eps,
                            const c10::optional<at::Tensor>& residual,
                            bool glu_out) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == NB && w.is_contiguous() && is_float_weight(w) && w.size(0) * NB >= N &&
                  (w.size(0) - 1) * NB < N,
              "linear_f32_fused: packed weight must be contiguous float [N/64, K, 64] for N=", N);
  const int64_t K = w.size(1);
  const bool dot = w.scalar_type() == at::kBFloat16 && pmx_cpu::bf16_k_pairs(), xb = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || xb) && x.is_contiguous() &&
                  x.size(1) == (swiglu ? 2 : 1) * K,
              "linear_f32_fused: x must be contiguous float32 [M, ", swiglu ? "2 K" : "K", "] with K=", K, ", got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(!xb || (dot && K % 2 == 0 && !swiglu && !norm.has_value()),
              "linear_f32_fused: a bfloat16 x goes to bfloat16 weights on AVX512-BF16 with an even K (", K,
              "), without swiglu or norm");
  TORCH_CHECK(!glu_out || (N % 128 == 0 && !swiglu && !residual.has_value() && !xb),
              "linear_f32_fused: glu_out needs N a multiple of 128 (gate | up, 64-channel blocks each) and a float32 ",
              "x, without swiglu or residual; N=", N);
  TORCH_CHECK(!(swiglu && norm.has_value()), "linear_f32_fused: swiglu and norm do not go together");
  const float* np = norm_weight(norm, K, "linear_f32_fused");
  TORCH_CHECK(!residual.has_value() || (residual->scalar_type() == at::kFloat && residual->is_contiguous() &&
                                        residual->dim() == 2 && residual->size(0) == x.size(0) &&
                                        residual->size(1) == N),
              "linear_f32_fused: residual must be contiguous float32 [", x.size(0), ", ", N, "]");
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  if (glu_out && !dot) {
    at::Tensor act = at::empty({x.size(0), N / 2}, x.options());
    pmx_cpu::float_linear_glu_into(x.data_ptr<float>(), x.size(0), K, w.data_ptr(), float_weight(w), w.size(0), N,
                                   act.data_ptr<float>(), np, static_cast<float>(eps));
    return act;
  }
  if (xb || glu_out) {
    at::Tensor out = glu_out ? at::empty({x.size(0), N / 2}, x.options().dtype(at::kBFloat16))
                             : at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
    pmx_cpu::bf16_linear_dot_into(xb ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr,
                                  xb ? nullptr : x.data_ptr<float>(), x.size(0), K, w.data_ptr(), w.size(0), N,
                                  glu_out ? nullptr : out.data_ptr<float>(),
                                  glu_out ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr,
                                  {.norm = np, .eps = static_cast<float>(eps), .res = rp});
    return out;
  }
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  pmx_cpu::float_linear_fused_into(x.data_ptr<float>(), x.size(0), K, w.data_ptr(), float_weight(w), w.size(0), N,
                                   out.data_ptr<float>(),
                                   {.swiglu = swiglu, .norm = np, .eps = static_cast<float>(eps), .res = rp});
  return out;
}

// The fused qkv linear of an attention layer with rotary and the cache store as its epilogue: y = x W^T (x normed by
// `norm` where given), q and k rotated at cos / sin [M, R/2] (the first R dims of each head), k and v written into
// rows `slots` of layer `layer` of the cache (float32, or int8 with its float16 scales): pmx_cpu::AroundProduct's qkv.
// The cache gives kv_heads and head_dim, N the heads. Returns y [M, (heads + 2 kv_heads) head_dim], q and k rotated.
at::Tensor linear_f32_qkv(const at::Tensor& x, const at::Tensor& w, int64_t N, const c10::optional<at::Tensor>& norm,
                          double eps, const at::Tensor& cos, const at::Tensor& sin, at::Tensor cache,
                          const c10::optional<at::Tensor>& scale, int64_t layout, int64_t layer,
                          const at::Tensor& slots) {
  check(x, w, N, NB);
  TORCH_CHECK(is_float_weight(w), "packed weight must be float32, bfloat16 or float16, not ", w.scalar_type());
  const auto [c, s] = pmx_cpu::cache_views(cache, scale, layout, "linear_f32_qkv");
  const int64_t M = x.size(0), K = x.size(1), D = c.last, kv_heads = c.KV, R = 2 * cos.size(-1);
  const int64_t heads = D > 0 && N % D == 0 ? N / D - 2 * kv_heads : 0;
  TORCH_CHECK(heads > 0 && D % 2 == 0, "linear_f32_qkv: N = ", N, " must be (heads + 2 kv_heads) head_dim for the ",
              "cache's kv_heads ", kv_heads, " and head_dim ", D, " (even)");
  const float* np = norm_weight(norm, K, "linear_f32_qkv");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == M &&
                    R > 0 && R <= D && R % 2 == 0 && t->size(1) == cos.size(1),
                "linear_f32_qkv: cos and sin must be contiguous float32 [", M, ", R/2] with R <= head_dim ", D);
  const bool quant = cache.scalar_type() == at::kChar;
  TORCH_CHECK(layer >= 0 && layer < c.L && (!quant || D % pmx_cpu::QUANT_GROUP == 0),
              "linear_f32_qkv: layer ", layer, " must be one of the cache's ", c.L);
  const int64_t* rows = pmx_cpu::checked_slots(slots, M, c, "linear_f32_qkv");
  at::Tensor out = at::empty({M, N}, x.options());
  const pmx_cpu::QKVEpilogue ep{cos.data_ptr<float>(), sin.data_ptr<float>(), R, heads, kv_heads, D, layer, &c,
                                quant ? &s : nullptr, rows};
  pmx_cpu::float_linear_fused_into(x.data_ptr<float>(), M, K, w.data_ptr(), float_weight(w), w.size(0), N,
                                   out.data_ptr<float>(), {.norm = np, .eps = static_cast<float>(eps), .qkv = &ep});
  return out;
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  check(x, w, N, NB);
  TORCH_CHECK(is_float_weight(w), "packed weight must be float32, bfloat16 or float16, not ", w.scalar_type());
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  pmx_cpu::float_linear_into(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr(), float_weight(w), w.size(0), N,
                             out.data_ptr<float>());
  return out;
}

void check_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t N) {
  check(x, w, N, NB);
  TORCH_CHECK(w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat && scale.numel() == N,
              "int8: packed weight must be int8 and scale float32 [N]");
}

void dequant_into(const float* xp, int64_t M, int64_t K, const void* w, const float* sp, int64_t method, int64_t G,
                  int64_t blocks, int64_t N, float* op, const float* offs = nullptr);

void int8_into(const float* xp, int64_t M, int64_t K, const int8_t* wp, const float* sp, int64_t blocks, int64_t N,
               float* op) {
#ifdef PMX_AVX2_ROWS
  if (M > avx2::ROWS_MAX) return dequant_into(xp, M, K, wp, sp, 8, 0, blocks, N, op);
  for_blocks(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m = 0; m < M; ++m)
        avx2::block_int8(xp + m * K, K, wp + b * K * NB, sp + b * NB, op + m * N + b * NB, std::min(NB, N - b * NB));
  });
  return;
#endif
  for_blocks(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, ncols = std::min(NB, N - n0);
      rows_of(M, [&](int64_t m0, int64_t mr) {
#define PMX_CALL(R) block_int8<R>(xp + m0 * K, K, wp + b * K * NB, op + m0 * N + n0, N, sp + n0, ncols)
        PMX_DISPATCH_MR(mr, PMX_CALL)
#undef PMX_CALL
      });
    }
  });
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t N) {
  check_int8(x, w, scale, N);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  int8_into(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<int8_t>(), scale.data_ptr<float>(), w.size(0), N,
            out.data_ptr<float>());
  return out;
}

// Scales per group (pack_group_scales): contiguous float32 [groups, cols], or with offsets (where `offsets` may be)
// [2, groups, cols].
void check_group_scales(const at::Tensor& scale, int64_t groups, int64_t cols, bool offsets, const char* what) {
  const bool plain = scale.dim() == 2 && scale.size(0) == groups && scale.size(1) == cols;
  const bool with_offsets = offsets && scale.dim() == 3 && scale.size(0) == 2 && scale.size(1) == groups &&
                            scale.size(2) == cols;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && (plain || with_offsets), what,
              ": scale must be contiguous float32 [K/G, N/64*64]", offsets ? " (or [2, K/G, N/64*64] with offsets)" : "");
}

// Checks the arguments of an int4 kernel and returns the layout of its packed weight.
int64_t check_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t G, int64_t N) {
  const int64_t K = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(G > 0 && G % 2 == 0 && K % G == 0, "int4: K (", K, ") must be a multiple of the even group size ", G);
  const int64_t layout = pmx_cpu::int4_layout(G), rows_per_k = layout == 1 ? 2 : 1;  // layout 1: 2 rows of 64 B per 4 k
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == K / rows_per_k &&
                  w.size(2) == NB * rows_per_k / 2 && w.size(0) * NB >= N && (w.size(0) - 1) * NB < N,
              "int4: packed weight must be contiguous uint8 [N/64, K/", rows_per_k, ", ", NB * rows_per_k / 2,
              "] (layout ", layout, ")");
  check_group_scales(scale, K / G, w.size(0) * NB, true, "int4");
  return layout;
}

// The offsets of an int4 scale tensor [2, K/G, Npad] (the scales, then the offsets), null for [K/G, Npad].
const float* group_offsets(const at::Tensor& scale) {
  return scale.dim() == 3 ? scale.data_ptr<float>() + scale.size(1) * scale.size(2) : nullptr;
}

void int4_into(const float* xp, int64_t M, int64_t K, const uint8_t* wp, const float* sp, int64_t G, int64_t blocks,
               int64_t N, float* op, const float* offs = nullptr) {
#ifdef PMX_AVX2_ROWS
  if (M > avx2::ROWS_MAX) return dequant_into(xp, M, K, wp, sp, 4, G, blocks, N, op, offs);
#endif
  const int64_t groups = K / G, lds = blocks * NB;
  std::vector<float> xs(M * groups);  // layout 0: sum of x per group (the -8 offset, or the offsets'); 1: s / 256
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(PMX_NO_VNNI)
  if (pmx_cpu::int4_layout(G) == 1) {
    std::vector<int8_t> q(2 * M * K);
    std::vector<int32_t> off(M * groups);
    std::vector<float> xsum(offs ? M * groups : 0);  // offsets: the float sums of x per group, and no -8
    quantize_x2(xp, M, K, G, q.data(), xs.data(), off.data());
    if (offs) {
      std::fill(off.begin(), off.end(), 0);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < groups; ++g) xsum[m * groups + g] = sum_floats(xp + m * K + g * G, G);
    }
    for_blocks(blocks, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * NB, ncols = std::min(NB, N - n0);
        for (int64_t m0 = 0; m0 < M; m0 += MR_VNNI) {
#define PMX_CALL(R)                                                                                                  \
  if (offs)                                                                                                          \
    block_int4_vnni<R, true>(q.data() + m0 * K, M * K, K, wp + b * K / 2 * NB, G, sp + n0, lds,                       \
                             xs.data() + m0 * groups, off.data() + m0 * groups, op + m0 * N + n0, N, ncols, offs + n0, \
                             xsum.data() + m0 * groups);                                                              \
  else                                                                                                               \
    block_int4_vnni<R>(q.data() + m0 * K, M * K, K, wp + b * K / 2 * NB, G, sp + n0, lds, xs.data() + m0 * groups,    \
                       off.data() + m0 * groups, op + m0 * N + n0, N, ncols)
          switch (std::min<int64_t>(MR_VNNI, M - m0)) {
            case 1: PMX_CALL(1); break;
            case 2: PMX_CALL(2); break;
            default: PMX_CALL(3); break;
          }
#undef PMX_CALL
        }
      }
    });
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) xs[m * groups + g] = sum_floats(xp + m * K + g * G, G);
#ifdef PMX_AVX2_ROWS
  for_blocks(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m = 0; m < M; ++m)
        avx2::block_grouped<4>(xp + m * K, K, wp + b * K * (NB / 2), G, sp + b * NB, lds,
                               offs ? offs + b * NB : nullptr, xs.data() + m * groups, op + m * N + b * NB,
                               std::min(NB, N - b * NB));
  });
  return;
#endif
  for_blocks(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, ncols = std::min(NB, N - n0);
      rows_of(M, [&](int64_t m0, int64_t mr) {
#define PMX_CALL(R)                                                                                                 \
  if (offs)                                                                                                         \
    block_int4<R, true>(xp + m0 * K, K, wp + b * K * (NB / 2), G, sp + n0, lds, xs.data() + m0 * groups,             \
                        op + m0 * N + n0, N, ncols, offs + n0);                                                      \
  else                                                                                                              \
    block_int4<R>(xp + m0 * K, K, wp + b * K * (NB / 2), G, sp + n0, lds, xs.data() + m0 * groups, op + m0 * N + n0, \
                  N, ncols)
        PMX_DISPATCH_MR(mr, PMX_CALL)
#undef PMX_CALL
      });
    }
  });
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t group_size,
                       int64_t N) {
  check_int4(x, w, scale, group_size, N);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  int4_into(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<uint8_t>(), scale.data_ptr<float>(), group_size,
            w.size(0), N, out.data_ptr<float>(), group_offsets(scale));
  return out;
}

// int8 in groups of G along k (GGUF's Q8_0): w points at one block [K, 64], scale at [K / G, Npad] (this block's
// column 0); each group's sums are scaled as they end, as block_int4's.
template <int MR>
inline void block_int8_group(const float* x, int64_t K, const int8_t* w, int64_t G, const float* scale, int64_t lds,
                             float* out, int64_t ldo, int64_t ncols) {
  float acc[MR][NB] = {};
  for (int64_t g = 0; g < K / G; ++g) {
    v16f a[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) a[m][j] = v16f{};
    for (int64_t k = g * G; k < (g + 1) * G; ++k) {
      const int8_t* wk = w + k * NB;
      _mm_prefetch((const char*)(wk + PF_INT8 * NB), _MM_HINT_T0);
      fma_rows<MR>(a, x, K, k, cvt_i8(wk), cvt_i8(wk + 16), cvt_i8(wk + 32), cvt_i8(wk + 48));
    }
    const float* s = scale + g * lds;
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) {
        v16f cur = load<v16f>(&acc[m][16 * j]);
        cur += load<v16f>(s + 16 * j) * a[m][j];
        std::memcpy(&acc[m][16 * j], &cur, sizeof(cur));
      }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < ncols; ++j) out[m * ldo + j] = acc[m][j];
}

void int8_group_into(const float* xp, int64_t M, int64_t K, const int8_t* wp, const float* sp, int64_t G,
                     int64_t blocks, int64_t N, float* op) {
  const int64_t lds = blocks * NB;
#ifdef PMX_AVX2_ROWS
  if (M > avx2::ROWS_MAX) return dequant_into(xp, M, K, wp, sp, 8, G, blocks, N, op);
  for_blocks(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m = 0; m < M; ++m)
        avx2::block_grouped<8>(xp + m * K, K, wp + b * K * NB, G, sp + b * NB, lds, nullptr, nullptr,
                               op + m * N + b * NB, std::min(NB, N - b * NB));
  });
  return;
#endif
  for_blocks(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, ncols = std::min(NB, N - n0);
      rows_of(M, [&](int64_t m0, int64_t mr) {
#define PMX_CALL(R) block_int8_group<R>(xp + m0 * K, K, wp + b * K * NB, G, sp + n0, lds, op + m0 * N + n0, N, ncols)
        PMX_DISPATCH_MR(mr, PMX_CALL)
#undef PMX_CALL
      });
    }
  });
}

void check_int8_group(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t G, int64_t N) {
  check(x, w, N, NB);
  TORCH_CHECK(w.scalar_type() == at::kChar && G > 0 && x.size(1) % G == 0, "int8 in groups: packed weight must be ",
              "int8 and K (", x.size(1), ") a multiple of the group size ", G);
  check_group_scales(scale, x.size(1) / G, w.size(0) * NB, false, "int8 in groups");
}

at::Tensor linear_int8_group(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t group_size,
                             int64_t N) {
  check_int8_group(x, w, scale, group_size, N);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  int8_group_into(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<int8_t>(), scale.data_ptr<float>(),
                  group_size, w.size(0), N, out.data_ptr<float>());
  return out;
}

// Prefill on quantised weights (many rows of x): each block of 64 channels is dequantised once per call into a
// float32 buffer of its own (K x 64, in L2) and multiplied by every row with the float32 GEMM tiles above; no
// dequantised copy of the whole weight is made. method 8: int8 blocks [N/64, K, 64], scale [N] (G 0) or
// [K/G, N/64*64]; method 4: int4 blocks of int4_layout(group_size), scale [K/G, N/64*64], offsets `offs` (or null)
// the same.
void dequant_into(const float* xp, int64_t M, int64_t K, const void* w, const float* sp, int64_t method, int64_t G,
                  int64_t blocks, int64_t N, float* op, const float* offs) {
  const int64_t layout = method == 4 ? pmx_cpu::int4_layout(G) : 0;
  const int64_t lds = blocks * NB;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(K * NB);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, ncols = std::min(NB, N - n0);
      float* d = buf.data();
      if (method == 8 && G > 0) {
        const int8_t* wb = static_cast<const int8_t*>(w) + b * K * NB;
        for (int64_t k = 0; k < K; ++k) {
          const float* s = sp + (k / G) * lds + n0;
          for (int64_t j = 0; j < NB; ++j) d[k * NB + j] = wb[k * NB + j] * s[j];
        }
      } else if (method == 8) {
        const int8_t* wb = static_cast<const int8_t*>(w) + b * K * NB;
        float s[NB] = {};
        for (int64_t j = 0; j < ncols; ++j) s[j] = sp[n0 + j];
        for (int64_t k = 0; k < K; ++k)
          for (int64_t j = 0; j < NB; ++j) d[k * NB + j] = wb[k * NB + j] * s[j];
      } else if (layout == 0) {  // row k: byte j = channel j (low nibble), j + 32 (high)
        const uint8_t* wb = static_cast<const uint8_t*>(w) + b * K * (NB / 2);
        for (int64_t k = 0; k < K; ++k) {
          const float* s = sp + (k / G) * lds + n0;
          const uint8_t* v = wb + k * (NB / 2);
          float* dk = d + k * NB;
          if (offs) {  // nibble * scale + offset
            const float* o = offs + (k / G) * lds + n0;
            for (int64_t j = 0; j < NB / 2; ++j) {
              dk[j] = (v[j] & 15) * s[j] + o[j];
              dk[j + NB / 2] = (v[j] >> 4) * s[j + NB / 2] + o[j + NB / 2];
            }
          } else {
            for (int64_t j = 0; j < NB / 2; ++j) {
              dk[j] = ((v[j] & 15) - 8) * s[j];
              dk[j + NB / 2] = ((v[j] >> 4) - 8) * s[j + NB / 2];
            }
          }
        }
      } else {  // layout 1: row 2 q + h, byte 4 c + t = channels 32 h + c (low), 32 h + 16 + c (high) of k = 4 q + t
        const uint8_t* wb = static_cast<const uint8_t*>(w) + b * (K / 2) * NB;
        const int bias = offs ? 0 : 8;  // the nibble's zero: 8 symmetric, 0 with offsets (added after the scale)
        for (int64_t r = 0; r < K / 2; ++r) {
          const int64_t q = r / 2, h = r % 2;
          for (int64_t c = 0; c < 16; ++c)
            for (int64_t t = 0; t < 4; ++t) {
              const int64_t k = 4 * q + t, ch = 32 * h + c;
              const uint8_t v = wb[r * NB + 4 * c + t];
              const float* s = sp + (k / G) * lds + n0;
              d[k * NB + ch] = ((v & 15) - bias) * s[ch];
              d[k * NB + ch + 16] = ((v >> 4) - bias) * s[ch + 16];
              if (offs) {
                const float* o = offs + (k / G) * lds + n0;
                d[k * NB + ch] += o[ch];
                d[k * NB + ch + 16] += o[ch + 16];
              }
            }
        }
      }
      pmx_cpu::block_panel_f32(xp, M, K, d, op + n0, N, ncols);
    }
  });
}

at::Tensor linear_dequant(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t method,
                          int64_t group_size, int64_t N) {
  TORCH_CHECK(method == 8 || method == 4, "linear_dequant: method must be 8 or 4, got ", method);
  if (method == 8 && group_size == 0) check_int8(x, w, scale, N);
  if (method == 8 && group_size != 0) check_int8_group(x, w, scale, group_size, N);
  if (method == 4) check_int4(x, w, scale, group_size, N);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  dequant_into(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr(), scale.data_ptr<float>(), method, group_size,
               w.size(0), N, out.data_ptr<float>(), method == 4 ? group_offsets(scale) : nullptr);
  return out;
}

}  // namespace

namespace pmx_cpu {

// The int4 layout the kernels read for groups of `group_size`: 1 (VNNI) where it takes the group, else 0.
int64_t int4_layout(int64_t group_size) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(PMX_NO_VNNI)
  if (group_size % 4 == 0 && group_size <= VNNI_MAX_GROUP) return 1;
#endif
  return 0;
}

PackedLinear packed_linear(const at::Tensor& w, const at::Tensor& scale, int64_t kind, int64_t group, int64_t n,
                           const std::string& what) {
  PackedLinear p;
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(0) * NB >= n && (w.size(0) - 1) * NB < n, what,
              ": packed weight must be contiguous [N/64, ., .] for N=", n);
  p.w = w.data_ptr(), p.kind = kind, p.group = group, p.n = n, p.blocks = w.size(0);
  if (kind == 32 || kind == 16) {
    TORCH_CHECK(w.size(2) == NB && (kind == 32 ? w.scalar_type() == at::kFloat
                                               : w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
                what, ": ", kind == 32 ? "float32" : "bfloat16 or float16", " blocks [N/64, K, 64] expected, not ",
                w.scalar_type(), " ", w.sizes());
    p.k = w.size(1), p.half = float_weight(w);
  } else if (kind == 8 && group > 0) {
    TORCH_CHECK(w.scalar_type() == at::kChar && w.size(2) == NB && w.size(1) % group == 0, what,
                ": int8 blocks [N/64, K, 64] with K a multiple of the group size ", group, " expected");
    p.k = w.size(1);
    check_group_scales(scale, p.k / group, w.size(0) * NB, false, what.c_str());
    p.scale = scale.data_ptr<float>();
  } else if (kind == 8) {
    TORCH_CHECK(w.scalar_type() == at::kChar && w.size(2) == NB && scale.scalar_type() == at::kFloat &&
                    scale.is_contiguous() && scale.numel() == n,
                what, ": int8 blocks [N/64, K, 64] and float32 scales [N] expected");
    p.k = w.size(1), p.scale = scale.data_ptr<float>();
  } else {
    TORCH_CHECK(kind == 4, what, ": kind must be 32, 16, 8 or 4, got ", kind);
    const int64_t rows_per_k = int4_layout(group) == 1 ? 2 : 1;
    p.k = w.size(1) * rows_per_k;
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(2) == NB * rows_per_k / 2 && group > 0 && p.k % group == 0,
                what, ": int4 blocks of layout ", rows_per_k - 1, " expected for groups of ", group);
    check_group_scales(scale, p.k / group, w.size(0) * NB, true, what.c_str());
    p.scale = scale.data_ptr<float>(), p.offset = group_offsets(scale);
  }
  return p;
}

void linear_into(const PackedLinear& lin, const float* x, int64_t M, float* y, int64_t dequant_above) {
  if (lin.kind == 32 || lin.kind == 16) {
    float_linear_into(x, M, lin.k, lin.w, lin.kind == 32 ? FloatWeight::f32 : lin.half, lin.blocks, lin.n, y);
  } else if (M > dequant_above) {
    dequant_into(x, M, lin.k, lin.w, lin.scale, lin.kind, lin.group, lin.blocks, lin.n, y, lin.offset);
  } else if (lin.kind == 8 && lin.group > 0) {
    int8_group_into(x, M, lin.k, static_cast<const int8_t*>(lin.w), lin.scale, lin.group, lin.blocks, lin.n, y);
  } else if (lin.kind == 8) {
    int8_into(x, M, lin.k, static_cast<const int8_t*>(lin.w), lin.scale, lin.blocks, lin.n, y);
  } else {
    int4_into(x, M, lin.k, static_cast<const uint8_t*>(lin.w), lin.scale, lin.group, lin.blocks, lin.n, y, lin.offset);
  }
}

}  // namespace pmx_cpu

namespace {

// out [M, n] = x [M, K] W^T into a given buffer (runner.engine.model.SeqParallel: a shared-memory area), on the packed
// weight of any kind, with what the kind's own op runs at M rows.
void linear_into_(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t kind, int64_t group,
                  int64_t n, int64_t dequant_above, at::Tensor out) {
  const pmx_cpu::PackedLinear p = pmx_cpu::packed_linear(w, scale, kind, group, n, "linear_into_");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == p.k,
              "linear_into_: x must be contiguous float32 [M, ", p.k, "]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == x.size(0) * n,
              "linear_into_: out must be contiguous float32 of ", x.size(0), " x ", n, " elements");
  pmx_cpu::linear_into(p, x.data_ptr<float>(), x.size(0), out.data_ptr<float>(), dequant_above);
}

}  // namespace

TORCH_LIBRARY(pmx_cpu, m) {
  m.def("linear_f32(Tensor x, Tensor w, int n) -> Tensor");
  m.def("linear_f32_fused(Tensor x, Tensor w, int n, bool swiglu=False, Tensor? norm=None, float eps=0.0, "
        "Tensor? residual=None, bool glu_out=False) -> Tensor");
  m.def("linear_f32_qkv(Tensor x, Tensor w, int n, Tensor? norm, float eps, Tensor cos, Tensor sin, Tensor(a!) cache, "
        "Tensor(b!)? scale, int layout, int layer, Tensor slots) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor w, Tensor scale, int n) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor w, Tensor scale, int group_size, int n) -> Tensor");
  m.def("linear_int8_group(Tensor x, Tensor w, Tensor scale, int group_size, int n) -> Tensor");
  m.def("linear_dequant(Tensor x, Tensor w, Tensor scale, int method, int group_size, int n) -> Tensor");
  m.def("int4_layout(int group_size) -> int", &pmx_cpu::int4_layout);
  m.def("bf16_pair_channels() -> int", &pmx_cpu::bf16_pair_channels);
  m.def("bf16_k_pairs() -> bool", &pmx_cpu::bf16_k_pairs);
  m.def("linear_into_(Tensor x, Tensor w, Tensor scale, int kind, int group, int n, int dequant_above, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pmx_cpu, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_f32_fused", &linear_f32_fused);
  m.impl("linear_f32_qkv", &linear_f32_qkv);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
  m.impl("linear_int8_group", &linear_int8_group);
  m.impl("linear_dequant", &linear_dequant);
  m.impl("linear_into_", &linear_into_);
}
