// The whole decode step of a CPU engine in one call (class pmx_cpu.DecodeModel, runner/engine/fused_decode.py).
//
// A decode step on CPU streams every weight once; what it spends besides is per-call cost: after the weights have
// gone through the caches, every torch call, dispatcher lookup and Python line of a step is a cold one (15-40 us each
// on the project's CPU: benchmarks/RESULTS.md, "Session 7"), and the compiled step made ~10 of them per layer. Here
// one call runs the step from token ids to logits: the embedding, per layer the residual add + RMSNorm, the fused qkv
// linear, q/k norms where the model has them, rotary on q and k, the K/V store, decode attention read in place from
// the cache, the output projection, the all-reduce (ranks on one machine, shared memory), the second norm, gate|up,
// SwiGLU, the down projection and its all-reduce; then the final norm, the vocabulary projection and the logits'
// all-gather. Each piece is the kernel the op of the same name runs (cpu_kernels.h): the linears on the weights packed
// at load (float32, int8, int4), so this is the eager step's arithmetic without its calls. Buffers are the object's
// own, reused from step to step.
//
// The weights are given once, at construction: per layer attention_norm, ffn_norm, q_norm, k_norm (the last two empty
// where the model has none) and then the final norm; per layer the linears qkv, wo, gate_up, w2 (fused: one each) and
// then the vocabulary projection, each as its packed weight, scale (empty for float32), bias (empty where none; wo's
// and w2's are added after the all-reduce, as the row-parallel layers do), kind (32 float32, 8 int8, 4 int4) and group.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int64_t NB = 64;  // output channels per block of a packed weight

struct Linear {
  pmx_cpu::PackedLinear p;
  at::Tensor weight, scale, bias;  // held: p points into them
  const float* b = nullptr;
};

Linear make_linear(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& bias, int64_t kind, int64_t group,
                   int64_t n, int64_t index) {
  Linear l;
  l.weight = w, l.scale = scale, l.bias = bias;
  l.p = pmx_cpu::packed_linear(w, scale, kind, group, n, "DecodeModel: linear " + std::to_string(index));
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n, "DecodeModel: linear ",
                index, ": bias must be contiguous float32 [", n, "]");
    l.b = bias.data_ptr<float>();
  }
  return l;
}

inline void add_bias(float* y, const float* b, int64_t M, int64_t N) {
  if (b == nullptr) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < N; ++j) y[m * N + j] += b[j];
}

struct DecodeModel : torch::CustomClassHolder {
  at::Tensor embedding;  // [V, Dn]: this rank's columns
  std::vector<at::Tensor> norms;
  std::vector<Linear> lins;
  int64_t L = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, window = 0, dequant_above = 0, ffn = 0;
  float eps = 0;
  at::Tensor ws;  // shared-memory workspace of the ranks (world > 1)
  int64_t rank = 0, world = 1;
  double timeout_s = 0;
  std::vector<float> scratch;
  std::mutex busy;  // one step at a time per model (the scratch is shared)

  DecodeModel(at::Tensor embedding_, std::vector<at::Tensor> norms_, std::vector<at::Tensor> weights,
              std::vector<at::Tensor> scales, std::vector<at::Tensor> biases, std::vector<int64_t> kinds,
              std::vector<int64_t> groups, std::vector<int64_t> dims, double eps_, at::Tensor ws_, int64_t rank_,
              int64_t world_, double timeout_s_)
      : embedding(std::move(embedding_)), norms(std::move(norms_)), ws(std::move(ws_)), rank(rank_), world(world_),
        timeout_s(timeout_s_) {
    TORCH_CHECK(dims.size() == 8, "DecodeModel: dims = [layers, hidden, heads, kv_heads, head_dim, window, "
                "dequant_above, vocab part]");
    L = dims[0], hidden = dims[1], heads = dims[2], kv_heads = dims[3], head_dim = dims[4], window = dims[5];
    dequant_above = dims[6];
    const int64_t vocab_part = dims[7];
    eps = static_cast<float>(eps_);
    const size_t n_lin = 4 * L + 1;
    TORCH_CHECK(norms.size() == static_cast<size_t>(4 * L + 1), "DecodeModel: ", 4 * L + 1, " norms expected, got ",
                norms.size());
    TORCH_CHECK(weights.size() == n_lin && scales.size() == n_lin && biases.size() == n_lin && kinds.size() == n_lin &&
                    groups.size() == n_lin,
                "DecodeModel: ", n_lin, " linears expected (weights, scales, biases, kinds, groups)");
    TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == at::kFloat && embedding.is_contiguous() &&
                    embedding.size(1) * world >= hidden,
                "DecodeModel: embedding must be contiguous float32 [V, hidden / ranks]");
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "DecodeModel: heads (", heads, ") must be a multiple of ",
                "kv_heads (", kv_heads, ") and head_dim (", head_dim, ") even");
    TORCH_CHECK(world == 1 || (ws.scalar_type() == at::kByte && ws.numel() > 0),
                "DecodeModel: ", world, " ranks need the shared-memory workspace");
    const int64_t qkv_n = (heads + 2 * kv_heads) * head_dim;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t f2 = weights[4 * l + 2].size(0) * NB;  // gate|up: 2 F (padded to blocks; checked below)
      ffn = weights[4 * l + 3].size(1) * (kinds[4 * l + 3] == 4 && pmx_cpu::int4_layout(groups[4 * l + 3]) == 1 ? 2 : 1);
      TORCH_CHECK(f2 >= 2 * ffn, "DecodeModel: layer ", l, ": gate_up holds fewer than 2 x ", ffn, " channels");
      const int64_t ns[4] = {qkv_n, hidden, 2 * ffn, hidden}, ks[4] = {hidden, heads * head_dim, hidden, ffn};
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t j = 4 * l + i;
        lins.push_back(make_linear(weights[j], scales[j], biases[j], kinds[j], groups[j], ns[i], j));
        TORCH_CHECK(lins.back().p.k == ks[i], "DecodeModel: linear ", j, " takes ", lins.back().p.k, " inputs, expected ",
                    ks[i]);
      }
      for (int64_t i = 0; i < 4; ++i) {
        const at::Tensor& w = norms[4 * l + i];
        const int64_t want = i < 2 ? hidden : (w.numel() ? head_dim : 0);
        TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == want, "DecodeModel: layer ", l,
                    " norm ", i, " must be float32 [", want, "]");
      }
    }
    const at::Tensor& out = weights[4 * L];
    lins.push_back(make_linear(out, scales[4 * L], biases[4 * L], kinds[4 * L], groups[4 * L], vocab_part, 4 * L));
    TORCH_CHECK(lins.back().p.k == hidden && norms[4 * L].numel() == hidden, "DecodeModel: output projection and final "
                "norm must take ", hidden, " inputs");
  }

  // logits [B, ranks x vocab part] of the step where each of the B sequences decodes tokens[b] at position
  // kvlens[b] - 1: k and v written at cache row slots[b] of every layer, the history read where cachestarts says
  // (offsets [B], or page starts [B, MaxP] of page_size rows), cos / sin [B, head_dim / 2] of each position.
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& cache, const c10::optional<at::Tensor>& cache_scale,
                  int64_t layout, const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& cachestarts, const at::Tensor& kvlens, int64_t page_size) {
    const int64_t B = tokens.numel(), D = hidden, H = heads, KV = kv_heads, hd = head_dim, F = ffn;
    auto int64_vec = [&](const at::Tensor& t, const char* what) {
      TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.numel() == B && t.is_contiguous(), "decode step: ",
                  what, " must be contiguous int64 [", B, "]");
      return t.data_ptr<int64_t>();
    };
    const int64_t* tok = int64_vec(tokens, "tokens");
    const int64_t* slot = int64_vec(slots, "slots");
    const int64_t* lens = int64_vec(kvlens, "kvlens");
    for (const at::Tensor* t : {&cos, &sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == B &&
                      t->size(1) == hd / 2,
                  "decode step: cos and sin must be contiguous float32 [", B, ", ", hd / 2, "]");
    const auto [cv, sv] = pmx_cpu::cache_views(cache, cache_scale, layout, "decode step");
    const pmx_cpu::CacheView* scales = cache.scalar_type() == at::kChar ? &sv : nullptr;
    TORCH_CHECK(cv.L == L && cv.KV == KV && cv.last == hd, "decode step: cache of shape ", cache.sizes(), " is not ",
                "one of ", L, " layers, ", KV, " KV heads of ", hd, " in layout ", layout);
    const pmx_cpu::HistoryRows hist = pmx_cpu::history_rows(cachestarts, page_size, lens, B, window, cv.T);
    const int64_t V = embedding.size(0), Dn = embedding.size(1);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(tok[b] >= 0 && tok[b] < V, "decode step: token id ", tok[b], " is outside the vocabulary of ", V);
      TORCH_CHECK(slot[b] >= 0 && slot[b] < cv.T, "decode step: cache row ", slot[b], " is outside the cache's ", cv.T,
                  " rows");
    }
    const pmx_cpu::GilRelease unlocked;  // the step touches no Python object: other threads run meanwhile
    std::lock_guard<std::mutex> lock(busy);  // (after the GIL is released: a second caller waits without holding it)
    const Linear& out_lin = lins[4 * L];
    const int64_t NQKV = (H + 2 * KV) * hd, Vn = out_lin.p.n;
    // scratch: x, resid, h [B, D]; qkv [B, NQKV]; attn [B, H hd]; gu [B, 2F]; act [B, F]; gathered [world B max(Dn, Vn)],
    // local [B max(Dn, Vn)] (this rank's embedding columns or vocabulary part before a gather)
    const int64_t sizes[] = {B * D, B * D, B * D, B * NQKV, B * H * hd, B * 2 * F, B * F,
                             world * B * std::max(Dn, Vn), B * std::max(Dn, Vn)};
    int64_t total = 0;
    for (int64_t s : sizes) total += (s + 15) / 16 * 16;
    if (static_cast<int64_t>(scratch.size()) < total) scratch.resize(total);
    float* bufs[9];
    float* p = scratch.data();
    for (int i = 0; i < 9; ++i) bufs[i] = p, p += (sizes[i] + 15) / 16 * 16;
    float *x = bufs[0], *resid = bufs[1], *h = bufs[2], *qkv = bufs[3], *attn = bufs[4], *gu = bufs[5], *act = bufs[6];
    float *gathered = bufs[7], *local = bufs[8];

    // the embedding: this rank's columns, all-gathered (ParallelEmbedding), into the residual stream
    const float* emb = embedding.data_ptr<float>();
    if (world == 1) {
      for (int64_t b = 0; b < B; ++b) std::memcpy(resid + b * D, emb + tok[b] * Dn, D * sizeof(float));
    } else {
      for (int64_t b = 0; b < B; ++b) std::memcpy(local + b * Dn, emb + tok[b] * Dn, Dn * sizeof(float));
      pmx_cpu::shm_all_gather_bytes(ws, rank, world, local, B * Dn * sizeof(float), gathered, timeout_s);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t r = 0; r < world; ++r) {
          const int64_t n = std::min(Dn, D - r * Dn);
          if (n > 0) std::memcpy(resid + b * D + r * Dn, gathered + (r * B + b) * Dn, n * sizeof(float));
        }
    }
    auto reduce = [&](float* t, int64_t n) {
      if (world > 1) pmx_cpu::shm_all_reduce_f32(ws, rank, world, t, n, timeout_s);
    };
    const float* cs = cos.data_ptr<float>();
    const float* sn = sin.data_ptr<float>();
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (int64_t l = 0; l < L; ++l) {
      const Linear &wqkv = lins[4 * l], &wo = lins[4 * l + 1], &wgu = lins[4 * l + 2], &w2 = lins[4 * l + 3];
      const float* qn = norms[4 * l + 2].numel() ? norms[4 * l + 2].data_ptr<float>() : nullptr;
      const float* kn = norms[4 * l + 3].numel() ? norms[4 * l + 3].data_ptr<float>() : nullptr;
      if (l == 0)
        pmx_cpu::skip_rms_norm_into(resid, nullptr, norms[0].data_ptr<float>(), B, D, eps, nullptr, h);
      else
        pmx_cpu::skip_rms_norm_into(x, resid, norms[4 * l].data_ptr<float>(), B, D, eps, resid, h);
      pmx_cpu::linear_into(wqkv.p, h, B, qkv, dequant_above);
      add_bias(qkv, wqkv.b, B, NQKV);
      for (int64_t b = 0; b < B && qn != nullptr; ++b) {
        float *q = qkv + b * NQKV, *k = q + H * hd;
        pmx_cpu::skip_rms_norm_into(q, nullptr, qn, H, hd, eps, nullptr, q);
        pmx_cpu::skip_rms_norm_into(k, nullptr, kn, KV, hd, eps, nullptr, k);
      }
      pmx_cpu::rotary(qkv, B, NQKV, hd, H + KV, hd, cs, sn);  // q and k are adjacent: one pass
      pmx_cpu::kv_store(qkv + H * hd, qkv + (H + KV) * hd, B, NQKV, hd, cv, scales, l, slot);
      pmx_cpu::decode_attention_into(qkv, NQKV, B, H, pmx_cpu::kv_rows(cv, scales, l, 0),
                                     pmx_cpu::kv_rows(cv, scales, l, 1), hist, lens, window, scale, attn);
      pmx_cpu::linear_into(wo.p, attn, B, x, dequant_above);
      reduce(x, B * D);
      add_bias(x, wo.b, B, D);
      pmx_cpu::skip_rms_norm_into(x, resid, norms[4 * l + 1].data_ptr<float>(), B, D, eps, resid, h);
      pmx_cpu::linear_into(wgu.p, h, B, gu, dequant_above);
      add_bias(gu, wgu.b, B, 2 * F);
      pmx_cpu::swiglu_into(gu, 2 * F, gu + F, 2 * F, B, F, act);
      pmx_cpu::linear_into(w2.p, act, B, x, dequant_above);
      reduce(x, B * D);
      add_bias(x, w2.b, B, D);
    }
    pmx_cpu::skip_rms_norm_into(x, resid, norms[4 * L].data_ptr<float>(), B, D, eps, resid, h);
    at::Tensor logits = at::empty({B, world * Vn}, embedding.options());
    float* lp = logits.data_ptr<float>();
    if (world == 1) {
      pmx_cpu::linear_into(out_lin.p, h, B, lp, dequant_above);
    } else {
      pmx_cpu::linear_into(out_lin.p, h, B, local, dequant_above);
      pmx_cpu::shm_all_gather_bytes(ws, rank, world, local, B * Vn * sizeof(float), gathered, timeout_s);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t r = 0; r < world; ++r)
          std::memcpy(lp + b * world * Vn + r * Vn, gathered + (r * B + b) * Vn, Vn * sizeof(float));
    }
    return logits;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pmx_cpu, m) {
  m.class_<DecodeModel>("DecodeModel")
      .def(torch::init<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, double,
                       at::Tensor, int64_t, int64_t, double>())
      .def("step", &DecodeModel::step);
}
