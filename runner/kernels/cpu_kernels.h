// The CPU kernels of this project as plain functions on raw pointers: the ops of cpu_linear.cpp, cpu_step.cpp and
// cpu_comm.cpp wrap them (argument checks, outputs), and the one-call decode step of cpu_decode.cpp chains them.
// Every function runs its own at::parallel_for where it is parallel.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

namespace pmx_cpu {

#if defined(__AVX512F__)
// For values rounded to bfloat16 next (attention's probabilities, the MLP activation before the down projection's
// dot products): 2^t for each lane as 2^n (vscalefps) times a degree 4 polynomial of f = t - n in [-0.5, 0.5] (relative
// error < 3e-6, a thousandth of bfloat16's rounding; 10 instructions where a float32-exact exp takes 18); 0 below
// -126, for -inf and for NaN (-inf - -inf).
inline __m512 exp2_bf16(__m512 t) {
  const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.00956051983f), f, _mm512_set1_ps(0.0559171228f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240249817f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693121958f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999919f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// silu(g) u for values rounded to bfloat16 next: g / (1 + e^-g) with e^-|g| from exp2_bf16 and 1 / (1 + e) from
// vrcp14ps and a Newton step (relative error ~1e-5 in all: 17 instructions where swiglu_into's float32-exact form takes
// ~35, two divisions among them).
inline __m512 silu_mul_bf16(__m512 g, __m512 u) {
  const __m512 e = exp2_bf16(_mm512_mul_ps(_mm512_abs_ps(g), _mm512_set1_ps(-1.44269504088896341f)));  // e^-|g|
  const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));  // 1 / (1 + e)
  const __m512 sig = _mm512_mask_mul_ps(r, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), r, e);
  return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}
#endif

// body(b0, b1) over [0, blocks) in chunks taken by whichever thread comes for the next one first, each a fair share of
// what is left halved (OpenMP's "guided": long contiguous runs first, single blocks at the end to even the threads
// out), so that a thread the OS preempts (another process, a server's HTTP thread) takes fewer blocks rather than
// making the others wait for its fixed share; one thread, or a call from inside a parallel region, runs them all.
template <typename F>
inline void for_blocks(int64_t blocks, F&& body) {
  const int64_t threads = std::min<int64_t>(at::in_parallel_region() ? 1 : at::get_num_threads(), blocks);
  if (threads <= 1) {
    body(0, blocks);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t b0 = next.load(std::memory_order_relaxed);
    while (b0 < blocks) {
      const int64_t n = std::max<int64_t>(1, (blocks - b0) / (2 * threads));
      if (next.compare_exchange_weak(b0, b0 + n, std::memory_order_relaxed)) {
        body(b0, b0 + n);
        b0 = next.load(std::memory_order_relaxed);
      }
    }
  });
}

// The element type of a packed float weight (cpu_gemm.cpp).
enum class FloatWeight { f32, bf16, f16 };

// y [M, N] = x [M, K] W^T for W packed in blocks [N/64, K, 64] of `type` (half precision widened to float32 in
// registers, float32 accumulation): cpu_gemm.cpp.
void float_linear_into(const float* x, int64_t M, int64_t K, const void* w, FloatWeight type, int64_t blocks,
                       int64_t N, float* y);

// bfloat16 blocks hold each group of bf16_pair_channels() channels (2 vectors: 16 on AVX2, 32 on AVX-512) in pairs,
// channel i then channel g/2 + i (cpu_gemm.cpp; the packing code, runner/kernels/cpu_ext.py, asks for g).
int64_t bf16_pair_channels();

// A gate | up layer (N = 2 F, F a multiple of 64) on float weights without bfloat16 dot products: act [M, F] =
// silu(gate) * up in float32 of x W^T (x normed by `norm` where given), each block's activation computed in cache.
void float_linear_glu_into(const float* x, int64_t M, int64_t K, const void* w, FloatWeight type, int64_t blocks,
                           int64_t N, float* act, const float* norm, float eps);

// Where the CPU has AVX512-BF16: bfloat16 blocks hold their k-rows in pairs instead (a 32-bit word (w[2p][c],
// w[2p + 1][c]) a channel, an odd K's last row plainly; cpu_gemm.cpp), for vdpbf16ps.
bool bf16_k_pairs();

// out[m, 0..ncols) = x [M, K] . block for one float32 block [K, 64] (a quantised block dequantised into a buffer: the
// prefill path of cpu_linear.cpp), with the float32 GEMM's tiles; out row stride ldo.
void block_panel_f32(const float* x, int64_t M, int64_t K, const float* block, float* out, int64_t ldo,
                     int64_t ncols);

// The packed weight of a linear layer: kind 32 float32 blocks [N/64, K, 64]; kind 16 bfloat16 or float16 blocks [N/64,
// K, 64] (`half` says which; bfloat16's channels in pairs, above); kind 8 int8 blocks [N/64, K, 64] with a float32
// scale per channel [N] (group 0) or per group of `group` input columns [K/G, N/64*64]; kind 4 int4 blocks in the
// layout int4_layout(group) gives, scales [K/G, N/64*64]. Where int4 has offsets (w = nibble * scale + offset, GGUF's
// Q4_1) the scale tensor is [2, K/G, N/64*64]: the scales, then the offsets. cpu_linear.cpp's packing code
// (runner/kernels/cpu_ext.py, quant_linear.py) writes them.
struct PackedLinear {
  const void* w = nullptr;
  const float* scale = nullptr;
  const float* offset = nullptr;  // int4 with offsets: [K/G, N/64*64], else null
  int64_t kind = 32, group = 0, n = 0, k = 0, blocks = 0;
  FloatWeight half = FloatWeight::bf16;  // kind 16: bf16 or f16
};

// The PackedLinear of a packed weight `w` (and `scale`) of kind 32 / 16 / 8 / 4 for N = n outputs, after checking that
// the tensors have that kind's layout (errors begin with `what`). Points into the tensors: the caller keeps them.
PackedLinear packed_linear(const at::Tensor& w, const at::Tensor& scale, int64_t kind, int64_t group, int64_t n,
                           const std::string& what);

// y [M, N] = x [M, K] W^T, with what the linear op of the layer's kind runs at M rows: linear_f32 (float kinds) /
// linear_int8 / linear_int8_group / linear_int4, and for the quantised kinds above `dequant_above` rows linear_dequant
// (prefill sizes).
void linear_into(const PackedLinear& lin, const float* x, int64_t M, float* y, int64_t dequant_above);

int64_t int4_layout(int64_t group_size);

// One layer's K or V: [MaxT, KV, D] with head_dim contiguous, float32 (f) or int8 (q) with float16 scales per group of
// 8 (s: [MaxT, KV, D/8], last dim contiguous).
struct KVRows {
  const float* f = nullptr;
  const int8_t* q = nullptr;
  const at::Half* s = nullptr;
  int64_t row_stride = 0, head_stride = 0, srow_stride = 0, shead_stride = 0, KV = 0, D = 0;
};

// Where each decoding sequence's history lies: rows [B, N] a row table (page_size 0), [B] offsets (page_size 0) or
// [B, MaxP] page starts (page_size > 0); row_stride is rows' stride between sequences (0 for offsets).
struct HistoryRows {
  const int64_t* rows = nullptr;
  int64_t row_stride = 0, width = 0, page_size = 0;
  bool table = false, offsets = false;
};

// out [B, H, D] = decode attention of q (row b at q + b * q_stride, H x D contiguous) over the history rows, read in
// place (cpu_step.cpp, pmx_cpu::decode_attention); h from history_rows (checked); slopes: ALiBi's [H], or null;
// softcap > 0: the scores soft-capped, softcap tanh(s / softcap).
void decode_attention_into(const float* q, int64_t q_stride, int64_t B, int64_t H, const KVRows& k, const KVRows& v,
                           const HistoryRows& h, const int64_t* kvlens, int64_t window, float scale, float* out,
                           const float* slopes = nullptr, float softcap = 0.0f);

// A KV cache (or its int8 scales) of ppl.pmx `layout` 0..3 as (L, 2, MaxT, KV, last) strides (reference.cache_view).
struct CacheView {
  char* base = nullptr;
  int64_t elem = 0, sL = 0, s2 = 0, sT = 0, sH = 0, L = 0, T = 0, KV = 0, last = 0;
  CacheView(const at::Tensor& t, int64_t layout);
  template <typename T_>
  T_* row(int64_t layer, int64_t kv, int64_t t, int64_t h) const {  // one head's `last` contiguous values
    return reinterpret_cast<T_*>(base + elem * (layer * sL + kv * s2 + t * sT + h * sH));
  }
};
constexpr int64_t QUANT_GROUP = 8;  // int8 KV cache: values per float16 scale (reference.QUANT_GROUP)

// slots [T] (int64, contiguous) as the cache rows they are, each checked to lie inside c (errors begin with `what`).
const int64_t* checked_slots(const at::Tensor& slots, int64_t T, const CacheView& c, const char* what);

// The views of a cache and its scales (the cache's again where none), checked: float32, or int8 with float16 scales
// of its shape and head_dim / 8 last (errors begin with `what`); and the KVRows of a layer's K (which 0) or V (1).
std::pair<CacheView, CacheView> cache_views(const at::Tensor& cache, const c10::optional<at::Tensor>& scale,
                                            int64_t layout, const char* what);
KVRows kv_rows(const CacheView& c, const CacheView* scales, int64_t layer, int64_t which);

// The HistoryRows of `rows` (as above), after checking that every position the B sequences see (kvlens[b] long, the
// last `window` where > 0) has a row inside the cache's `maxt` rows.
HistoryRows history_rows(const at::Tensor& rows, int64_t page_size, const int64_t* kvlens, int64_t B, int64_t window,
                         int64_t maxt);

// The qkv linear's epilogue at any rows (AroundProduct::qkv): q and k, the first (H + KV) D channels of row m,
// rotated as rotary() does (the interleaved pairs of each head's first R dims, at cos / sin [M, R/2] row m), then k
// and v written into cache rows slots[m] of `layer` as kv_store does (s: an int8 cache's scales, else null).
struct QKVEpilogue {
  const float *cos, *sin;
  int64_t R, H, KV, D, layer;
  const CacheView* cache;
  const CacheView* scales;
  const int64_t* slots;
};

// The work around a linear's product, each part optional (float_linear_fused_into, bf16_linear_dot_into).
struct AroundProduct {
  bool swiglu = false;              // x [M, 2 K] = (g | u): the product's input is silu(g) * u
  const float* norm = nullptr;      // x normed on the way in: rms_norm(x) * norm (a weight [K]; eps)
  float eps = 0;
  const float* res = nullptr;       // y = x W^T + res ([M, N])
  const QKVEpilogue* qkv = nullptr;  // each block of rows through the qkv epilogue while it is in cache (not with res)
};

// float_linear_into with the work around it. On bfloat16 weights with AVX512-BF16 each row's activation or norm is
// computed in cache as x is converted for the dot products, and res is added as the output is stored (no pass of its
// own over [M, K] or [M, N]); elsewhere they are passes before and after the product. The qkv epilogue runs on each
// unit's rows as they are computed, whatever the weight: no pass over q, k and v of their own.
void float_linear_fused_into(const float* x, int64_t M, int64_t K, const void* w, FloatWeight type, int64_t blocks,
                             int64_t N, float* y, const AroundProduct& a);

// Where bf16_k_pairs() (bfloat16 blocks, AVX512-BF16): y = x W^T with `a`'s work, x given as bfloat16 xb [M, K] (K
// even; its rows are the dot products' pairs: nothing converted), or float32 x when xb is null. glu (N = 2 F, F a
// multiple of 64; y unused): the layer is a gate | up projection and glu [M, F] receives silu(gate) * up rounded to
// bfloat16 (round to nearest even, as x is rounded for the dot products), computed a block of each at a time in cache.
void bf16_linear_dot_into(const uint16_t* xb, const float* x, int64_t M, int64_t K, const void* w, int64_t blocks,
                          int64_t N, float* y, uint16_t* glu, const AroundProduct& a);

// reference.quantize_int8 of n values: per group of 8, scale = max(max|x| / 127, 1e-5) (stored float16), and
// q = clamp(round_half_even(x / scale), -127, 127) divided by the float32 scale, as the reference does.
void quantize_int8(const float* x, int64_t n, int8_t* q, at::Half* s);

// reference.kv_store of k, v [T, KV, D] (head h of row t at t * t_stride + h * h_stride) into rows slots[t] of layer
// `layer` of the cache c: float32, or (s not null) int8 quantised, with its float16 scales in s.
void kv_store(const float* k, const float* v, int64_t T, int64_t t_stride, int64_t h_stride, const CacheView& c,
              const CacheView* s, int64_t layer, const int64_t* slots);

// n interleaved pairs (a, b) of p -> (a cos - b sin, a sin + b cos), cos and sin [n] (rotary and the qkv epilogue: one
// source, so that both round alike).
inline void rotate_pairs(float* p, const float* c, const float* s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float a = p[2 * j], b = p[2 * j + 1];
    p[2 * j] = a * c[j] - b * s[j];
    p[2 * j + 1] = a * s[j] + b * c[j];
  }
}

// reference.apply_rotary in place: pairs (a, b) of x [T, heads, D] (strided as kv_store's k) -> (a cos - b sin,
// a sin + b cos), cos and sin [T, D/2] contiguous (a partial rotary: D the rotated dims, h_stride the head's).
void rotary(float* x, int64_t T, int64_t t_stride, int64_t h_stride, int64_t heads, int64_t D, const float* cos,
            const float* sin);

// r = x + skip (skip may be null: r = x; r may alias x or skip), y = rms_norm(r) * w, rows of D.
void skip_rms_norm_into(const float* x, const float* skip, const float* w, int64_t M, int64_t D, float eps, float* r,
                        float* y);

// x[0..n) = cap tanh(x / cap) in place (reference.soft_cap; tanh as 2 sigmoid(2u) - 1, a vector at a time).
void soft_cap_into(float* x, int64_t n, float cap);

// out [M, D] = silu(gate) * up (swiglu) / gelu_tanh(gate) * up (geglu), rows of gate / up at strides gs / us.
void swiglu_into(const float* gate, int64_t gs, const float* up, int64_t us, int64_t M, int64_t D, float* out);
void geglu_into(const float* gate, int64_t gs, const float* up, int64_t us, int64_t M, int64_t D, float* out);

// Releases the GIL for as long as it lives, if this thread holds it (callers may come from Python or not), so other
// Python threads (the communicator's watchdog, a server's event loop) run meanwhile.
struct GilRelease {
  void* state = nullptr;  // PyThreadState*
  GilRelease();
  ~GilRelease();
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;
};

// Shared-memory collectives (cpu_comm.cpp) on raw buffers: a float32 sum in place, and a rank-major gather of
// `bytes` from every rank into out [world * bytes].
void shm_all_reduce_f32(const at::Tensor& ws, int64_t rank, int64_t world, float* t, int64_t numel, double timeout_s);
void shm_all_gather_bytes(const at::Tensor& ws, int64_t rank, int64_t world, const void* src, int64_t bytes, void* out,
                          double timeout_s);

}  // namespace pmx_cpu
