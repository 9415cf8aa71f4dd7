// The linear layers on float weights: y[m, n] = sum_k x[m, k] W[n, k] with x float32 and W float32, bfloat16 or
// float16, stored as the packing code (runner/kernels/cpu_ext.py, pack_blocks) leaves it: blocks of 64 output channels,
// k-major inside a block ([N/64, K, 64], rows padded with zeros). Half-precision weights are widened to float32 in
// registers as they are loaded (bfloat16: its 16 bits are the high half of a float32; float16: F16C's vcvtph2ps) and
// every product is accumulated in float32, so a half-precision weight gives the float32 GEMM's result on its values
// while a decode step reads half the bytes. Where the CPU has AVX512-BF16, bfloat16 weights go through its
// dot-product instruction instead, on x rounded to bfloat16 (namespace dot, below).
//
// The register tile is MR rows of x by NV vectors of channels, sized to the vector registers the machine has:
// AVX-512 (32 of 16 floats): 6 rows x 64 channels (24 accumulators); AVX2 (16 of 8 floats): 6 rows x 16 channels (12
// accumulators: the 6 x 16 micro-kernel of BLIS's Haswell sgemm), the block taken as 4 panels of 16 channels. One row
// (batch-1 decode) takes the whole block, 64 channels, in one pass, prefetching a fixed distance ahead. A few rows
// (batched decode) walk the block in chunks of k that stay in L2 while every row group and panel reads them, and the
// tiles of a chunk ask for the next chunk's lines one at a time, spread evenly over the chunk's compute (a burst of
// requests at a chunk's start left the tiles waiting on memory: 2x slower at 16 rows on AVX2). Prefill (many rows)
// copies each chunk of a block once into a float32 buffer of the thread's own, panel by panel (half precision widened
// as it is copied), so that every tile walks its panel sequentially from L1 / L2 at the float32 FMA rate whatever the
// weight's width.
// bfloat16 blocks are stored with each group of 2 L channels interleaved in pairs (channel i, then channel L + i;
// pmx_cpu::bf16_pair_channels(), which the packing code reads), so that one vector load of 2 L weights widens with
// one shift (the low halves: channels 0..L) and one mask (the high halves: channels L..2L) into two float32 vectors
// in channel order, where the plain order needs a zero-extending load and a shift per vector: the tiles of several
// rows, bound by instructions, ran batched decode 1.16-1.19x faster (AVX2). The row pass (batch 1, bound by memory)
// keeps the zero-extending loads, which streamed faster there (see tile()).
// Threads: blocks of 64 channels are handed out a few at a time as threads ask (for_blocks, cpu_kernels.h).

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int L = 16;  // floats per vector register
constexpr int NV_TILE = 4;  // vectors of channels in the many-rows tile (64 channels)
#else
constexpr int L = 8;
constexpr int NV_TILE = 2;  // (16 channels: 6 x 2 accumulators + 2 weights + 1 broadcast fit AVX2's 16 registers)
#endif
typedef float vf __attribute__((vector_size(L * sizeof(float))));

constexpr int64_t NB = 64;     // output channels per block
constexpr int MR = 6;          // rows of x per tile
constexpr int NV_ROW = NB / L;  // one row: the whole block in one pass

using pmx_cpu::FloatWeight;
struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };

// L weights at p widened to float32.
inline vf load_w(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 2 L bfloat16 weights at p, interleaved in pairs (see the top), widened to float32: channels 0..L into lo, L..2L
// into hi.
inline void load_w2(const Bf16* p, vf& lo, vf& hi) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_loadu_si512(p);
  lo = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  hi = (vf)_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#elif defined(__AVX2__)
  const __m256i v = _mm256_loadu_si256((const __m256i*)p);
  lo = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = (vf)_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
  for (int i = 0; i < L; ++i) {
    const uint32_t u = static_cast<uint32_t>(p[2 * i].bits) << 16, v = static_cast<uint32_t>(p[2 * i + 1].bits) << 16;
    std::memcpy(&lo[i], &u, 4);
    std::memcpy(&hi[i], &v, 4);
  }
#endif
}

inline vf load_w(const F16* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__) && defined(__AVX__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vf v;
  for (int i = 0; i < L; ++i) v[i] = static_cast<float>(c10::Half(p[i].bits, c10::Half::from_bits()));
  return v;
#endif
}

// L bfloat16 weights at p widened to float32 by a zero-extending load and a shift, in memory order: for the pairs
// (above) channels 0, L, 1, L + 1, ... of a group.
inline vf load_w_zx(const Bf16* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
  vf v;
  for (int i = 0; i < L; ++i) {
    const uint32_t u = static_cast<uint32_t>(p[i].bits) << 16;
    std::memcpy(&v[i], &u, 4);
  }
  return v;
#endif
}

// 2 L weights at p widened to float32: the first L into lo, the next L into hi (bfloat16: interleaved, above).
template <typename W>
inline void load_w2(const W* p, vf& lo, vf& hi) {
  lo = load_w(p);
  hi = load_w(p + L);
}

// Bytes of the weight stream prefetched ahead of the k being read in the streaming (decode) walk: the hardware
// prefetchers alone left batch-1 decode ~10% under the bandwidth it reaches with it (measured on float32 blocks; past
// the block's end it reads into the next block, which is next in memory).
constexpr int64_t PF_BYTES = 8192;

// The cache lines of BYTES bytes at p (a k-row of a panel, some distance ahead of the one being read).
template <int64_t BYTES>
inline void prefetch_bytes(const char* p) {
  for (int64_t i = 0; i < BYTES; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// How a tile prefetches the weight stream as it reads it. kNone: not at all. kAhead: each k-row of the panel the
// distance PF_BYTES further on (a single pass over the block: batch-1 decode, and AVX-512's one tile of up to MR
// rows). kSpread: the lines of the next
// chunk in order, one every `every` k-rows of all the tiles that read this chunk, so that the requests of a chunk's
// successor are spread evenly over its compute instead of leaving the first tiles waiting on a burst of misses.
enum Prefetch { kNone, kAhead, kSpread };

struct Spread {
  const char* p;    // the next line to ask for
  const char* end;  // past the last
  int every, left;  // one line every `every` k-rows; k-rows left until the next
};

// out[m][0..ncols) (+)= sum_{k0 <= k < k1} x[m, k] w[k][0..NV L) for R rows of x (row stride ldx); w: a panel of the
// block (row stride NB); out row stride ldo.
// The row pass (one row, prefetching ahead: batch-1 decode) widens bfloat16 L weights at a time in memory order with
// zero-extending loads, and puts its sums back in channel order as it stores them: for one row that streamed at
// 1.06x the pairs' rate (2 threads, 256 MiB of blocks in huge pages, Zen 1: 20.5 against 19.4 GB/s), while tiles of
// several rows, which widen each weight once for all of them, gain from the pairs' fewer instructions (batch 16 1.16x).
template <int R, int NV, Prefetch PF, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t k0, int64_t k1, float* out, int64_t ldo,
                 int64_t ncols, bool accumulate, Spread* spread = nullptr,
                 int64_t ldw = NB) {
  static_assert(NV % 2 == 0, "weights are loaded 2 L channels at a time");
  constexpr bool memory_order = std::is_same_v<W, Bf16> && R == 1 && PF == kAhead;
  vf a[R][NV];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NV; ++j) a[m][j] = vf{};
  Spread sp = PF == kSpread ? *spread : Spread{};
  for (int64_t k = k0; k < k1; ++k) {
    const W* wk = w + k * ldw;
    if (PF == kAhead) prefetch_bytes<NV * L * (int64_t)sizeof(W)>(reinterpret_cast<const char*>(wk) + PF_BYTES);
    if (PF == kSpread && --sp.left == 0) {
      sp.left = sp.every;
      if (sp.p < sp.end) {
        _mm_prefetch(sp.p, _MM_HINT_T0);
        sp.p += 64;
      }
    }
    vf wv[NV];
    if constexpr (memory_order)
      for (int j = 0; j < NV; ++j) wv[j] = load_w_zx(wk + j * L);
    else
      for (int j = 0; j < NV; j += 2) load_w2(wk + j * L, wv[j], wv[j + 1]);
    for (int m = 0; m < R; ++m) {
      const float xv = x[m * ldx + k];
      for (int j = 0; j < NV; ++j) a[m][j] += xv * wv[j];
    }
  }
  if (PF == kSpread) *spread = sp;
  if constexpr (memory_order) {  // the sum at q (q-th in memory) is channel q / 2 + (q % 2) L of its group of 2 L
    float tmp[NV * L], sums[NV * L];
    std::memcpy(tmp, a[0], sizeof(tmp));
    for (int q = 0; q < NV * L; ++q) sums[q / (2 * L) * 2 * L + q % 2 * L + q % (2 * L) / 2] = tmp[q];
    for (int64_t j = 0; j < ncols; ++j) out[j] = accumulate ? out[j] + sums[j] : sums[j];
    return;
  }
  for (int m = 0; m < R; ++m) {
    float* o = out + m * ldo;
    if (ncols == NV * L) {
      for (int j = 0; j < NV; ++j) {
        vf v = a[m][j];
        if (accumulate) v += load_w(o + j * L);
        std::memcpy(o + j * L, &v, sizeof(v));
      }
    } else {
      float tmp[NV * L];
      std::memcpy(tmp, a[m], sizeof(tmp));
      for (int64_t j = 0; j < ncols; ++j) o[j] = accumulate ? o[j] + tmp[j] : tmp[j];
    }
  }
}

// The rows [0, M) of x against one block's k in [k0, k1): tiles of up to MR rows by NV_TILE vectors, the block's
// panels of NV_TILE L channels in turn for each MR rows (their k-chunk of x stays in L1 across the panels).
template <Prefetch PF, typename W>
inline void rows_by_panels(const float* x, int64_t M, int64_t K, const W* w, int64_t k0, int64_t k1, float* out,
                           int64_t ldo, int64_t ncols, bool accumulate, Spread* spread = nullptr,
                           bool panel_major = false) {
  constexpr int64_t P = NV_TILE * L;
  const int64_t ldw = panel_major ? P : NB;
  for (int64_t m0 = 0; m0 < M; m0 += MR) {
    const int64_t r = std::min<int64_t>(MR, M - m0);
    for (int64_t c0 = 0; c0 < ncols; c0 += P) {
      const int64_t nc = std::min(P, ncols - c0);
      const float* xm = x + m0 * K;
      float* o = out + m0 * ldo + c0;
      const W* wp = panel_major ? w + c0 * (k1 - k0) - k0 * P : w + c0;  // (its row k at wp + k ldw)
      switch (r) {
#define PMX_TILE(R) \
  case R: tile<R, NV_TILE, PF>(xm, K, wp, k0, k1, o, ldo, nc, accumulate, spread, ldw); break;
        PMX_TILE(1) PMX_TILE(2) PMX_TILE(3) PMX_TILE(4) PMX_TILE(5)
        default: tile<MR, NV_TILE, PF>(xm, K, wp, k0, k1, o, ldo, nc, accumulate, spread, ldw);
#undef PMX_TILE
      }
    }
  }
}

// k per chunk: decode (streaming) chunks of a block stay in L2 (64 KiB: 16 KiB chunks in L1 were slower, their tiles'
// set-up and the output's reloads repeated 4x as often); prefill chunks, copied panel-major, 128 KiB of float32.
template <typename W>
constexpr int64_t kc_stream() { return (64 << 10) / (NB * (int64_t)sizeof(W)); }
constexpr int64_t KC_PREFILL = (128 << 10) / (NB * sizeof(float));

// Rows above which a call is prefill: the block's chunks are copied (widened) once into float32 panels and walked
// from cache; at or below, they are streamed from memory once, converted in registers.
constexpr int64_t STREAM_MAX_ROWS = 32;

// A prefill call's work as (block, rows) units, handed out by for_blocks: blocks alone are too coarse where a layer
// has few (a 768-channel projection: 12 blocks of ~120-320 us each at 512 rows, and a thread left waiting up to one
// at the end), so the rows are cut into `parts` (each a multiple of MR) until there are ~32 units a thread. Units go
// block-major, so a thread's run of them reads one block (in cache) for consecutive rows.
struct RowParts {
  int64_t M, blocks, parts, rows;  // rows a part (the last: what is left)
  RowParts(int64_t M_, int64_t blocks_) : M(M_), blocks(blocks_) {
    const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    const int64_t want = M <= STREAM_MAX_ROWS || threads <= 1 ? 1 : (32 * threads + blocks - 1) / blocks;
    parts = std::clamp<int64_t>(want, 1, std::max<int64_t>(1, M / (8 * MR)));  // (a part: 8 tiles or more)
    rows = (M + parts - 1) / parts;
    rows = std::max<int64_t>(MR, (rows + MR - 1) / MR * MR);
    parts = std::max<int64_t>(1, (M + rows - 1) / rows);
  }
  int64_t units() const { return blocks * parts; }
  // unit u: block b, rows [r0, r1)
  void of(int64_t u, int64_t& b, int64_t& r0, int64_t& r1) const {
    b = u / parts;
    r0 = u % parts * rows;
    r1 = std::min(M, r0 + rows);
  }
};

template <typename W>
void stream_block(const float* x, int64_t M, int64_t K, const W* wb, float* out, int64_t ldo, int64_t ncols) {
  if (M == 1) {  // the whole block in one pass, prefetched
    tile<1, NV_ROW, kAhead>(x, K, wb, 0, K, out, ldo, ncols, false);
    return;
  }
  if (NV_TILE * L == NB && M <= MR) {  // one tile covers the block (AVX-512): one pass
    rows_by_panels<kAhead>(x, M, K, wb, 0, K, out, ldo, ncols, false);
    return;
  }
  constexpr int64_t KC = kc_stream<W>();
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    // the next chunk (or the next block's first: next in memory) asked for line by line while this one is computed
    const char* next = reinterpret_cast<const char*>(wb + k1 * NB);
    const int64_t lines = KC * NB * (int64_t)sizeof(W) / 64;
    const int64_t reads = ((M + MR - 1) / MR) * (NB / (NV_TILE * L)) * (k1 - k0);  // k-rows all the tiles read
    Spread sp{next, next + lines * 64, (int)std::max<int64_t>(1, reads / lines), 1};
    rows_by_panels<kSpread>(x, M, K, wb, k0, k1, out, ldo, ncols, k0 > 0, &sp);
  }
}

// rows [0, kc) of a block chunk (row stride NB) widened to float32 panel-major: panel p (NV_TILE L channels) at
// out + p kc P, its row k at + k P, so that a tile walks its panel sequentially.
template <typename W>
inline void widen_panels(const W* w, int64_t kc, float* out) {
  constexpr int64_t P = NV_TILE * L;
  for (int64_t k = 0; k < kc; ++k)
    for (int64_t p = 0; p < NB / P; ++p)
      for (int64_t j = 0; j < P; j += 2 * L) {
        vf lo, hi;
        load_w2(w + k * NB + p * P + j, lo, hi);
        std::memcpy(out + p * kc * P + k * P + j, &lo, sizeof(lo));
        std::memcpy(out + p * kc * P + k * P + j + L, &hi, sizeof(hi));
      }
}


#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(PMX_NO_BF16_DOT)
#define PMX_BF16_DOT 1
// bfloat16 weights on AVX512-BF16: vdpbf16ps, one instruction for 16 channels x a pair of k (32 products, each exact
// in float32, accumulated in float32): twice the FMA rate and a third of widening's instructions. The packing code
// then stores a block's k-rows in pairs (pmx_cpu::bf16_k_pairs(): row pair p holds (w[2p][c], w[2p+1][c]) for c in
// 0..64, a 32-bit word a channel; an odd K's last row alone, plainly), so a vector load is 16 channels' pairs in
// channel order. x is taken in the same pairs of k, rounded to bfloat16 (to nearest, ties to even) at every batch
// size, as llama.cpp's and OpenVINO's bf16 paths do: the result is the float32 GEMM's on x's rounded values (its
// error against float32 x, ~2e-3 of the largest output, is the same for one row as for a batch, so a sequence's
// logits do not depend on the batch it runs in; two bfloat16 parts, x = hi + lo, would make batch 1 as exact as
// float32 for a second product, and differ from every other batch size).
namespace dot {

constexpr int NVB = NB / 16;  // vectors of 16 channels' pairs in a block

// x [M, K] rounded to bfloat16, in pairs of k ([M, (K + 1) / 2] 32-bit words: k at the low half, k + 1 the high;
// an odd K's last padded with a zero). swiglu: x is silu(g) * u of gate / up rows [M, 2 K] (g | u), at bfloat16's
// precision (silu_mul_bf16: what the rounding keeps) as it is converted; norm: x is rms_norm(x) * norm (eps),
// computed a row at a time into a buffer in L1.
inline void x_pairs(const float* x, int64_t M, int64_t K, uint32_t* xp, bool swiglu = false,
                    const float* norm = nullptr, float eps = 0) {
  const int64_t kh = (K + 1) / 2;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    std::vector<float> act(norm ? K : 0);
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = swiglu ? x + m * 2 * K : x + m * K;
      if (norm) {  // (one row: runs here, in this thread)
        pmx_cpu::skip_rms_norm_into(r, nullptr, norm, 1, K, eps, nullptr, act.data());
        r = act.data();
      }
      for (int64_t k = 0; k < K; k += 32) {  // 32 values: x[k..k+16) into the low 16 words, x[k+16..k+32) the high
        const int64_t n = std::min<int64_t>(32, K - k);
        const __mmask16 m_a = n >= 16 ? 0xFFFF : (1u << n) - 1;
        const __mmask16 m_b = n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0;
        const __mmask16 words = (n + 1) / 2 >= 16 ? 0xFFFF : (1u << ((n + 1) / 2)) - 1;
        __m512 a = _mm512_maskz_loadu_ps(m_a, r + k), b = _mm512_maskz_loadu_ps(m_b, r + k + 16);
        if (swiglu) {  // (the up half: K on)
          a = pmx_cpu::silu_mul_bf16(a, _mm512_maskz_loadu_ps(m_a, r + K + k));
          b = pmx_cpu::silu_mul_bf16(b, _mm512_maskz_loadu_ps(m_b, r + K + k + 16));
        }
        _mm512_mask_storeu_epi32(xp + m * kh + k / 2, words, (__m512i)_mm512_cvtne2ps_pbh(b, a));
      }
    }
  });
}

// out[m][0..ncols) (+)= x[m] . w over the k-pairs [p0, p1) of a block w (k-pair layout, above) for R rows of x pairs
// (row stride ldx words), prefetching as PF says; res (not accumulating): res[m][0..ncols) (row stride ldo) added.
template <int R, Prefetch PF>
inline void tile(const uint32_t* xp, int64_t ldx, const Bf16* w, int64_t K, int64_t p0,
                 int64_t p1, float* out, int64_t ldo, int64_t ncols, bool accumulate, const float* res,
                 Spread* spread = nullptr) {
  __m512 a[R][NVB];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NVB; ++j) a[m][j] = _mm512_setzero_ps();
  Spread sp = PF == kSpread ? *spread : Spread{};
  const auto step = [&](int64_t p, const __m512i (&wv)[NVB]) {
    for (int m = 0; m < R; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * ldx + p]));
      for (int j = 0; j < NVB; ++j) a[m][j] = _mm512_dpbf16_ps(a[m][j], (__m512bh)wv[j], xb);
    }
  };
  const int64_t pairs_end = std::min(p1, K / 2);  // (an odd K's last row after them)
  for (int64_t p = p0; p < pairs_end; ++p) {
    const Bf16* wp = w + 2 * p * NB;
    if (PF == kAhead) prefetch_bytes<2 * NB * (int64_t)sizeof(Bf16)>(reinterpret_cast<const char*>(wp) + PF_BYTES);
    if (PF == kSpread && --sp.left == 0) {
      sp.left = sp.every;
      for (int i = 0; i < 4 && sp.p < sp.end; ++i, sp.p += 64) _mm_prefetch(sp.p, _MM_HINT_T0);
    }
    __m512i wv[NVB];
    for (int j = 0; j < NVB; ++j) wv[j] = _mm512_loadu_si512(wp + 32 * j);
    step(p, wv);
  }
  if (pairs_end < p1) {  // an odd K's last row, stored plainly: (w, 0) pairs
    const Bf16* wp = w + 2 * pairs_end * NB;
    __m512i wv[NVB];
    for (int j = 0; j < NVB; ++j) wv[j] = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wp + 16 * j)));
    step(pairs_end, wv);
  }
  if (PF == kSpread) *spread = sp;
  const float* add = accumulate ? out : res;  // (what the sums are added to, if anything)
  for (int m = 0; m < R; ++m) {
    float* o = out + m * ldo;
    const float* ad = add ? add + m * ldo : nullptr;
    if (ncols == NB) {
      for (int j = 0; j < NVB; ++j) {
        __m512 v = a[m][j];
        if (ad) v = _mm512_add_ps(v, _mm512_loadu_ps(ad + 16 * j));
        _mm512_storeu_ps(o + 16 * j, v);
      }
    } else {
      float tmp[NB];
      for (int j = 0; j < NVB; ++j) _mm512_storeu_ps(tmp + 16 * j, a[m][j]);
      for (int64_t j = 0; j < ncols; ++j) o[j] = ad ? ad[j] + tmp[j] : tmp[j];
    }
  }
}

// The rows [0, M) of x pairs against the pairs [p0, p1) of a block, MR rows a tile.
template <Prefetch PF>
inline void rows(const uint32_t* xp, int64_t M, int64_t kh, const Bf16* w, int64_t K, int64_t p0,
                 int64_t p1, float* out, int64_t ldo, int64_t ncols, bool accumulate, const float* res,
                 Spread* spread = nullptr) {
  for (int64_t m0 = 0; m0 < M; m0 += MR) {
    const uint32_t* xm = xp + m0 * kh;
    float* o = out + m0 * ldo;
    const float* rm = res ? res + m0 * ldo : nullptr;
    switch (std::min<int64_t>(MR, M - m0)) {
#define PMX_TILE(R) \
  case R: tile<R, PF>(xm, kh, w, K, p0, p1, o, ldo, ncols, accumulate, rm, spread); break;
      PMX_TILE(1) PMX_TILE(2) PMX_TILE(3) PMX_TILE(4) PMX_TILE(5)
      default: tile<MR, PF>(xm, kh, w, K, p0, p1, o, ldo, ncols, accumulate, rm, spread);
#undef PMX_TILE
    }
  }
}

// Pairs of k a chunk: batched decode 16 KiB (in L1: at 16 rows 629 GFLOP/s against 578 for 64 KiB chunks), prefill
// 256 KiB (in L2: at 512 rows 765 against 683 for 16 KiB, fewer passes over the output rows; Zen 5, 2 threads).
constexpr int64_t DOT_STREAM_PAIRS = 64, DOT_PREFILL_PAIRS = 1024;

// One block against all M rows: in one pass where one tile covers the rows; else in chunks of pairs that every tile
// reads in turn, the next chunk's lines asked for over the current one's compute (as stream_block). res: added to
// the output (the block's columns of a residual [M, ldo]) as the first chunk stores it.
inline void block(const uint32_t* xp, int64_t M, int64_t K, const Bf16* wb, float* out,
                  int64_t ldo, int64_t ncols, const float* res) {
  const int64_t kh = (K + 1) / 2;
  if (M <= MR) {
    rows<kAhead>(xp, M, kh, wb, K, 0, kh, out, ldo, ncols, false, res);
    return;
  }
  const int64_t PC = M <= STREAM_MAX_ROWS ? DOT_STREAM_PAIRS : DOT_PREFILL_PAIRS;
  for (int64_t p0 = 0; p0 < kh; p0 += PC) {
    const int64_t p1 = std::min(kh, p0 + PC);
    const char* next = reinterpret_cast<const char*>(wb + 2 * p1 * NB);
    const int64_t lines = PC * 2 * NB * (int64_t)sizeof(Bf16) / 64;
    const int64_t reads = ((M + MR - 1) / MR) * (p1 - p0);  // pairs all the tiles read (4 lines asked for each time)
    Spread sp{next, next + lines * 64, (int)std::max<int64_t>(1, 4 * reads / lines), 1};
    rows<kSpread>(xp, M, kh, wb, K, p0, p1, out, ldo, ncols, p0 > 0, res, &sp);
  }
}

}  // namespace dot
#endif

// pmx_cpu::QKVEpilogue on rows [r0, r1) of y [M, N], channels [c0, c1) (a unit's block, just computed: in cache).
void qkv_epilogue(const pmx_cpu::QKVEpilogue& e, float* y, int64_t N, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t D = e.D, half = e.R / 2, rot_end = std::min(c1, (e.H + e.KV) * D);
  for (int64_t r = r0; r < r1; ++r) {
    float* yr = y + r * N;
    const float *cs = e.cos + r * half, *sn = e.sin + r * half;
    for (int64_t c = c0; c < rot_end;) {  // a head's dims [d, d_end) of this range: its rotated pairs
      const int64_t h = c / D, d = c - h * D, d_end = std::min(std::min(D, e.R), d + (rot_end - c));
      if (d_end > d) pmx_cpu::rotate_pairs(yr + h * D + d, cs + d / 2, sn + d / 2, (d_end - d) / 2);
      c = h * D + D;  // (the rest of the head, past R, is not rotated)
    }
    for (int64_t c = std::max(c0, e.H * D); c < c1;) {  // k and v into the cache, a head's part at a time
      const int64_t h = c / D - e.H, kv = h / e.KV, g = h % e.KV, d = c % D, n = std::min(c1 - c, D - d);
      if (e.scales)
        pmx_cpu::quantize_int8(yr + c, n, e.cache->row<int8_t>(e.layer, kv, e.slots[r], g) + d,
                               e.scales->row<at::Half>(e.layer, kv, e.slots[r], g) + d / pmx_cpu::QUANT_GROUP);
      else
        std::memcpy(e.cache->row<float>(e.layer, kv, e.slots[r], g) + d, yr + c, n * sizeof(float));
      c += n;
    }
  }
}

#if PMX_BF16_DOT
// y = x W^T (+ res) on bfloat16 blocks; x float32 (rounded into pairs by x_pairs, with its swiglu / norm) or xb, x as
// bfloat16 already ([M, K], K even: its rows are their own pairs). glu (a gate | up layer, N = 2 F, F a multiple of
// 64): no y; glu [M, F] = silu(gate) * up rounded to bfloat16, the down projection's x: each unit computes a gate
// block and its up block (F / 64 blocks on) for its rows into buffers of its own, activates and rounds them there, so
// the [M, 2 F] float32 output never goes through memory and the down projection converts nothing.
void linear_dot(const float* x, const uint32_t* xb, int64_t M, int64_t K, const Bf16* w, int64_t blocks, int64_t N,
                float* y, uint16_t* glu = nullptr, const pmx_cpu::AroundProduct& a = {}) {
  const int64_t kh = (K + 1) / 2;
  std::unique_ptr<uint32_t[]> own(new uint32_t[xb ? 0 : M * kh]);  // (not zeroed: x_pairs writes every word)
  if (!xb) dot::x_pairs(x, M, K, own.get(), a.swiglu, a.norm, a.eps);
  const uint32_t* xp = xb ? xb : own.get();
  if (glu) {
    const int64_t F = N / 2, gate_blocks = F / NB;
    const RowParts rp(M, gate_blocks);
    pmx_cpu::for_blocks(rp.units(), [&](int64_t u0, int64_t u1) {
      std::vector<float> buf(2 * rp.rows * NB);  // the unit's gate and up [rows, 64]
      float *g = buf.data(), *up = g + rp.rows * NB;
      for (int64_t u = u0; u < u1; ++u) {
        int64_t j, r0, r1;
        rp.of(u, j, r0, r1);
        const int64_t m = r1 - r0;
        dot::block(xp + r0 * kh, m, K, w + j * K * NB, g, NB, NB, nullptr);
        dot::block(xp + r0 * kh, m, K, w + (j + gate_blocks) * K * NB, up, NB, NB, nullptr);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < NB; c += 32) {  // (32 values to bfloat16 in order, as x_pairs)
            const float *gr = g + r * NB + c, *ur = up + r * NB + c;
            const __m512 a = pmx_cpu::silu_mul_bf16(_mm512_loadu_ps(gr), _mm512_loadu_ps(ur));
            const __m512 b = pmx_cpu::silu_mul_bf16(_mm512_loadu_ps(gr + 16), _mm512_loadu_ps(ur + 16));
            _mm512_storeu_si512(glu + (r0 + r) * F + j * NB + c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
          }
      }
    });
    return;
  }
  const RowParts rp(M, blocks);
  pmx_cpu::for_blocks(rp.units(), [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      int64_t b, r0, r1;
      rp.of(u, b, r0, r1);
      const int64_t at = r0 * N + b * NB, ncols = std::min(NB, N - b * NB);  // (the unit's first output)
      dot::block(xp + r0 * kh, r1 - r0, K, w + b * K * NB, y + at, N, ncols, a.res ? a.res + at : nullptr);
      if (a.qkv) qkv_epilogue(*a.qkv, y, N, r0, r1, b * NB, b * NB + ncols);
    }
  });
}
#endif

// y = x W^T; ep: the qkv epilogue on each unit's rows; glu (a gate | up layer, N = 2 F, F a multiple of 64; y
// unused): glu [M, F] = silu(gate) * up in float32 (swiglu_into), a gate block and its up block computed for a unit's
// rows into buffers of its own (as linear_dot's bfloat16 glu: the [M, 2 F] output never goes through memory).
template <typename W>
void linear_blocks(const float* x, int64_t M, int64_t K, const W* w, int64_t blocks, int64_t N, float* y,
                   const pmx_cpu::QKVEpilogue* ep = nullptr, float* glu = nullptr) {
#if PMX_BF16_DOT
  if constexpr (std::is_same_v<W, Bf16>) {
    TORCH_CHECK(!glu, "bfloat16 dot products give the activation in bfloat16");
    return linear_dot(x, nullptr, M, K, w, blocks, N, y, nullptr, pmx_cpu::AroundProduct{.qkv = ep});
  }
#endif
  const int64_t gate_blocks = N / 2 / NB;
  const RowParts rp(M, glu ? gate_blocks : blocks);
  pmx_cpu::for_blocks(rp.units(), [&](int64_t u0, int64_t u1) {
    std::vector<float> buf(M <= STREAM_MAX_ROWS ? 0 : KC_PREFILL * NB);
    std::vector<float> gu(glu ? 3 * rp.rows * NB : 0);  // glu: the unit's gate, up and activation [rows, 64]
    // block b's columns of rows [r0, r0 + m) into out (row stride ldo)
    const auto product = [&](int64_t b, int64_t r0, int64_t m, float* out, int64_t ldo) {
      const int64_t ncols = std::min(NB, N - b * NB);
      const W* wb = w + b * K * NB;
      const float* xr = x + r0 * K;
      if (M <= STREAM_MAX_ROWS) return stream_block(xr, m, K, wb, out, ldo, ncols);
      for (int64_t k0 = 0; k0 < K; k0 += KC_PREFILL) {
        const int64_t k1 = std::min(K, k0 + KC_PREFILL);
        if constexpr (std::is_same_v<W, float>)
          if (NV_TILE * L == NB) {  // (AVX-512: a float32 block is its own one panel: the tiles walk it in place)
            rows_by_panels<kNone>(xr, m, K, wb, k0, k1, out, ldo, ncols, k0 > 0);
            continue;
          }
        // widened once into buf panel-major, then the float32 tiles
        widen_panels(wb + k0 * NB, k1 - k0, buf.data());
        rows_by_panels<kNone>(xr + k0, m, K, buf.data(), 0, k1 - k0, out, ldo, ncols, k0 > 0, nullptr, true);
      }
    };
    for (int64_t u = u0; u < u1; ++u) {
      int64_t b, r0, r1;
      rp.of(u, b, r0, r1);
      const int64_t m = r1 - r0;
      if (glu) {
        float *g = gu.data(), *up = g + rp.rows * NB, *act = up + rp.rows * NB;
        product(b, r0, m, g, NB);
        product(b + gate_blocks, r0, m, up, NB);
        pmx_cpu::swiglu_into(g, NB, up, NB, m, NB, act);
        for (int64_t r = 0; r < m; ++r)
          std::memcpy(glu + (r0 + r) * (N / 2) + b * NB, act + r * NB, NB * sizeof(float));
        continue;
      }
      product(b, r0, m, y + r0 * N + b * NB, N);
      if (ep) qkv_epilogue(*ep, y, N, r0, r1, b * NB, b * NB + std::min(NB, N - b * NB));
    }
  });
}

// linear_blocks on a packed float weight of `type` (y, ep and glu as there).
void float_blocks(const float* x, int64_t M, int64_t K, const void* w, FloatWeight type, int64_t blocks, int64_t N,
                  float* y, const pmx_cpu::QKVEpilogue* ep = nullptr, float* glu = nullptr) {
  switch (type) {
    case FloatWeight::f32: linear_blocks(x, M, K, static_cast<const float*>(w), blocks, N, y, ep, glu); break;
    case FloatWeight::bf16: linear_blocks(x, M, K, static_cast<const Bf16*>(w), blocks, N, y, ep, glu); break;
    case FloatWeight::f16: linear_blocks(x, M, K, static_cast<const F16*>(w), blocks, N, y, ep, glu); break;
  }
}

// x [M, K] itself, or (norm given) rms_norm(x) * norm in a buffer `keep` holds: the float32 tiles read x as it is,
// so a norm is a pass of its own before them.
const float* normed_rows(const float* x, int64_t M, int64_t K, const float* norm, float eps,
                         std::unique_ptr<float[]>& keep) {
  if (!norm) return x;
  std::unique_ptr<float[]> out(new float[M * K]);
  pmx_cpu::skip_rms_norm_into(x, nullptr, norm, M, K, eps, nullptr, out.get());
  keep = std::move(out);
  return keep.get();
}

}  // namespace

namespace pmx_cpu {

void float_linear_into(const float* x, int64_t M, int64_t K, const void* w, FloatWeight type, int64_t blocks,
                       int64_t N, float* y) {
  float_blocks(x, M, K, w, type, blocks, N, y);
}

int64_t bf16_pair_channels() { return 2 * L; }

bool bf16_k_pairs() {
#if PMX_BF16_DOT
  return true;
#else
  return false;
#endif
}

void block_panel_f32(const float* x, int64_t M, int64_t K, const float* block, float* out, int64_t ldo,
                     int64_t ncols) {
  for (int64_t k0 = 0; k0 < K; k0 += KC_PREFILL)
    rows_by_panels<kNone>(x, M, K, block, k0, std::min(K, k0 + KC_PREFILL), out, ldo, ncols, k0 > 0);
}

void float_linear_fused_into(const float* x, int64_t M, int64_t K, const void* w, FloatWeight type, int64_t blocks,
                             int64_t N, float* y, const AroundProduct& a) {
  TORCH_CHECK(!(a.res && a.qkv), "the qkv epilogue stores k and v as they are computed: no residual to add");
#if PMX_BF16_DOT
  if (type == FloatWeight::bf16)
    return linear_dot(x, nullptr, M, K, static_cast<const Bf16*>(w), blocks, N, y, nullptr, a);
#endif
  std::unique_ptr<float[]> act;
  if (a.swiglu) {
    act.reset(new float[M * K]);
    swiglu_into(x, 2 * K, x + K, 2 * K, M, K, act.get());
    x = act.get();
  }
  float_blocks(normed_rows(x, M, K, a.norm, a.eps, act), M, K, w, type, blocks, N, y, a.qkv);
  if (a.res)
    at::parallel_for(0, M * N, 16384, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) y[i] += a.res[i];
    });
}

void float_linear_glu_into(const float* x, int64_t M, int64_t K, const void* w, FloatWeight type, int64_t blocks,
                           int64_t N, float* act, const float* norm, float eps) {
  std::unique_ptr<float[]> normed;
  float_blocks(normed_rows(x, M, K, norm, eps, normed), M, K, w, type, blocks, N, nullptr, nullptr, act);
}

void bf16_linear_dot_into(const uint16_t* xb, const float* x, int64_t M, int64_t K, const void* w, int64_t blocks,
                          int64_t N, float* y, uint16_t* glu, const AroundProduct& a) {
#if PMX_BF16_DOT
  linear_dot(x, reinterpret_cast<const uint32_t*>(xb), M, K, static_cast<const Bf16*>(w), blocks, N, y, glu, a);
#else
  TORCH_CHECK(false, "bfloat16 dot products need AVX512-BF16");
#endif
}

}  // namespace pmx_cpu
