// The decode step of a CPU engine in one call, from token ids to logits (class pmx_cpu.DecodeModel): the kernels the
// eager step calls (cpu_kernels.h), on the same packed weights, chained without Python or torch's dispatcher between
// them (on CPU, once a step has streamed the weights through the caches, each such call is a cold one); at TP > 1 the
// collectives on the ranks' shared memory. It is driven by a description of the model (runner/engine/fused_decode.py):
// a Linear per linear layer, a Layer per decoder layer, DecodeModel over them; DecodeModel.features() declares what a
// layer may have, and fused_decode.why_not keeps every other model away.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/StringUtil.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"

namespace {

// A linear layer on a packed weight (kind 32 float32, 16 bfloat16 / float16, 8 int8, 4 int4; scale empty for the float
// kinds; cpu_kernels.h's PackedLinear) and its bias.
// `reduced`: row-parallel, its partial sums all-reduced before the bias is added (once, as RowParallelLinear does).
struct Linear : torch::CustomClassHolder {
  at::Tensor weight, scale, bias;  // held: p and b point into them
  pmx_cpu::PackedLinear p;
  const float* b = nullptr;
  bool reduced;

  Linear(at::Tensor w, at::Tensor s, c10::optional<at::Tensor> b_, int64_t kind, int64_t group, int64_t out_features,
         bool reduced_, const std::string& what)
      : weight(std::move(w)), scale(std::move(s)), bias(b_.value_or(at::Tensor())), reduced(reduced_) {
    p = pmx_cpu::packed_linear(weight, scale, kind, group, out_features, what);
    TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == p.n),
                what, ": bias must be contiguous float32 [", p.n, "]");
    b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  }
};
using LinearPtr = c10::intrusive_ptr<Linear>;

// A decoder layer (runner.engine.model.Block): x += post_attention_norm(wo(attention(norm(x)))),
// x += post_ffn_norm(w2(act(gate) * up)), gate | up = gate_up(norm(x)), act silu or (gelu) GELU's tanh form, the post
// norms where given; with `heads` over kv_heads K/V heads of head_dim, q and k rms-normed where q_norm / k_norm are
// given, then their first rotary_dim dims rotated on interleaved pairs (0: none) with the step's rope number `rope`,
// the scores q k * scale (soft-capped, softcap tanh(s / softcap), where softcap > 0), ALiBi's slope per head added to
// them where `alibi` is given, the last `window` positions seen (0: all).
struct Layer : torch::CustomClassHolder {
  at::Tensor attention_norm, ffn_norm, q_norm, k_norm;  // q_norm, k_norm: both undefined where the layer has none
  at::Tensor post_attention_norm, post_ffn_norm;         // both undefined where the layer has none
  at::Tensor alibi;                                      // this rank's heads' slopes [heads], or undefined
  LinearPtr qkv, wo, gate_up, w2;
  int64_t heads, kv_heads, head_dim, window, ffn, rotary_dim, rope;  // ffn: this rank's intermediate size
  float eps, scale, softcap;
  bool gelu;

  Layer(int64_t index, at::Tensor attention_norm_, at::Tensor ffn_norm_, c10::optional<at::Tensor> q_norm_,
        c10::optional<at::Tensor> k_norm_, LinearPtr qkv_, LinearPtr wo_, LinearPtr gate_up_, LinearPtr w2_,
        int64_t heads_, int64_t kv_heads_, int64_t head_dim_, int64_t window_, double eps_, int64_t rotary_dim_,
        c10::optional<at::Tensor> alibi_, c10::optional<at::Tensor> post_attention_norm_,
        c10::optional<at::Tensor> post_ffn_norm_, bool gelu_, double scale_, double softcap_, int64_t rope_)
      : attention_norm(std::move(attention_norm_)), ffn_norm(std::move(ffn_norm_)),
        q_norm(q_norm_.value_or(at::Tensor())), k_norm(k_norm_.value_or(at::Tensor())),
        post_attention_norm(post_attention_norm_.value_or(at::Tensor())),
        post_ffn_norm(post_ffn_norm_.value_or(at::Tensor())),
        alibi(alibi_.value_or(at::Tensor())), qkv(std::move(qkv_)), wo(std::move(wo_)), gate_up(std::move(gate_up_)),
        w2(std::move(w2_)), heads(heads_), kv_heads(kv_heads_), head_dim(head_dim_), window(window_), ffn(w2->p.k),
        rotary_dim(rotary_dim_), rope(rope_), eps(static_cast<float>(eps_)), scale(static_cast<float>(scale_)),
        softcap(static_cast<float>(softcap_)), gelu(gelu_) {
    const int64_t D = attention_norm.numel(), hd = head_dim;
    const auto need = [&](bool ok, const char* field, const auto&... want) {  // (the message made only on failure)
      TORCH_CHECK(ok, "decoder layer ", index, ": ", field, " must be ", want...);
    };
    const auto vec = [](const at::Tensor& t, int64_t n) {
      return t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 && t.numel() == n;
    };
    need(kv_heads > 0 && heads % kv_heads == 0, "heads", "a multiple of kv_heads ", kv_heads, ", not ", heads);
    need(hd > 0 && hd % 2 == 0 && window >= 0, "head_dim, window", "even, >= 0, not ", hd, ", ", window);
    need(D > 0 && vec(attention_norm, D) && vec(ffn_norm, D), "attention_norm, ffn_norm", "float32 [hidden]");
    need(q_norm.defined() == k_norm.defined() && (!q_norm.defined() || (vec(q_norm, hd) && vec(k_norm, hd))),
         "q_norm and k_norm", "both absent or contiguous float32 [", hd, "]");
    need(rotary_dim >= 0 && rotary_dim <= hd && rotary_dim % 2 == 0, "rotary_dim",
         "even, in [0, ", hd, "], not ", rotary_dim);
    need(!alibi.defined() || vec(alibi, heads), "alibi", "absent or contiguous float32 [", heads, "]");
    need(post_attention_norm.defined() == post_ffn_norm.defined() &&
             (!post_ffn_norm.defined() || (vec(post_attention_norm, D) && vec(post_ffn_norm, D))),
         "post_attention_norm and post_ffn_norm", "both absent or contiguous float32 [hidden]");
    need(scale > 0 && softcap >= 0 && rope >= 0, "scale, softcap, rope",
         "> 0, >= 0, >= 0, not ", scale, ", ", softcap, ", ", rope);
    const std::tuple<const Linear*, const char*, int64_t, int64_t, bool> lins[] = {
        {qkv.get(), "qkv", (heads + 2 * kv_heads) * hd, D, false}, {wo.get(), "wo", D, heads * hd, true},
        {gate_up.get(), "gate_up", 2 * ffn, D, false}, {w2.get(), "w2", D, ffn, true}};
    for (const auto& [l, field, n, k, row] : lins)  // [outputs x inputs]; row-parallel: bias after the all-reduce
      need(l->p.n == n && l->p.k == k && l->reduced == row, field, row ? "row" : "column", "-parallel [", n,
           " x ", k, "], not ", l->reduced ? "row" : "column", "-parallel [", l->p.n, " x ", l->p.k, "]");
  }
};

// This rank's columns of the token embedding, [V, Dn] (Dn = hidden / ranks), and one row of it widened or dequantised
// as it is gathered: float32; bfloat16 or float16; int8 with a scale per row (scale [V], the full row's) or, group > 0,
// per group of `group` columns (scale [V, Dn / group]); int4 bytes [V, Dn / 2] (column 2j in the low nibble, 2j+1 in
// the high one, the value nibble - 8) with a scale per group of `group` columns (scale [V, Dn / group]), or with
// offsets (scale [2, V, Dn / group]: the scales, then the offsets; the value nibble * scale + offset). Each value is
// computed as runner.pmx.quant.dequantize does.
struct Embedding {
  at::Tensor weight, scale;
  int64_t kind = 32, group = 0, V = 0, Dn = 0;
  const float* offsets = nullptr;  // int4 with offsets: [V, Dn / group]

  Embedding(at::Tensor w, at::Tensor s, int64_t group_) : weight(std::move(w)), scale(std::move(s)), group(group_) {
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "DecodeModel: embedding must be a contiguous matrix");
    V = weight.size(0);
    const auto st = weight.scalar_type();
    kind = st == at::kFloat ? 32 : st == at::kBFloat16 || st == at::kHalf ? 16 : st == at::kChar ? 8
           : st == at::kByte ? 4 : 0;
    Dn = weight.size(1) * (kind == 4 ? 2 : 1);
    TORCH_CHECK(kind != 0, "DecodeModel: embedding must be float32, bfloat16, float16, int8 or int4 (uint8 bytes), ",
                "not ", st);
    const auto scale_ok = [&](std::vector<int64_t> shape) {
      return scale.defined() && scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.sizes() == shape;
    };
    const int64_t groups = Dn / (group > 0 ? group : 1);
    const bool grouped = group > 0 && Dn % group == 0 && scale_ok({V, groups});
    const bool with_offsets = kind == 4 && group > 0 && Dn % group == 0 && scale_ok({2, V, groups});
    TORCH_CHECK(kind == 32 || kind == 16 ? !scale.defined() : kind == 8 ? (group == 0 ? scale_ok({V}) : grouped) :
                    grouped || with_offsets,
                "DecodeModel: embedding scale must be absent (float), float32 [V] (int8) or float32 [V, columns / ",
                "group] (int8 in groups, int4; [2, V, columns / group] for int4 with offsets)");
    if (with_offsets) offsets = scale.data_ptr<float>() + V * groups;
  }

  void row(int64_t t, float* out) const {
    if (kind == 32) {
      std::memcpy(out, weight.data_ptr<float>() + t * Dn, Dn * sizeof(float));
    } else if (kind == 16 && weight.scalar_type() == at::kBFloat16) {
      const c10::BFloat16* q = weight.data_ptr<c10::BFloat16>() + t * Dn;
      for (int64_t d = 0; d < Dn; ++d) out[d] = static_cast<float>(q[d]);
    } else if (kind == 16) {
      const at::Half* q = weight.data_ptr<at::Half>() + t * Dn;
      for (int64_t d = 0; d < Dn; ++d) out[d] = static_cast<float>(q[d]);
    } else if (kind == 8 && group > 0) {
      const int8_t* q = weight.data_ptr<int8_t>() + t * Dn;
      const float* s = scale.data_ptr<float>() + t * (Dn / group);
      for (int64_t d = 0; d < Dn; ++d) out[d] = static_cast<float>(q[d]) * s[d / group];
    } else if (kind == 8) {
      const int8_t* q = weight.data_ptr<int8_t>() + t * Dn;
      const float s = scale.data_ptr<float>()[t];
      for (int64_t d = 0; d < Dn; ++d) out[d] = static_cast<float>(q[d]) * s;
    } else if (offsets) {
      const uint8_t* q = weight.data_ptr<uint8_t>() + t * (Dn / 2);
      const float* s = scale.data_ptr<float>() + t * (Dn / group);
      const float* o = offsets + t * (Dn / group);
      for (int64_t j = 0; j < Dn / 2; ++j) {
        out[2 * j] = static_cast<float>(q[j] & 15) * s[2 * j / group] + o[2 * j / group];
        out[2 * j + 1] = static_cast<float>(q[j] >> 4) * s[(2 * j + 1) / group] + o[(2 * j + 1) / group];
      }
    } else {
      const uint8_t* q = weight.data_ptr<uint8_t>() + t * (Dn / 2);
      const float* s = scale.data_ptr<float>() + t * (Dn / group);
      for (int64_t j = 0; j < Dn / 2; ++j) {
        out[2 * j] = static_cast<float>((q[j] & 15) - 8) * s[2 * j / group];
        out[2 * j + 1] = static_cast<float>((q[j] >> 4) - 8) * s[(2 * j + 1) / group];
      }
    }
  }
};

struct DecodeModel : torch::CustomClassHolder {
  Embedding embedding;  // this rank's columns
  at::Tensor norm;      // the final norm [hidden]
  std::vector<c10::intrusive_ptr<Layer>> layers;
  LinearPtr output;  // this rank's part of the vocabulary
  float eps, embedding_multiplier, final_softcap;  // the embeddings times the multiplier; the logits soft-capped (> 0)
  int64_t ropes = 1;  // the cos / sin a step takes: one per rope the layers use
  int64_t hidden, dequant_above, widest_window = 0, ffn = 0;  // widest_window 0: a layer sees every position
  at::Tensor ws;  // shared-memory workspace of the ranks (world > 1)
  int64_t rank, world;
  double timeout_s;
  std::vector<float> scratch;
  std::mutex busy;  // one step at a time per model (the scratch is shared)

  // dequant_above: the quantised linears' row count above which they dequantise (pmx_cpu::linear_into)
  DecodeModel(at::Tensor embedding_, c10::optional<at::Tensor> embedding_scale_, int64_t embedding_group,
              std::vector<c10::intrusive_ptr<Layer>> layers_, at::Tensor norm_, double eps_, LinearPtr output_,
              int64_t dequant_above_, at::Tensor workspace, int64_t rank_, int64_t world_, double deadline_s,
              double embedding_multiplier_, double final_softcap_)
      : embedding(std::move(embedding_), embedding_scale_.value_or(at::Tensor()), embedding_group),
        norm(std::move(norm_)), layers(std::move(layers_)),
        output(std::move(output_)), eps(static_cast<float>(eps_)),
        embedding_multiplier(static_cast<float>(embedding_multiplier_)),
        final_softcap(static_cast<float>(final_softcap_)),
        hidden(norm.numel()), dequant_above(dequant_above_),
        ws(std::move(workspace)), rank(rank_), world(world_), timeout_s(deadline_s) {
    TORCH_CHECK(!layers.empty() && norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.dim() == 1,
                "DecodeModel: decoder layers and a final norm of contiguous float32 [hidden] expected");
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer &l = *layers[i], &l0 = *layers[0];
      TORCH_CHECK(l.attention_norm.numel() == hidden && l.heads == l0.heads && l.kv_heads == l0.kv_heads &&
                      l.head_dim == l0.head_dim && l.rotary_dim == l0.rotary_dim, "DecodeModel: decoder layer ", i,
                  " must have the final norm's hidden (", hidden, ") and layer 0's heads, kv_heads, head_dim, ",
                  "rotary_dim (", l0.heads, ", ", l0.kv_heads, ", ", l0.head_dim, ", ", l0.rotary_dim, ")");
      widest_window = (i == 0 || widest_window > 0) && l.window > 0 ? std::max(widest_window, l.window) : 0;
      ffn = std::max(ffn, l.ffn);
      ropes = std::max(ropes, l.rope + 1);
    }
    TORCH_CHECK(output->p.k == hidden && !output->reduced, "DecodeModel: output must be column-parallel with ", hidden,
                " inputs, not ", output->p.k);
    TORCH_CHECK(embedding.Dn * world >= hidden && (world > 1 || embedding.Dn == hidden), "DecodeModel: embedding ",
                "must have hidden / ranks columns, not ", embedding.Dn);
    TORCH_CHECK(world == 1 || (ws.scalar_type() == at::kByte && ws.numel() > 0),
                "DecodeModel: ", world, " ranks need the shared-memory workspace");
  }

  // y [M, n] = x W^T of l, all-reduced where it is row-parallel, plus its bias
  void linear(const Linear& l, const float* x, int64_t M, float* y) {
    pmx_cpu::linear_into(l.p, x, M, y, dequant_above);
    if (l.reduced && world > 1) pmx_cpu::shm_all_reduce_f32(ws, rank, world, y, M * l.p.n, timeout_s);
    for (int64_t m = 0; l.b != nullptr && m < M; ++m)
      for (int64_t j = 0; j < l.p.n; ++j) y[m * l.p.n + j] += l.b[j];
  }

  // out [B, n_out] = the ranks' parts [B, n] (this rank's: part) side by side, cut at n_out
  void all_gather(const float* part, int64_t B, int64_t n, float* gathered, float* out, int64_t n_out) {
    pmx_cpu::shm_all_gather_bytes(ws, rank, world, part, B * n * sizeof(float), gathered, timeout_s);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t r = 0; r < world && r * n < n_out; ++r)
        std::memcpy(out + b * n_out + r * n, gathered + (r * B + b) * n, std::min(n, n_out - r * n) * sizeof(float));
  }

  // logits [B, ranks x vocab part] of the step where each of the B sequences decodes tokens[b] at position
  // kvlens[b] - 1: k and v written at cache row slots[b] of every layer, the history read where cachestarts says
  // (offsets [B], or page starts [B, MaxP] of page_size rows), cos / sin [ropes, B, rotary_dim / 2] of each
  // position for each rope.
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& cache, const c10::optional<at::Tensor>& cache_scale,
                  int64_t layout, const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& cachestarts, const at::Tensor& kvlens, int64_t page_size) {
    const int64_t B = tokens.numel(), D = hidden, L = layers.size(), H = layers[0]->heads, KV = layers[0]->kv_heads;
    const int64_t hd = layers[0]->head_dim, rd = layers[0]->rotary_dim, F = ffn;
    auto int64_vec = [&](const at::Tensor& t, const char* what) {
      TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.numel() == B && t.is_contiguous(), "decode step: ",
                  what, " must be contiguous int64 [", B, "]");
      return t.data_ptr<int64_t>();
    };
    const int64_t* tok = int64_vec(tokens, "tokens");
    const int64_t* slot = int64_vec(slots, "slots");
    const int64_t* lens = int64_vec(kvlens, "kvlens");
    for (const at::Tensor* t : {&cos, &sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) >= ropes &&
                      t->size(1) == B && t->size(2) == rd / 2,
                  "decode step: cos and sin must be contiguous float32 [", ropes, ", ", B, ", ", rd / 2, "]");
    const auto [cv, sv] = pmx_cpu::cache_views(cache, cache_scale, layout, "decode step");
    const pmx_cpu::CacheView* scales = cache.scalar_type() == at::kChar ? &sv : nullptr;
    TORCH_CHECK(cv.L == L && cv.KV == KV && cv.last == hd, "decode step: cache of shape ", cache.sizes(), " is not ",
                "one of ", L, " layers, ", KV, " KV heads of ", hd, " in layout ", layout);
    const pmx_cpu::HistoryRows hist = pmx_cpu::history_rows(cachestarts, page_size, lens, B, widest_window, cv.T);
    const int64_t V = embedding.V, Dn = embedding.Dn;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(tok[b] >= 0 && tok[b] < V, "decode step: token id ", tok[b], " is outside the vocabulary of ", V);
      TORCH_CHECK(slot[b] >= 0 && slot[b] < cv.T, "decode step: cache row ", slot[b], " is outside the cache's ", cv.T,
                  " rows");
    }
    const pmx_cpu::GilRelease unlocked;  // the step touches no Python object: other threads run meanwhile
    std::lock_guard<std::mutex> lock(busy);  // (after the GIL is released: a second caller waits without holding it)
    const int64_t NQKV = (H + 2 * KV) * hd, Vn = output->p.n;
    // scratch: x, resid, h [B, D]; qkv [B, NQKV]; attn [B, H hd]; gu [B, 2F]; act [B, F]; gathered [world B G] and
    // local [B G], G = max(Dn, Vn) (this rank's embedding columns or vocabulary part before a gather)
    const int64_t G = std::max(Dn, Vn), sizes[] = {B * D, B * D, B * D, B * NQKV, B * H * hd, B * 2 * F, B * F,
                                                    world * B * G, B * G};
    int64_t total = 0;
    for (int64_t s : sizes) total += (s + 15) / 16 * 16;
    scratch.resize(std::max<int64_t>(scratch.size(), total));
    float* bufs[9];
    for (int64_t i = 0, off = 0; i < 9; off += (sizes[i] + 15) / 16 * 16, ++i) bufs[i] = scratch.data() + off;
    float *x = bufs[0], *resid = bufs[1], *h = bufs[2], *qkv = bufs[3], *attn = bufs[4], *gu = bufs[5], *act = bufs[6];
    float *gathered = bufs[7], *local = bufs[8];

    for (int64_t b = 0; b < B; ++b)  // this rank's columns (ParallelEmbedding), gathered into resid
      embedding.row(tok[b], world == 1 ? resid + b * D : local + b * Dn);
    if (world > 1) all_gather(local, B, Dn, gathered, resid, D);
    if (embedding_multiplier != 1.0f)
      for (int64_t i = 0; i < B * D; ++i) resid[i] *= embedding_multiplier;
    for (int64_t l = 0; l < L; ++l) {
      const Layer& y = *layers[l];
      pmx_cpu::skip_rms_norm_into(l == 0 ? resid : x, l == 0 ? nullptr : resid, y.attention_norm.data_ptr<float>(), B,
                                  D, y.eps, l == 0 ? nullptr : resid, h);
      linear(*y.qkv, h, B, qkv);
      for (int64_t b = 0; b < B && y.q_norm.defined(); ++b) {
        float *q = qkv + b * NQKV, *k = q + H * hd;
        pmx_cpu::skip_rms_norm_into(q, nullptr, y.q_norm.data_ptr<float>(), H, hd, y.eps, nullptr, q);
        pmx_cpu::skip_rms_norm_into(k, nullptr, y.k_norm.data_ptr<float>(), KV, hd, y.eps, nullptr, k);
      }
      if (rd > 0)  // q, k: adjacent heads; their first rd dims rotate
        pmx_cpu::rotary(qkv, B, NQKV, hd, H + KV, rd, cos.data_ptr<float>() + y.rope * B * (rd / 2),
                        sin.data_ptr<float>() + y.rope * B * (rd / 2));
      pmx_cpu::kv_store(qkv + H * hd, qkv + (H + KV) * hd, B, NQKV, hd, cv, scales, l, slot);
      pmx_cpu::decode_attention_into(qkv, NQKV, B, H, pmx_cpu::kv_rows(cv, scales, l, 0),
                                     pmx_cpu::kv_rows(cv, scales, l, 1), hist, lens, y.window, y.scale, attn,
                                     y.alibi.defined() ? y.alibi.data_ptr<float>() : nullptr, y.softcap);
      linear(*y.wo, attn, B, x);
      if (y.post_attention_norm.defined())  // (in place: each value is read before it is written)
        pmx_cpu::skip_rms_norm_into(x, nullptr, y.post_attention_norm.data_ptr<float>(), B, D, y.eps, nullptr, x);
      pmx_cpu::skip_rms_norm_into(x, resid, y.ffn_norm.data_ptr<float>(), B, D, y.eps, resid, h);
      linear(*y.gate_up, h, B, gu);
      (y.gelu ? pmx_cpu::geglu_into : pmx_cpu::swiglu_into)(gu, 2 * y.ffn, gu + y.ffn, 2 * y.ffn, B, y.ffn, act);
      linear(*y.w2, act, B, x);
      if (y.post_ffn_norm.defined())
        pmx_cpu::skip_rms_norm_into(x, nullptr, y.post_ffn_norm.data_ptr<float>(), B, D, y.eps, nullptr, x);
    }
    pmx_cpu::skip_rms_norm_into(x, resid, norm.data_ptr<float>(), B, D, eps, resid, h);
    at::Tensor logits = at::empty({B, world * Vn}, norm.options());
    float* lp = logits.data_ptr<float>();
    linear(*output, h, B, world == 1 ? lp : local);
    if (world > 1) all_gather(local, B, Vn, gathered, lp, world * Vn);
    if (final_softcap > 0) pmx_cpu::soft_cap_into(lp, B * world * Vn, final_softcap);
    return logits;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pmx_cpu, m) {
  using torch::arg;
  m.class_<Linear>("Linear").def(
      torch::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t, int64_t, bool, std::string>(),
      "", {arg("weight"), arg("scale"), arg("bias"), arg("kind"), arg("group"), arg("out_features"), arg("reduced"),
           arg("what")});
  m.class_<Layer>("Layer").def(
      torch::init<int64_t, at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, LinearPtr,
                  LinearPtr, LinearPtr, LinearPtr, int64_t, int64_t, int64_t, int64_t, double, int64_t,
                  c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>, bool, double,
                  double, int64_t>(), "",
      {arg("index"), arg("attention_norm"), arg("ffn_norm"), arg("q_norm"), arg("k_norm"), arg("qkv"), arg("wo"),
       arg("gate_up"), arg("w2"), arg("heads"), arg("kv_heads"), arg("head_dim"), arg("window"), arg("eps"),
       arg("rotary_dim"), arg("alibi"), arg("post_attention_norm"), arg("post_ffn_norm"), arg("gelu"), arg("scale"),
       arg("softcap"), arg("rope")});
  m.class_<DecodeModel>("DecodeModel")
      .def(torch::init<at::Tensor, c10::optional<at::Tensor>, int64_t, std::vector<c10::intrusive_ptr<Layer>>,
                       at::Tensor, double, LinearPtr, int64_t, at::Tensor, int64_t, int64_t, double, double,
                       double>(), "",
           {arg("embedding"), arg("embedding_scale"), arg("embedding_group"), arg("layers"), arg("norm"), arg("eps"),
            arg("output"), arg("dequant_above"), arg("workspace"), arg("rank"), arg("world"), arg("deadline_s"),
            arg("embedding_multiplier"), arg("final_softcap")})
      .def("step", &DecodeModel::step)
      .def_static("features", []() {  // what a layer may have (fused_decode.LayerFeatures.names); nothing else
        return std::vector<std::string>{"rotary", "rotary_partial", "alibi", "swiglu", "geglu", "packed_linears",
                                        "qkv_bias", "o_bias", "ffn_bias", "qk_norm", "post_norms", "sliding_window",
                                        "attn_softcap"};
      });
}
