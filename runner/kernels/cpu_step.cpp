// The non-GEMM ops of a step on CPU, in C++ where torch's would take several passes over memory:
// - decode_attention: one query token per sequence against its history, read in place from the KV cache;
// - skip_rms_norm: the residual add and RMSNorm in one pass over each row; swiglu: silu(gate) * up, geglu:
//   gelu_tanh(gate) * up, in one pass;
// - rotary_, kv_store_: reference.apply_rotary and kv_store (the int8 quantiser, every cache layout), which the
//   one-call decode step (cpu_decode.cpp) runs too.
//
// Decode attention.
// out[b, h] = softmax_n(q[b, h] . k[rows[b, n], h / G] * scale) v[rows[b, n], h / G] over the keys a sequence sees
// (the scores soft-capped, cap tanh(s / cap), where softcap > 0):
// n in [max(0, kvlens[b] - window), kvlens[b]) (window <= 0: all). rows[b] holds the cache row of each position of
// the sequence's history (rows past kvlens[b] are never read); or, without a row table, the cache's own bookkeeping:
// rows [B] the offset of each sequence (position j at row rows[b] + j), or with page_size > 0 rows [B, MaxP] its
// page starts (position j at row rows[b, j / page_size] + j % page_size), as the plan has them. The cache, of any
// layout, is float32 or int8 with float16 scales per group of 8 (dequantised a row at a time, as the reference).
// Nothing is gathered: a task is one sequence (or one part of a long history, when there are fewer sequences than
// threads, or a share of its KV heads where the history is too short to cut; or the rows of one sequence at
// consecutive positions, as a verify step of speculative decoding has them, each history row read once for all of
// them), which walks its rows in order, all its heads of a row at once (they are adjacent in the cache; each K/V row
// read once for the G = H / KV query heads of its group), with the rows a few ahead prefetched; CHUNK_ROWS positions at a time, their scores into a buffer of H x N floats (rows padded to whole
// vectors), the softmax statistics brought up to date (vectorised exp; the output so far rescaled where the maximum
// grows), then the weighted sum of their value rows (each row's key and value read close together in time: 1.6-2x
// faster than a pass over every key, then every value, on AVX2 at 128-4000 positions). Where a key is shared by
// enough queries (short heads, or several query heads per KV head; AVX-512), scores and the weighted sum go 16
// positions at a time instead: the block's keys transposed in registers, one FMA per dim gives a query its 16 scores.
// Parts of one history are merged by their softmax statistics (max, sum). float32 throughout, as torch_ops.attend.
// An int8 cache's rows are dequantised a group of 8 at a time (AVX2 / AVX-512).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
// The vector of the machine's width (elementwise loops: GCC splits a wider generic vector's selects and conversions
// into scalar code on AVX2, measured 3x slower for swiglu).
#if defined(__AVX512F__)
typedef v16f vnf;
#else
typedef v8f vnf;
#endif
constexpr int64_t VN = sizeof(vnf) / sizeof(float);

template <typename F>
struct IntVec;  // the int32 vector of as many lanes as F
template <>
struct IntVec<v16f> { typedef v16i type; };
template <>
struct IntVec<v8f> { typedef v8i type; };

template <typename F = v16f>
inline F loadv(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename F>
inline void storev(float* p, F v) { std::memcpy(p, &v, sizeof(v)); }

// e^x for each lane, x <= 0 (scores minus their max): 2^n 2^f with f in [-0.5, 0.5], a degree 6 polynomial of f ln 2
// (relative error < 2e-7); below -87 the result is 0, as expf's underflow.
template <typename F>
inline F exp_neg(F x) {
  using I = typename IntVec<F>::type;
  const F lo = F{} - 87.0f;
  x = x < lo ? lo : x;
  const F t = x * 1.44269504088896341f;                      // x log2(e)
  const F n = (t + 12582912.0f) - 12582912.0f;              // round to nearest (1.5 2^23: |t| < 2^22)
  const F r = (t - n) * 0.693147180559945309f;               // in [-0.347, 0.347]
  F p = F{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I e = (__builtin_convertvector(n, I) + 127) << 23;  // 2^n as float bits (n >= -126)
  F s;
  std::memcpy(&s, &e, sizeof(s));
  F y = p * s;
  return x <= lo ? F{} : y;
}

// The sum of the 16 lanes of a and the 8 of b, halving (4 adds deep rather than 15: a dot of a short head is
// mostly this sum).
inline float hsum(v16f a, v8f b) {
  const v8f h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15) + b;
  const auto q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const auto d = __builtin_shufflevector(q, q, 0, 1) + __builtin_shufflevector(q, q, 2, 3);
  return d[0] + d[1];
}

// The largest and the sum of a vector's lanes, halving.
inline float hmax(v8f h) {
  const auto q0 = __builtin_shufflevector(h, h, 0, 1, 2, 3), q1 = __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const auto q = q0 > q1 ? q0 : q1;
  const auto d0 = __builtin_shufflevector(q, q, 0, 1), d1 = __builtin_shufflevector(q, q, 2, 3);
  const auto d = d0 > d1 ? d0 : d1;
  return std::max(d[0], d[1]);
}
inline float hmax(v16f a) {
  const v8f h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7), g = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  return hmax(h > g ? h : g);
}
inline float hadd(v16f a) { return hsum(a, v8f{}); }
inline float hadd(v8f h) {
  const auto q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const auto d = __builtin_shufflevector(q, q, 0, 1) + __builtin_shufflevector(q, q, 2, 3);
  return d[0] + d[1];
}

#if defined(__AVX512F__)
inline float dot(const float* a, const float* b, int64_t D) {
  v16f acc = v16f{};
  v8f half = v8f{};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) acc += loadv(a + i) * loadv(b + i);
  if (i + 8 <= D) {  // a head of 8 (or a tail of 8 or more): half a vector
    v8f x, y;
    std::memcpy(&x, a + i, sizeof(x));
    std::memcpy(&y, b + i, sizeof(y));
    half = x * y;
    i += 8;
  }
  float s = hsum(acc, half);
  for (; i < D; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t D) {  // y += a x
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) storev(y + i, loadv(y + i) + a * loadv(x + i));
  for (; i < D; ++i) y[i] += a * x[i];
}
#else
// (AVX2: vectors of the machine's 8 lanes, two accumulators; a 16-lane generic vector went through the stack here,
// which made a decode step's attention ~1.7x slower.)
inline float dot(const float* a, const float* b, int64_t D) {
  v8f acc0 = v8f{}, acc1 = v8f{};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    acc0 += loadv<v8f>(a + i) * loadv<v8f>(b + i);
    acc1 += loadv<v8f>(a + i + 8) * loadv<v8f>(b + i + 8);
  }
  if (i + 8 <= D) {
    acc0 += loadv<v8f>(a + i) * loadv<v8f>(b + i);
    i += 8;
  }
  float s = hadd(acc0 + acc1);
  for (; i < D; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t D) {  // y += a x
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) storev(y + i, loadv<v8f>(y + i) + a * loadv<v8f>(x + i));
  for (; i < D; ++i) y[i] += a * x[i];
}
#endif

// Rows a and b (b = a's partner BS rows on) of a 16 x 16 block with their off-diagonal BS x BS blocks swapped: done
// for BS = 8, 4, 2, 1 the block is transposed.
template <int BS, int... L>
inline void swap_blocks(v16f& a, v16f& b, std::integer_sequence<int, L...>) {
  const v16f x = __builtin_shufflevector(a, b, ((L & BS) ? 16 + L - BS : L)...);
  b = __builtin_shufflevector(a, b, ((L & BS) ? 16 + L : L + BS)...);
  a = x;
}

template <int BS>
inline void swap_level(v16f (&t)[16]) {
  for (int i = 0; i < 16; ++i)
    if (!(i & BS)) swap_blocks<BS>(t[i], t[i + BS], std::make_integer_sequence<int, 16>{});
}

inline void transpose16(v16f (&t)[16]) {  // t[i][j] <- t[j][i]
  swap_level<8>(t);
  swap_level<4>(t);
  swap_level<2>(t);
  swap_level<1>(t);
}

// s[0..n) -> exp(s - mx) in place (mx at least every s[i]); returns the sum of the exponentials.
inline float exp_sum(float* s, int64_t n, float mx) {
  vnf sum = vnf{};
  int64_t i = 0;
  for (; i + VN <= n; i += VN) {
    const vnf e = exp_neg(loadv<vnf>(s + i) - mx);
    storev(s + i, e);
    sum += e;
  }
  float total = 0;
  for (int j = 0; j < VN; ++j) total += sum[j];
  if (i < n) {  // the tail through a padded buffer of one vector
    float tmp[VN];
    for (int j = 0; j < VN; ++j) tmp[j] = i + j < n ? s[i + j] - mx : -100.0f;
    const vnf e = exp_neg(loadv<vnf>(tmp));
    for (int64_t j = 0; i + j < n; ++j) {
      s[i + j] = e[j];
      total += e[j];
    }
  }
  return total;
}

// Cache rows are far apart (a token's row of one layer, in layouts 0 and 1, is one of 2 L per token), so the hardware
// prefetchers do not see the next one coming: its lines are prefetched PF_ROWS rows ahead.
constexpr int64_t PF_ROWS = 4;

// Positions of a history whose keys, then values, are read together (decode_attention_into; a multiple of 16).
constexpr int64_t CHUNK_ROWS = 32;

// One layer's K or V: [MaxT, KV, D], float32 (rows used in place) or int8 with float16 scales per group of 8
// (QUANT_GROUP, reference.quantize_int8: dequantised row by row into a buffer, q * scale in float32 as the spec).
struct CacheRows : pmx_cpu::KVRows {
  explicit CacheRows(const pmx_cpu::KVRows& r) : pmx_cpu::KVRows(r) {}

  const float* get(int64_t row, int64_t head, float* buf) const {
    if (f != nullptr) return f + row * row_stride + head * head_stride;
    const int8_t* r = q + row * row_stride + head * head_stride;
    const at::Half* sc = s + row * srow_stride + head * shead_stride;
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    for (; i + 16 <= D; i += 16) {  // 16 values, two groups of 8
      const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(r + i))));
      const __m512 g = _mm512_insertf32x8(_mm512_set1_ps(static_cast<float>(sc[i / 8])),
                                          _mm256_set1_ps(static_cast<float>(sc[i / 8 + 1])), 1);
      _mm512_storeu_ps(buf + i, _mm512_mul_ps(x, g));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= D; i += 8) {  // a group of 8: the scalar loop's products, 8 at a time (2.4x faster a row)
      const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(r + i))));
      _mm256_storeu_ps(buf + i, _mm256_mul_ps(x, _mm256_set1_ps(static_cast<float>(sc[i / 8]))));
    }
#endif
    for (; i < D; ++i) buf[i] = static_cast<float>(r[i]) * static_cast<float>(sc[i / 8]);
    return buf;
  }
  void prefetch(int64_t row, int64_t kv0, int64_t kv1) const {  // the row's lines for heads [kv0, kv1)
    const char* base = f != nullptr ? (const char*)(f + row * row_stride) : (const char*)(q + row * row_stride);
    const int64_t elem = f != nullptr ? 4 : 1;
    for (int64_t h = kv0; h < kv1; ++h)
      for (int64_t i = 0; i < D * elem; i += 64) _mm_prefetch(base + h * head_stride * elem + i, _MM_HINT_T0);
  }
};

// Rows per part of a sequence's history: a sequence is cut into parts of at least this many rows (and at most
// `threads` parts per sequence) that run in parallel, each with its own softmax statistics, merged at the end.
constexpr int64_t MIN_PART_ROWS = 32;

// Rows of one sequence at consecutive positions attended together, at most (their scores: rows x H x N floats).
constexpr int64_t MAX_GROUP_ROWS = 16;

// Scores are computed 16 positions at a time (each block of keys transposed, ~D / 4 shuffles a position, against a
// horizontal sum of ~8 operations per query and position) where head_dim <= this x the query heads per KV head.
constexpr int64_t BLOCKED_DIMS_PER_QUERY_HEAD = 32;

// The first position a query at position len - 1 sees: all of them, or the last `window`.
inline int64_t first_seen(int64_t len, int64_t window) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

// The cache row of position j of sequence b.
inline int64_t row_at(const pmx_cpu::HistoryRows& h, int64_t b, int64_t j) {
  if (h.offsets) return h.rows[b] + j;
  if (h.table) return h.rows[b * h.row_stride + j];
  return h.rows[b * h.row_stride + j / h.page_size] + j % h.page_size;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache, const c10::optional<at::Tensor>& kv_scale,
                            int64_t layout, int64_t layer, const at::Tensor& rows, const at::Tensor& kvlens,
                            int64_t window, double scale, int64_t page_size, const c10::optional<at::Tensor>& alibi,
                            double softcap) {
  const auto [c, s] = pmx_cpu::cache_views(cache, kv_scale, layout, "decode_attention");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.size(2) == c.last,
              "q must be contiguous float32 [B, H, ", c.last, "]");
  const int64_t B = q.size(0), H = q.size(1);
  TORCH_CHECK(c.KV > 0 && H % c.KV == 0 && layer >= 0 && layer < c.L, "query heads (", H, ") must be a multiple of ",
              "the KV heads (", c.KV, ") and layer ", layer, " one of the cache's ", c.L);
  TORCH_CHECK(kvlens.dim() == 1 && kvlens.size(0) == B && kvlens.scalar_type() == at::kLong, "kvlens must be int64 [B]");
  const at::Tensor kl = kvlens.contiguous();
  const pmx_cpu::HistoryRows h = pmx_cpu::history_rows(rows, page_size, kl.data_ptr<int64_t>(), B, window, c.T);
  const pmx_cpu::CacheView* sp = cache.scalar_type() == at::kChar ? &s : nullptr;
  const bool has_alibi = alibi.has_value() && alibi->defined();
  if (has_alibi)
    TORCH_CHECK(alibi->scalar_type() == at::kFloat && alibi->is_contiguous() && alibi->dim() == 1 &&
                    alibi->numel() == H, "alibi must be the contiguous float32 slopes [", H, "]");
  at::Tensor out = at::empty({B, H, c.last}, q.options());
  pmx_cpu::decode_attention_into(q.data_ptr<float>(), H * c.last, B, H, pmx_cpu::kv_rows(c, sp, layer, 0),
                                 pmx_cpu::kv_rows(c, sp, layer, 1), h, kl.data_ptr<int64_t>(), window, (float)scale,
                                 out.data_ptr<float>(), has_alibi ? alibi->data_ptr<float>() : nullptr,
                                 static_cast<float>(softcap));
  return out;
}

// 1 / (1 + e^-g) from e^-|g| (exp_neg's domain): 1 / (1 + e) for g >= 0, e / (1 + e) below.
template <typename F>
inline F sigmoid(F g) {
  const F a = g < 0 ? -g : g;
  const F e = exp_neg(-a);               // e^-|g| in (0, 1]
  const F one = F{} + 1.0f;
  return g >= 0 ? one / (one + e) : e / (one + e);
}

std::tuple<at::Tensor, at::Tensor> skip_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& skip,
                                                 const at::Tensor& weight, double eps) {
  const int64_t D = weight.numel(), M = D ? x.numel() / D : 0;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(-1) == D && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat, "skip_rms_norm: contiguous float32 x [.., D] and weight [D]");
  const bool has_skip = skip.has_value() && skip->defined();
  if (has_skip)
    TORCH_CHECK(skip->sizes() == x.sizes() && skip->scalar_type() == at::kFloat && skip->is_contiguous(),
                "skip_rms_norm: the residual must be contiguous float32 of x's shape");
  at::Tensor r = has_skip ? at::empty_like(x) : at::empty({0}, x.options()), y = at::empty_like(x);  // r: x + skip
  pmx_cpu::skip_rms_norm_into(x.data_ptr<float>(), has_skip ? skip->data_ptr<float>() : nullptr,
                              weight.data_ptr<float>(), M, D, (float)eps, has_skip ? r.data_ptr<float>() : nullptr,
                              y.data_ptr<float>());
  return {y, r};
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.sizes() == up.sizes() &&
                  gate.dim() >= 1 && gate.stride(-1) == 1 && up.stride(-1) == 1,
              "swiglu: float32 gate and up of one shape, last dim contiguous");
  const int64_t D = gate.size(-1), M = D ? gate.numel() / D : 0;
  const at::Tensor g2 = gate.reshape({M, D}), u2 = up.reshape({M, D});  // views where the rows are strided alike
  at::Tensor out = at::empty({M, D}, gate.options());
  pmx_cpu::swiglu_into(g2.data_ptr<float>(), g2.stride(0), u2.data_ptr<float>(), u2.stride(0), M, D,
                       out.data_ptr<float>());
  return out.view(gate.sizes());
}

at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.sizes() == up.sizes() &&
                  gate.dim() >= 1 && gate.stride(-1) == 1 && up.stride(-1) == 1,
              "geglu: float32 gate and up of one shape, last dim contiguous");
  const int64_t D = gate.size(-1), M = D ? gate.numel() / D : 0;
  const at::Tensor g2 = gate.reshape({M, D}), u2 = up.reshape({M, D});
  at::Tensor out = at::empty({M, D}, gate.options());
  pmx_cpu::geglu_into(g2.data_ptr<float>(), g2.stride(0), u2.data_ptr<float>(), u2.stride(0), M, D,
                      out.data_ptr<float>());
  return out.view(gate.sizes());
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_: x must be float32 [T, heads, D] with D even and contiguous");
  const int64_t T = x.size(0), D = x.size(2);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == D / 2, "rotary_: cos and sin must be contiguous float32 [", T, ", ", D / 2, "]");
  pmx_cpu::rotary(x.data_ptr<float>(), T, x.stride(0), x.stride(1), x.size(1), D, cos.data_ptr<float>(),
                  sin.data_ptr<float>());
}

void kv_store_(at::Tensor cache, const c10::optional<at::Tensor>& scale, int64_t layout, int64_t layer,
               const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  const auto [c, s] = pmx_cpu::cache_views(cache, scale, layout, "kv_store_");
  const int64_t T = k.size(0), ts = T > 1 ? k.stride(0) : 0, hs = k.size(1) > 1 ? k.stride(1) : 0;  // (size 1: any)
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3 && k.sizes() == v.sizes()
                  && (ts == 0 || v.stride(0) == ts) && (hs == 0 || v.stride(1) == hs) && k.stride(2) == 1 &&
                  v.stride(2) == 1 && k.size(1) == c.KV && k.size(2) == c.last && layer >= 0 && layer < c.L,
              "kv_store_: k and v must be float32 [T, ", c.KV, ", ", c.last, "] of one stride, head_dim contiguous, ",
              "and layer ", layer, " one of the cache's ", c.L);
  const int64_t* rows = pmx_cpu::checked_slots(slots, T, c, "kv_store_");
  pmx_cpu::kv_store(k.data_ptr<float>(), v.data_ptr<float>(), T, ts, hs, c,
                    cache.scalar_type() == at::kChar ? &s : nullptr, layer, rows);
}

}  // namespace

namespace pmx_cpu {

const int64_t* checked_slots(const at::Tensor& slots, int64_t T, const CacheView& c, const char* what) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == T && slots.is_contiguous(),
              what, ": slots must be contiguous int64 [", T, "]");
  const int64_t* rows = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(rows[t] >= 0 && rows[t] < c.T, what, ": cache row ", rows[t], " is outside the cache's ", c.T, " rows");
  return rows;
}

CacheView::CacheView(const at::Tensor& t, int64_t layout) {
  static const int64_t perms[4][5] = {{1, 2, 0, 3, 4}, {0, 2, 1, 3, 4}, {0, 1, 2, 3, 4}, {0, 1, 3, 2, 4}};
  TORCH_CHECK(layout >= 0 && layout <= 3, "cache layout must be 0..3, got ", layout);
  TORCH_CHECK(t.dim() == 5 && t.stride(4) == 1, "the cache must be 5-d with its last dim contiguous");
  const int64_t* p = perms[layout];
  base = static_cast<char*>(t.data_ptr()), elem = t.element_size();
  sL = t.stride(p[0]), s2 = t.stride(p[1]), sT = t.stride(p[2]), sH = t.stride(p[3]);
  L = t.size(p[0]), T = t.size(p[2]), KV = t.size(p[3]), last = t.size(4);
  TORCH_CHECK(t.size(p[1]) == 2, "the cache must hold k and v (a dim of 2), got shape ", t.sizes());
}

std::pair<CacheView, CacheView> cache_views(const at::Tensor& cache, const c10::optional<at::Tensor>& scale,
                                            int64_t layout, const char* what) {
  const bool quant = scale.has_value() && scale->defined();
  TORCH_CHECK(cache.scalar_type() == (quant ? at::kChar : at::kFloat), what, ": the cache must be float32, or int8 ",
              "with its scales");
  const CacheView c(cache, layout), s = quant ? CacheView(*scale, layout) : c;
  TORCH_CHECK(!quant || (scale->scalar_type() == at::kHalf && s.L == c.L && s.T == c.T && s.KV == c.KV &&
                         s.last * QUANT_GROUP == c.last),
              what, ": int8 cache scales must be float16 of the cache's shape with head_dim / 8 last");
  return {c, s};
}

void quantize_int8(const float* x, int64_t n, int8_t* q, at::Half* s) {
  for (int64_t g = 0; g < n; g += QUANT_GROUP, ++s) {
    float amax = 0;
    for (int64_t i = g; i < g + QUANT_GROUP; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = std::max(amax / 127.0f, 1e-5f);
    for (int64_t i = g; i < g + QUANT_GROUP; ++i)
      q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] / scale))));
    *s = at::Half(scale);
  }
}

void kv_store(const float* k, const float* v, int64_t T, int64_t t_stride, int64_t h_stride, const CacheView& c,
              const CacheView* s, int64_t layer, const int64_t* slots) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(c.KV * c.last, 1));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {  // (a step's slots are distinct)
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < c.KV; ++h)
        for (int64_t kv = 0; kv < 2; ++kv) {
          const float* x = (kv == 0 ? k : v) + t * t_stride + h * h_stride;
          if (s != nullptr)
            quantize_int8(x, c.last, c.row<int8_t>(layer, kv, slots[t], h), s->row<at::Half>(layer, kv, slots[t], h));
          else
            std::memcpy(c.row<float>(layer, kv, slots[t], h), x, c.last * sizeof(float));
        }
  });
}

void rotary(float* x, int64_t T, int64_t t_stride, int64_t h_stride, int64_t heads, int64_t D, const float* cos,
            const float* sin) {
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(heads * D, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        rotate_pairs(x + t * t_stride + h * h_stride, cos + t * (D / 2), sin + t * (D / 2), D / 2);
      }
  });
}

KVRows kv_rows(const CacheView& c, const CacheView* s, int64_t layer, int64_t which) {
  KVRows r;
  r.row_stride = c.sT, r.head_stride = c.sH, r.KV = c.KV, r.D = c.last;
  if (s == nullptr) {
    r.f = c.row<float>(layer, which, 0, 0);
  } else {
    r.q = c.row<int8_t>(layer, which, 0, 0), r.s = s->row<at::Half>(layer, which, 0, 0);
    r.srow_stride = s->sT, r.shead_stride = s->sH;
  }
  return r;
}

HistoryRows history_rows(const at::Tensor& rows, int64_t page_size, const int64_t* lens, int64_t B, int64_t window,
                         int64_t maxt) {
  HistoryRows h;
  h.table = rows.dim() == 2 && page_size == 0, h.offsets = rows.dim() == 1 && page_size == 0;
  TORCH_CHECK((h.table || h.offsets || (rows.dim() == 2 && page_size > 0)) && rows.size(0) == B &&
                  rows.scalar_type() == at::kLong && rows.stride(-1) == 1,
              "rows must be int64 with a contiguous last dim: a row table [B, N] (page_size 0), offsets [B] (page_size "
              "0) or page starts [B, MaxP] (page_size > 0); got ", rows.sizes(), " with page_size ", page_size);
  h.rows = rows.data_ptr<int64_t>(), h.page_size = page_size;
  h.row_stride = h.offsets ? 0 : rows.stride(0), h.width = h.offsets ? 0 : rows.size(1);
  const int64_t N = h.offsets ? std::numeric_limits<int64_t>::max() : h.width * (h.table ? 1 : h.page_size);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= N, "kvlens[", b, "] = ", lens[b], " must be in [1, ", N, "]");
    for (int64_t j = first_seen(lens[b], window); j < lens[b]; ++j)
      TORCH_CHECK(row_at(h, b, j) >= 0 && row_at(h, b, j) < maxt, "cache row ", row_at(h, b, j), " of sequence ", b,
                  " is outside the cache's ", maxt, " rows");
  }
  return h;
}

// Whether rows a and b read one history (the same offset, or the same page starts).
inline bool same_history(const pmx_cpu::HistoryRows& h, int64_t a, int64_t b) {
  if (h.offsets) return h.rows[a] == h.rows[b];
  if (h.table) return false;
  return std::equal(h.rows + a * h.row_stride, h.rows + a * h.row_stride + h.width, h.rows + b * h.row_stride);
}

void decode_attention_into(const float* qp, int64_t q_stride, int64_t B, int64_t H, const KVRows& k, const KVRows& v,
                           const HistoryRows& h, const int64_t* lens, int64_t window, float sc, float* op,
                           const float* slopes, float softcap) {
  const int64_t D = k.D, KV = k.KV, G = H / KV;
  // groups: runs of rows of one sequence at consecutive positions (the rows of a verify step), each history row
  // read once for all of them; a lone row is a group of one
  std::vector<int64_t> first{0};
  for (int64_t b = 1; b < B; ++b)
    if (!(lens[b] == lens[b - 1] + 1 && b - first.back() < MAX_GROUP_ROWS && same_history(h, b - 1, b)))
      first.push_back(b);
  const int64_t NG = first.size();
  first.push_back(B);
  // parts: each group's seen rows [lo of its first row, len of its last) cut into `parts` pieces
  const int64_t threads = at::get_num_threads();
  int64_t parts = 1;
  for (int64_t g = 0; g < NG; ++g)
    parts = std::max(parts, std::min(threads, (lens[first[g + 1] - 1] - first_seen(lens[first[g]], window)) /
                                                  MIN_PART_ROWS));
  if (NG >= threads) parts = 1;
  // fewer groups than threads and histories too short to cut: each group's KV heads shared out between the threads
  // instead (a head's arithmetic is the same whichever task runs it: the same bits as one task)
  const int64_t splits = parts == 1 && NG < threads ? std::min(KV, threads / NG) : 1;
  std::vector<float> part_out(parts > 1 ? B * parts * H * D : 0), part_max(B * parts * H), part_sum(B * parts * H);
  const CacheRows K(k), V(v);
  at::parallel_for(0, NG * parts * splits, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s, buf(D), kt, kbuf;
    std::vector<int64_t> rowbuf, from, to;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t t = task / splits, sp = task % splits;
      const int64_t g = t / parts, p = t % parts, b0 = first[g], R = first[g + 1] - b0;
      const int64_t kv0 = KV * sp / splits, kv1 = KV * (sp + 1) / splits, h0 = kv0 * G, h1 = kv1 * G;  // its heads
      // scores 16 positions at a time where the query heads sharing a key repay transposing it (short heads, or
      // enough query heads per KV head); else a dot product per query and position. (By the model's shape alone: a
      // verify step's rows get the bits each would get alone, so speculation keeps greedy outputs to the bit.)
#if defined(__AVX512F__)
      const bool blocked = D % 16 == 0 && D <= BLOCKED_DIMS_PER_QUERY_HEAD * G;
#else
      const bool blocked = false;  // (16 vectors of 16 floats to transpose: 32 registers of 8 lanes, more than AVX2 has)
#endif
      if (blocked) kt.resize(D * 16), kbuf.resize(16 * D);
      const int64_t lo = first_seen(lens[b0], window), seen = lens[b0 + R - 1] - lo;
      const int64_t j0 = lo + seen * p / parts, j1 = lo + seen * (p + 1) / parts, n = j1 - j0;
      from.resize(R), to.resize(R);  // row r sees this part's [from[r], to[r])
      for (int64_t r = 0; r < R; ++r) {
        from[r] = std::clamp<int64_t>(first_seen(lens[b0 + r], window) - j0, 0, n);
        to[r] = std::clamp<int64_t>(lens[b0 + r] - j0, from[r], n);
      }
      const auto out_of = [&](int64_t r) {
        return parts > 1 ? part_out.data() + ((b0 + r) * parts + p) * H * D : op + (b0 + r) * H * D;
      };
      for (int64_t r = 0; r < R; ++r) std::fill(out_of(r) + h0 * D, out_of(r) + h1 * D, 0.0f);
      const int64_t* rr;  // this part's rows: the table's, or worked out from the offset / pages
      if (h.table) {
        rr = h.rows + b0 * h.row_stride + j0;
      } else {
        rowbuf.resize(n);
        for (int64_t j = 0; j < n; ++j) rowbuf[j] = row_at(h, b0, j0 + j);
        rr = rowbuf.data();
      }
      const int64_t np = (n + 31) / 16 * 16;  // (score rows padded: a block of 16 stores whole vectors from any jb < n)
      s.resize(R * H * np);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t hh = h0; hh < h1; ++hh)
          part_max[((b0 + r) * parts + p) * H + hh] = -std::numeric_limits<float>::infinity(),
          part_sum[((b0 + r) * parts + p) * H + hh] = 0.0f;
      // CHUNK_ROWS positions at a time: their keys' scores, the softmax statistics brought up to date (the output so
      // far rescaled where the maximum grows), then their values: a position's key and value rows are read close
      // together in time, and the values from the cache the keys' prefetches filled.
      // (chunks at whole multiples of CHUNK_ROWS positions: a row gets the same bits alone as in a group)
      for (int64_t cb = 0, ce; cb < n; cb = ce) {
      ce = std::min(n, (j0 + cb) / CHUNK_ROWS * CHUNK_ROWS + CHUNK_ROWS - j0);
      if (blocked) {  // 16 positions at a time: the block's keys transposed, each query's 16 scores one FMA per dim
        for (int64_t jb = cb; jb < ce; jb += 16) {
          const int64_t w = std::min<int64_t>(16, ce - jb);
          for (int64_t i = 0; i < 16 && jb + 16 + i < n; ++i) K.prefetch(rr[jb + 16 + i], kv0, kv1);
          for (int64_t kh = kv0; kh < kv1; ++kh) {
            const float* rows[16];
            for (int64_t i = 0; i < w; ++i) rows[i] = K.get(rr[jb + i], kh, kbuf.data() + i * D);
            for (int64_t c = 0; c < D; c += 16) {  // kt[d][i] = key i's dim d
              v16f t[16];
              for (int64_t i = 0; i < 16; ++i) t[i] = i < w ? loadv(rows[i] + c) : v16f{};
              transpose16(t);
              for (int64_t d = 0; d < 16; ++d) storev(kt.data() + (c + d) * 16, t[d]);
            }
            for (int64_t r = 0; r < R; ++r) {
              if (jb + w <= from[r] || jb >= to[r]) continue;
              const float* qb = qp + (b0 + r) * q_stride;
              float* sr = s.data() + r * H * np;
              for (int64_t hh = kh * G; hh < (kh + 1) * G; ++hh) {  // 8 chains of FMAs over the dims
                v16f a8[8] = {};
                for (int64_t d = 0; d < D; d += 8)
                  for (int u = 0; u < 8; ++u) a8[u] += qb[hh * D + d + u] * loadv(kt.data() + (d + u) * 16);
                const v16f acc = ((a8[0] + a8[1]) + (a8[2] + a8[3])) + ((a8[4] + a8[5]) + (a8[6] + a8[7]));
                storev(sr + hh * np + jb, acc * sc);
              }
            }
          }
        }
      } else {
        for (int64_t j = cb; j < ce; ++j) {  // row by row: all heads of a row are next to each other in the cache
          if (j + PF_ROWS < n) K.prefetch(rr[j + PF_ROWS], kv0, kv1);
          for (int64_t kh = kv0; kh < kv1; ++kh) {
            const float* kr = K.get(rr[j], kh, buf.data());
            for (int64_t r = 0; r < R; ++r) {
              if (j < from[r] || j >= to[r]) continue;
              const float* qb = qp + (b0 + r) * q_stride;
              float* sr = s.data() + r * H * np;
              for (int64_t hh = kh * G; hh < (kh + 1) * G; ++hh) sr[hh * np + j] = dot(qb + hh * D, kr, D) * sc;
            }
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t a = std::max(from[r], cb), e = std::min(to[r], ce), len = lens[b0 + r];
        if (a >= e) continue;
        float* sr = s.data() + r * H * np;
        if (softcap > 0)  // cap tanh(s / cap), as reference.soft_cap
          for (int64_t hh = h0; hh < h1; ++hh) soft_cap_into(sr + hh * np + a, e - a, softcap);
        if (slopes)  // ALiBi: slope_h x (j - the query's position len - 1), as reference.alibi_bias
          for (int64_t hh = h0; hh < h1; ++hh)
            for (int64_t j = a; j < e; ++j)
              sr[hh * np + j] += slopes[hh] * static_cast<float>(j0 + j - (len - 1));
        float *pm = &part_max[((b0 + r) * parts + p) * H], *ps = &part_sum[((b0 + r) * parts + p) * H];
        float* o = out_of(r);
        for (int64_t hh = h0; hh < h1; ++hh) {
          float* seg = sr + hh * np + a;
          float mx = pm[hh];
          for (int64_t j = 0; j < e - a; ++j) mx = std::max(mx, seg[j]);
          if (mx > pm[hh] && ps[hh] > 0) {  // the output and sum so far, from exp(s - old max) to exp(s - new max)
            const float c = std::exp(pm[hh] - mx);
            ps[hh] *= c;
            for (int64_t i = 0; i < D; ++i) o[hh * D + i] *= c;
          }
          pm[hh] = mx;
          ps[hh] += exp_sum(seg, e - a, mx);
        }
      }
      if (blocked) {  // o += p_i v_i over 16 positions at a time, o loaded once
        for (int64_t jb = cb; jb < ce; jb += 16) {
          const int64_t w = std::min<int64_t>(16, ce - jb);
          for (int64_t i = 0; i < 16 && jb + 16 + i < n; ++i) V.prefetch(rr[jb + 16 + i], kv0, kv1);
          for (int64_t kh = kv0; kh < kv1; ++kh) {
            const float* rows[16];
            for (int64_t i = 0; i < w; ++i) rows[i] = V.get(rr[jb + i], kh, kbuf.data() + i * D);
            for (int64_t r = 0; r < R; ++r) {
              const int64_t i0 = std::max<int64_t>(from[r] - jb, 0), i1 = std::min<int64_t>(to[r] - jb, w);
              if (i0 >= i1) continue;
              const float* sr = s.data() + r * H * np;
              float* o = out_of(r);
              for (int64_t hh = kh * G; hh < (kh + 1) * G; ++hh)
                for (int64_t c = 0; c < D; c += 16) {
                  v16f acc = loadv(o + hh * D + c);
                  for (int64_t i = i0; i < i1; ++i) acc += sr[hh * np + jb + i] * loadv(rows[i] + c);
                  storev(o + hh * D + c, acc);
                }
            }
          }
        }
      } else {
        for (int64_t j = cb; j < ce; ++j) {
          if (j + PF_ROWS < n) V.prefetch(rr[j + PF_ROWS], kv0, kv1);
          for (int64_t kh = kv0; kh < kv1; ++kh) {
            const float* vr = V.get(rr[j], kh, buf.data());
            for (int64_t r = 0; r < R; ++r) {
              if (j < from[r] || j >= to[r]) continue;
              const float* sr = s.data() + r * H * np;
              float* o = out_of(r);
              for (int64_t hh = kh * G; hh < (kh + 1) * G; ++hh) axpy(o + hh * D, sr[hh * np + j], vr, D);
            }
          }
        }
      }
      }
      if (parts == 1)
        for (int64_t r = 0; r < R; ++r) {
          float* o = out_of(r);
          const float* ps = &part_sum[(b0 + r) * H];
          for (int64_t hh = h0; hh < h1; ++hh) {
            const float inv = 1.0f / ps[hh];
            for (int64_t i = 0; i < D; ++i) o[hh * D + i] *= inv;
          }
        }
    }
  });
  if (parts > 1)  // merge the parts of each row and head: rescale each to the common max
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hh = 0; hh < H; ++hh) {
        float mx = -std::numeric_limits<float>::infinity(), total = 0;
        for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, part_max[(b * parts + p) * H + hh]);
        float* o = op + (b * H + hh) * D;
        std::fill(o, o + D, 0.0f);
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t t = b * parts + p;
          if (part_sum[t * H + hh] == 0) continue;
          const float w = std::exp(part_max[t * H + hh] - mx);
          total += w * part_sum[t * H + hh];
          axpy(o, w, part_out.data() + (t * H + hh) * D, D);
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < D; ++i) o[i] *= inv;
      }
}

void skip_rms_norm_into(const float* xp, const float* sp, const float* wp, int64_t M, int64_t D, float eps, float* rp,
                        float* yp) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* a = xp + m * D;
      float* o = sp ? rp + m * D : nullptr;
      v16f ss = v16f{};
      float tail = 0;
      int64_t i = 0;
      for (; i + 16 <= D; i += 16) {
        v16f v = loadv(a + i);
        if (sp) {
          v += loadv(sp + m * D + i);
          storev(o + i, v);
        }
        ss += v * v;
      }
      for (; i < D; ++i) {
        const float v = sp ? a[i] + sp[m * D + i] : a[i];
        if (sp) o[i] = v;
        tail += v * v;
      }
      for (int j = 0; j < 16; ++j) tail += ss[j];
      const float inv = 1.0f / std::sqrt(tail / D + eps);
      const float* src = sp ? o : a;
      float* out = yp + m * D;
      for (i = 0; i + 16 <= D; i += 16) storev(out + i, loadv(wp + i) * (loadv(src + i) * inv));
      for (; i < D; ++i) out[i] = wp[i] * (src[i] * inv);
    }
  });
}

void soft_cap_into(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  int64_t i = 0;
  for (; i + VN <= n; i += VN) {  // tanh(u) = 2 sigmoid(2u) - 1
    const vnf u = loadv<vnf>(x + i) * (2.0f * inv);
    storev(x + i, cap * (2.0f * sigmoid(u) - 1.0f));
  }
  for (; i < n; ++i) x[i] = cap * std::tanh(x[i] * inv);
}

// out [M, D] = act(gate) * up, act(g) = g * sigmoid(k(g)) a vector at a time: silu, k(g) = g; gelu_tanh,
// k(g) = 2 sqrt(2 / pi) (g + 0.044715 g^3) (0.5 (1 + tanh(u)) = sigmoid(2u)).
template <bool GELU>
void gated_into(const float* gp, int64_t gs, const float* upp, int64_t us, int64_t M, int64_t D, float* op) {
  const auto act = [](vnf g) {
    if constexpr (GELU) return g * sigmoid(1.5957691216057308f * (g + 0.044715f * g * g * g));
    else return g * sigmoid(g);
  };
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* g = gp + m * gs;
      const float* u = upp + m * us;
      float* o = op + m * D;
      int64_t i = 0;
      for (; i + VN <= D; i += VN) storev(o + i, act(loadv<vnf>(g + i)) * loadv<vnf>(u + i));
      if (i < D) {
        float gt[VN] = {}, ut[VN] = {};
        std::memcpy(gt, g + i, (D - i) * sizeof(float));
        std::memcpy(ut, u + i, (D - i) * sizeof(float));
        const vnf r = act(loadv<vnf>(gt)) * loadv<vnf>(ut);
        for (int64_t j = 0; i + j < D; ++j) o[i + j] = r[j];
      }
    }
  });
}

void swiglu_into(const float* gp, int64_t gs, const float* upp, int64_t us, int64_t M, int64_t D, float* op) {
  gated_into<false>(gp, gs, upp, us, M, D, op);
}

void geglu_into(const float* gp, int64_t gs, const float* upp, int64_t us, int64_t M, int64_t D, float* op) {
  gated_into<true>(gp, gs, upp, us, M, D, op);
}

}  // namespace pmx_cpu

// Prefill attention (float32, flash-style): out [B, S, H, D] = softmax(scale q k^T, soft-capped where softcap > 0;
// causal: query i sees keys j <= i + N - S) v, for q [B, S, H, D] and k, v [B, N, KV, D] (H a multiple of KV; the
// leading dims strided, D contiguous), without the score matrix: each unit (a sequence, a head, QU query rows) walks
// key blocks of PA_KB in tiles of PA_R rows, its scores in registers (the keys of a block transposed once for every
// head and unit that reads them), the softmax statistics brought up to date online, then P v into the output rows.
// Units are handed out longest first (a causal unit's work grows with its rows' position).
namespace {

constexpr int64_t PA_KB = 4 * VN;        // keys a block: 4 vectors of scores a row
constexpr int PA_R = VN == 16 ? 6 : 3;   // query rows a tile: 6 x 4 accumulators (AVX-512), 3 x 4 (AVX2)
constexpr int64_t PA_QU = 4 * PA_R;      // query rows a unit

struct PrefillArgs {
  const float *q, *k, *v;
  int64_t qs[3], ks[3], vs[3];  // strides of B, S|N, heads
  int64_t B, S, N, H, KV, D;
  float scale, softcap;
  bool causal;
  const float* kt;  // keys transposed: [B][KV][N / PA_KB blocks][D][PA_KB]
  float* out;       // [B, S, H, D] contiguous
  uint16_t* out16;  // or there in bfloat16 (out null: the next linear's bfloat16 dot products take it as it is)
  // bfloat16 products (PA_BF16): keys [B][KV][blocks][D / 2][PA_KB] and values [B][KV][blocks][PA_KB / 2][D] as
  // 32-bit words of bfloat16 pairs (dims 2i, 2i + 1 of a key; keys 2i, 2i + 1 of a value dim)
  const uint32_t *kp2 = nullptr, *vp2 = nullptr;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(PMX_NO_BF16_DOT)
#define PA_BF16 1
#endif

#if defined(__AVX512F__)
// The 16 x 16 32-bit words w transposed in place (word j of w[i] to word i of w[j]): pairs of rows interleaved by
// words, then by 64 bits, then 128-bit lanes gathered twice.
inline void transpose16(__m512i (&w)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // lane L of t[i]: words 4L, 4L + 1 of rows i, i + 1 interleaved; t[i + 1]: 4L + 2, 4L + 3
    t[i] = _mm512_unpacklo_epi32(w[i], w[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(w[i], w[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane L of w[i + c]: word 4L + c of rows i .. i + 3
    w[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    w[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    w[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    w[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // word 4L + c of all rows: lane L of w[c], w[4 + c], w[8 + c], w[12 + c]
    const __m512i p0 = _mm512_shuffle_i32x4(w[c], w[4 + c], 0x88), p1 = _mm512_shuffle_i32x4(w[c], w[4 + c], 0xDD);
    const __m512i q0 = _mm512_shuffle_i32x4(w[8 + c], w[12 + c], 0x88),
                  q1 = _mm512_shuffle_i32x4(w[8 + c], w[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(p0, q0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(p1, q1, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(p0, q0, 0xDD);
    t[12 + c] = _mm512_shuffle_i32x4(p1, q1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) w[i] = t[i];
}
#endif

// Lane r (r < 8) of the result: the largest lane of v[r] (AVX-512: 14 two-vector shuffles and 8 maxima for 8 rows,
// where one row's hmax takes 4 shuffles, 4 maxima and a move to a scalar).
inline v16f row_maxima8(const v16f (&v)[8]) {
  const auto mx = [](v16f a, v16f b) { return a > b ? a : b; };
  v16f t[4], u[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-7: row 2i's 8 partial maxima, 8-15 row 2i + 1's
    t[i] = mx(__builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
              __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                      31));
  for (int i = 0; i < 2; ++i)  // 4 lanes a row, rows 4i .. 4i + 3
    u[i] = mx(__builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
              __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                      31));
  const v16f w = mx(  // 2 lanes a row
      __builtin_shufflevector(u[0], u[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29),
      __builtin_shufflevector(u[0], u[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31));
  return mx(__builtin_shufflevector(w, w, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14),
            __builtin_shufflevector(w, w, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15));
}

// Rows [i0, i0 + R) of head h of sequence b; BF: q k and p v as bfloat16 products (vdpbf16ps: q, k, the
// probabilities and v rounded to bfloat16, the sums float32; D a multiple of 16).
template <int R, bool BF = false>
void prefill_tile(const PrefillArgs& a, int64_t b, int64_t h, int64_t i0) {
  const int64_t D = a.D, g = h / (a.H / a.KV), nkb = (a.N + PA_KB - 1) / PA_KB, off = a.N - a.S;
  alignas(64) float qsc[R][256], o[R][256], s[R][PA_KB];  // (D <= 256: checked by the op)
  alignas(64) uint32_t qp[BF ? R : 1][128], pp[BF ? R : 1][PA_KB / 2];  // (BF: q's and p's bfloat16 pairs)
  // BF: scores in log2 units (q scaled by log2(e) too), their probabilities 2^(s - m) (pmx_cpu::exp2_bf16)
  constexpr float unit = BF ? 1.44269504088896341f : 1.0f;
  alignas(64) float m[VN];  // each row's running maximum (lanes R.. unused)
  std::fill(m, m + VN, -INFINITY);
  vnf lsum[R];  // each row's sum of probabilities, lane by lane (summed across at the end)
  for (int r = 0; r < R; ++r) {
    const float* qr = a.q + b * a.qs[0] + (i0 + r) * a.qs[1] + h * a.qs[2];
    for (int64_t d = 0; d < D; ++d) {
      qsc[r][d] = qr[d] * (a.scale * unit);
      o[r][d] = 0;
    }
    std::fill(qsc[r] + D, qsc[r] + std::min<int64_t>(256, D + 16), 0.0f);  // (BF: pairs of 32 at a time)
    lsum[r] = vnf{};
#if PA_BF16
    if constexpr (BF)
      for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(qp[r] + d / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qsc[r] + d + 16),
                                                                     _mm512_loadu_ps(qsc[r] + d)));
#endif
  }
  const int64_t last = a.causal ? std::min(a.N - 1, i0 + R - 1 + off) : a.N - 1;  // the last key any row sees
  for (int64_t kb = 0; kb <= last / PA_KB; ++kb) {
    const float* kt = a.kt + ((b * a.KV + g) * nkb + kb) * D * PA_KB;
    const int64_t j0 = kb * PA_KB, nk = std::min(PA_KB, a.N - j0);
    const int64_t used = std::min(nk, last - j0 + 1);  // keys of the block any row sees (the diagonal's: fewer)
    vnf acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = vnf{};
    const auto scores = [&](auto nv) {  // the first nv vectors of keys' scores
#if PA_BF16
      if constexpr (BF) {
        const uint32_t* kd = a.kp2 + ((b * a.KV + g) * nkb + kb) * (D / 2) * PA_KB;
        for (int64_t d = 0; d < D / 2; ++d, kd += PA_KB) {
          __m512i kv[nv];
          for (int j = 0; j < nv; ++j) kv[j] = _mm512_loadu_si512(kd + j * VN);
          for (int r = 0; r < R; ++r) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r][d]));
            for (int j = 0; j < nv; ++j) acc[r][j] = (vnf)_mm512_dpbf16_ps((__m512)acc[r][j], (__m512bh)kv[j], x);
          }
        }
        return;
      }
#endif
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kt + d * PA_KB;
        vnf kv[nv];
        for (int j = 0; j < nv; ++j) kv[j] = loadv<vnf>(kd + j * VN);
        for (int r = 0; r < R; ++r) {
          const float x = qsc[r][d];
          for (int j = 0; j < nv; ++j) acc[r][j] += x * kv[j];
        }
      }
    };
    switch ((used + VN - 1) / VN) {
      case 1: scores(std::integral_constant<int, 1>{}); break;
      case 2: scores(std::integral_constant<int, 2>{}); break;
      case 3: scores(std::integral_constant<int, 3>{}); break;
      default: scores(std::integral_constant<int, 4>{});
    }
    vnf lane;  // 0 .. VN-1
    for (int j = 0; j < VN; ++j) lane[j] = static_cast<float>(j);
    // the rows' maxima first (a row that sees none of the block's keys: all -inf), then every row's factor for what
    // it summed so far in one vector exp (R <= VN), applied to its sum here and to its output as P v loads it: no
    // scalar exp, no pass over the output of its own
    vnf mv[VN == 16 ? 8 : R];  // each row's largest score lane by lane (AVX-512: 8, the rows past R -inf)
    for (int r = 0; r < R; ++r) {
      if (a.softcap > 0) {  // (on the scores in natural units)
        for (int j = 0; j < 4; ++j) storev(s[r] + j * VN, acc[r][j] * (1.0f / unit));
        pmx_cpu::soft_cap_into(s[r], nk, a.softcap);
        for (int j = 0; j < 4; ++j) acc[r][j] = loadv<vnf>(s[r] + j * VN) * unit;
      }
      // keys j0 .. j0 + seen of this block seen by the row (causal), the rest -inf
      const int64_t seen = a.causal ? std::min(nk, i0 + r + off - j0 + 1) : nk;
      if (seen < PA_KB)
        for (int j = 0; j < 4; ++j) acc[r][j] = lane + static_cast<float>(j * VN) < static_cast<float>(seen)
                                                    ? acc[r][j] : vnf{} - INFINITY;
      mv[r] = acc[r][0];
      for (int j = 1; j < 4; ++j) mv[r] = acc[r][j] > mv[r] ? acc[r][j] : mv[r];
    }
    alignas(64) float rmax[VN];
    if constexpr (VN == 16) {
      for (int r = R; r < (VN == 16 ? 8 : R); ++r) mv[r] = vnf{} - INFINITY;
      storev(rmax, row_maxima8(mv));
    } else {
      for (int r = 0; r < R; ++r) rmax[r] = hmax(mv[r]);
    }
    // m_old - m_new a row: 0 unchanged (factor 1, -inf - -inf included), -inf the first time (factor 0)
    const vnf mo = loadv<vnf>(m), mn = mo > loadv<vnf>(rmax) ? mo : loadv<vnf>(rmax);
    const vnf fall = mo == mn ? vnf{} : mo - mn;
    storev(m, mn);
    alignas(64) float fac[VN];
#if PA_BF16
    if constexpr (BF) storev(fac, (vnf)pmx_cpu::exp2_bf16((__m512)fall));
    else
#endif
    storev(fac, exp_neg(fall));
    for (int r = 0; r < R; ++r) {  // the row's probabilities, its scores in registers (the hidden keys' -inf give 0)
      vnf e[4], sum = lsum[r] * fac[r];
      for (int j = 0; j < 4; ++j) {
#if PA_BF16
        if constexpr (BF) e[j] = (vnf)pmx_cpu::exp2_bf16((__m512)(acc[r][j] - m[r]));
        else
#endif
        e[j] = exp_neg(acc[r][j] - m[r]);
        sum += e[j];
      }
      lsum[r] = sum;
#if PA_BF16
      if constexpr (BF) {  // p in bfloat16 pairs of keys (P v reads only these)
        for (int j = 0; j < 4; j += 2)
          _mm512_storeu_si512(pp[r] + j * VN / 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)e[j + 1], (__m512)e[j]));
        continue;
      }
#endif
      for (int j = 0; j < 4; ++j) storev(s[r] + j * VN, e[j]);
    }
#if PA_BF16
    if constexpr (BF) {  // o[r] += sum over key pairs of (p, p') . (v, v'), 4 vectors of the head's dims at a time
      const uint32_t* vb = a.vp2 + ((b * a.KV + g) * nkb + kb) * (PA_KB / 2) * D;
      const auto dims = [&](int64_t d0, auto nd) {  // nd vectors of dims from d0
        vnf y[R][nd];
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < nd; ++j) y[r][j] = loadv<vnf>(o[r] + d0 + j * VN) * fac[r];
        for (int64_t jp = 0; jp < (used + 1) / 2; ++jp) {
          __m512i vv[nd];
          for (int j = 0; j < nd; ++j) vv[j] = _mm512_loadu_si512(vb + jp * D + d0 + j * VN);
          for (int r = 0; r < R; ++r) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r][jp]));
            for (int j = 0; j < nd; ++j) y[r][j] = (vnf)_mm512_dpbf16_ps((__m512)y[r][j], (__m512bh)vv[j], x);
          }
        }
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < nd; ++j) storev(o[r] + d0 + j * VN, y[r][j]);
      };
      int64_t d0 = 0;
      for (; d0 + 4 * VN <= D; d0 += 4 * VN) dims(d0, std::integral_constant<int, 4>{});
      switch ((D - d0) / VN) {
        case 1: dims(d0, std::integral_constant<int, 1>{}); break;
        case 2: dims(d0, std::integral_constant<int, 2>{}); break;
        case 3: dims(d0, std::integral_constant<int, 3>{}); break;
        default: break;
      }
      continue;
    }
#endif
    // o[r] += sum_j s[r][j] v_j, 4 vectors of the head's dims at a time
    const float* vb = a.v + b * a.vs[0] + j0 * a.vs[1] + g * a.vs[2];
    int64_t d0 = 0;
    for (; d0 + 4 * VN <= D; d0 += 4 * VN) {
      vnf y[R][4];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) y[r][j] = loadv<vnf>(o[r] + d0 + j * VN) * fac[r];
      for (int64_t j = 0; j < used; ++j) {
        const float* vr = vb + j * a.vs[1] + d0;
        const vnf v0 = loadv<vnf>(vr), v1 = loadv<vnf>(vr + VN), v2 = loadv<vnf>(vr + 2 * VN), v3 = loadv<vnf>(vr + 3 * VN);
        for (int r = 0; r < R; ++r) {
          const float p = s[r][j];
          y[r][0] += p * v0;
          y[r][1] += p * v1;
          y[r][2] += p * v2;
          y[r][3] += p * v3;
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) storev(o[r] + d0 + j * VN, y[r][j]);
    }
    for (; d0 < D; d0 += VN) {  // the rest of the dims, a vector (or part of one) at a time
      const int64_t w = std::min<int64_t>(VN, D - d0);
      for (int r = 0; r < R; ++r)
        for (int64_t e = 0; e < w; ++e) o[r][d0 + e] *= fac[r];
      for (int64_t j = 0; j < used; ++j) {
        const float* vr = vb + j * a.vs[1] + d0;
        for (int r = 0; r < R; ++r)
          for (int64_t e = 0; e < w; ++e) o[r][d0 + e] += s[r][j] * vr[e];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t at = ((b * a.S + i0 + r) * a.H + h) * D;
    const float inv = 1.0f / hadd(lsum[r]);
#if PA_BF16
    if (a.out16) {  // (BF: D a multiple of 16) rounded to nearest even, as x_pairs would
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i*)(a.out16 + at + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o[r] + d), _mm512_set1_ps(inv))));
      continue;
    }
#endif
    for (int64_t d = 0; d < D; ++d) a.out[at + d] = o[r][d] * inv;
  }
}

// Whether prefill_attention takes bf16 = true here (AVX512-BF16).
bool prefill_attention_bf16() {
#if PA_BF16
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             bool causal, double softcap, bool bf16, bool bf16_out) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prefill_attention: q [B, S, H, D], k and v [B, N, KV, D], float32");
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3), N = k.size(1), KV = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && KV > 0 && H % KV == 0 && D <= 256 &&
                  N >= S && N > 0,
              "prefill_attention: k and v must be [B, N >= S, KV, D] with H a multiple of KV and D <= 256; got q ",
              q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "prefill_attention: D must be contiguous");
  TORCH_CHECK(!bf16 || (prefill_attention_bf16() && D % 16 == 0 && D <= 240),
              "prefill_attention: bfloat16 products need AVX512-BF16 and a head_dim a multiple of 16 up to 240, not ",
              D);
  TORCH_CHECK(!bf16_out || bf16, "prefill_attention: a bfloat16 output comes with bfloat16 products");
  const int64_t nkb = (N + PA_KB - 1) / PA_KB;
  // float32 keys transposed (bf16 products take their own pairs below instead); every element written
  const std::unique_ptr<float[]> kt(new float[bf16 ? 0 : B * KV * nkb * D * PA_KB]);
  const float* kp = k.data_ptr<float>();
  if (!bf16) at::parallel_for(0, B * KV * nkb, 1, [&](int64_t u0, int64_t u1) {  // a block at a time
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (KV * nkb), g = u / nkb % KV, kb = u % nkb;
      float* t = kt.get() + u * D * PA_KB;
      const auto key = [&](int64_t n) { return kp + b * k.stride(0) + n * k.stride(1) + g * k.stride(2); };
      int64_t d0 = 0;
#if defined(__AVX512F__)
      for (; d0 + 16 <= D; d0 += 16)  // 16 keys x 16 dims at a time, transposed in registers
        for (int64_t j0 = 0; j0 < PA_KB; j0 += 16) {
          __m512i w[16];
          for (int j = 0; j < 16; ++j) {
            const int64_t n = kb * PA_KB + j0 + j;
            w[j] = n < N ? _mm512_loadu_si512(key(n) + d0) : _mm512_setzero_si512();
          }
          transpose16(w);
          for (int i = 0; i < 16; ++i) _mm512_storeu_si512(t + (d0 + i) * PA_KB + j0, w[i]);
        }
#endif
      for (int64_t j = 0; j < PA_KB; ++j) {  // (the dims past the last 16)
        const int64_t n = kb * PA_KB + j;
        for (int64_t d = d0; d < D; ++d) t[d * PA_KB + j] = n < N ? key(n)[d] : 0.0f;
      }
    }
  });
  // bfloat16 pairs of the keys' dims and of the values' keys, a block at a time
  const std::unique_ptr<uint32_t[]> kp2(new uint32_t[bf16 ? B * KV * nkb * D * PA_KB : 0]);
  const std::unique_ptr<uint32_t[]> vp2(new uint32_t[bf16 ? B * KV * nkb * D * PA_KB : 0]);
#if PA_BF16
  if (bf16) {
    const float* vp = v.data_ptr<float>();
    at::parallel_for(0, B * KV * nkb, 1, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / (KV * nkb), g = u / nkb % KV, kb = u % nkb;
        uint32_t* kt2 = kp2.get() + u * (D / 2) * PA_KB;
        uint32_t* vt2 = vp2.get() + u * (PA_KB / 2) * D;
        const auto row = [&](const float* base, const at::Tensor& t, int64_t n, int64_t d) {  // 16 dims of row n
          return n < N ? _mm512_loadu_ps(base + b * t.stride(0) + n * t.stride(1) + g * t.stride(2) + d)
                       : _mm512_setzero_ps();
        };
        for (int64_t j0 = 0; j0 < PA_KB; j0 += 16)  // keys j0.. j0 + 16: their dims (d, d + 1) in pairs, 16 pairs
          for (int64_t d = 0; d < D; d += 32) {     // of each (a row of words), transposed into 16 keys a pair
            __m512i w[16];
            for (int j = 0; j < 16; ++j)
              w[j] = (__m512i)_mm512_cvtne2ps_pbh(D - d > 16 ? row(kp, k, kb * PA_KB + j0 + j, d + 16)
                                                              : _mm512_setzero_ps(),
                                                   row(kp, k, kb * PA_KB + j0 + j, d));
            transpose16(w);
            for (int64_t i = 0; i < std::min<int64_t>(16, (D - d) / 2); ++i)
              _mm512_storeu_si512(kt2 + (d / 2 + i) * PA_KB + j0, w[i]);
          }
        const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                               6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        for (int64_t j = 0; j < PA_KB; j += 2)  // value dims of keys j (low halves) and j + 1 (high)
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_si512(vt2 + j / 2 * D + d, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(
                row(vp, v, kb * PA_KB + j + 1, d), row(vp, v, kb * PA_KB + j, d))));
      }
    });
  }
#endif
  at::Tensor out = at::empty({B, S, H, D}, q.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const PrefillArgs a{q.data_ptr<float>(), kp, v.data_ptr<float>(),
                      {q.stride(0), q.stride(1), q.stride(2)}, {k.stride(0), k.stride(1), k.stride(2)},
                      {v.stride(0), v.stride(1), v.stride(2)}, B, S, N, H, KV, D, static_cast<float>(scale),
                      static_cast<float>(softcap), causal, kt.get(), bf16_out ? nullptr : out.data_ptr<float>(),
                      bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr, kp2.get(), vp2.get()};
  const int64_t units_per_head = (S + PA_QU - 1) / PA_QU, units = B * H * units_per_head;
  pmx_cpu::for_blocks(units, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      // the last rows first: the longest units (causal) go out first, the short ones even the threads out at the end
      const int64_t qb = units_per_head - 1 - u / (B * H), bh = u % (B * H), b = bh / H, h = bh % H;
      for (int64_t i0 = qb * PA_QU; i0 < std::min(S, (qb + 1) * PA_QU); i0 += PA_R) {
        const int64_t r = std::min<int64_t>(PA_R, S - i0);
#if PA_BF16
        if (bf16) {
          if (r == PA_R) prefill_tile<PA_R, true>(a, b, h, i0);
          else if (r == 1) prefill_tile<1, true>(a, b, h, i0);
          else if (r == 2) prefill_tile<2, true>(a, b, h, i0);
          else if (r == 3) prefill_tile<3, true>(a, b, h, i0);
          else if (r == 4) prefill_tile<4, true>(a, b, h, i0);
          else prefill_tile<5, true>(a, b, h, i0);
          continue;
        }
#endif
        if (r == PA_R) {
          prefill_tile<PA_R>(a, b, h, i0);
          continue;
        }
        switch (r) {
          case 1: prefill_tile<1>(a, b, h, i0); break;
          case 2: prefill_tile<2>(a, b, h, i0); break;
          case 3: prefill_tile<3>(a, b, h, i0); break;
          case 4: prefill_tile<4>(a, b, h, i0); break;
          default: prefill_tile<5>(a, b, h, i0);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pmx_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor cache, Tensor? kv_scale, int layout, int layer, Tensor rows, Tensor kvlens, "
        "int window, float scale, int page_size=0, Tensor? alibi=None, float softcap=0.0) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, bool causal, float softcap, bool bf16=False, "
        "bool bf16_out=False) -> Tensor");
  m.def("prefill_attention_bf16() -> bool", &prefill_attention_bf16);
  m.def("skip_rms_norm(Tensor x, Tensor? skip, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("geglu(Tensor gate, Tensor up) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("kv_store_(Tensor(a!) cache, Tensor(b!)? scale, int layout, int layer, Tensor k, Tensor v, Tensor slots) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(pmx_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("skip_rms_norm", &skip_rms_norm);
  m.impl("swiglu", &swiglu);
  m.impl("geglu", &geglu);
  m.impl("rotary_", &rotary_);
  m.impl("kv_store_", &kv_store_);
}
