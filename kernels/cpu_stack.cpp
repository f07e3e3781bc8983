// Layer stacks: a decoder's layers composed in C++ from cpu_ops.cpp's ops, so that a step makes
// one call from Python. What a layer is made of comes from a description (StackSpec: head
// shapes, RMSNorm's epsilon, per-head q/k norms), its weights from named structs (StackLayer,
// StackProjection, StackPart), both built by engine/models/layer_stack.py from the model's
// LayerSpec; no architecture is spelled out here. EagleLayer is EAGLE's draft layer, from the
// same structs (built by engine/spec_decode/heads.py).
//
// A stack's arithmetic is the Python layers' (engine/models/llama.py, gemma.py): RMSNorm, RoPE,
// SwiGLU or GeGLU and the residuals in float32, the same products (the block kernels, or oneDNN's packed float32
// product at models/cpu_linear.py's row buckets), each row attending over its own causal prefix.
#include <pybind11/functional.h>
#include <torch/extension.h>

#include <functional>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

// cpu_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor d, torch::Tensor w, double eps);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots);
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, std::optional<torch::Tensor> tail_start,
                           std::optional<torch::Tensor> tail_slots, int64_t window, double softcap);
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias);
torch::Tensor dense_causal_attention(const torch::Tensor& qk, int64_t heads, const std::vector<torch::Tensor>& key_caches,
                                     const std::vector<torch::Tensor>& value_caches, const std::vector<int64_t>& before,
                                     const std::vector<int64_t>& rows, double scale);
// cpu_blockq.cpp, cpu_kquant.cpp
torch::Tensor blockq_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor m, int64_t bits, int64_t n);
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t n);
bool kquant_known(int64_t fmt);

namespace {

void check_f32(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() &&
                  t.dim() == dim,
              "cpu_stack: ", name, " must be a contiguous float32 CPU tensor with ", dim, " dims");
}

// One product: kind 4 or 8 (cpu_blockq.cpp's blocks of that many bits; d and m their scales and
// offsets), 100 + a GGML type id (cpu_kquant.cpp's K-quant, 5-bit and IQ4 formats; d and m unused),
// or 32 (float32 packed by oneDNN, with the projection's bias inside).
struct Part {
  torch::Tensor packed, d, m;
  int64_t kind = 0, n = 0;
};

bool known_kind(int64_t kind) {
  return kind == 4 || kind == 8 || kind == 32 || (kind >= 100 && kquant_known(kind - 100));
}

// A projection: its parts' products side by side (a fused q/k/v or gate/up whose parts the
// file stores in different types), plus a float32 bias (Qwen2's q/k/v) or none (an empty
// tensor). The bias is added as the Python layers add it: after the block products, inside
// oneDNN's (a float32 projection is one part).
struct Projection {
  std::vector<Part> parts;
  torch::Tensor bias;
  Projection() = default;
  Projection(torch::Tensor packed, torch::Tensor d, torch::Tensor m, torch::Tensor b, int64_t kind, int64_t n)
      : parts{Part{packed, d, m, kind, n}}, bias(b) {}
  static torch::Tensor one(const Part& p, const torch::Tensor& x) {
    if (p.kind == 4 || p.kind == 8) return blockq_linear(x, p.packed, p.d, p.m, p.kind, p.n);
    return kquant_linear(x, p.packed, p.kind - 100, p.n);
  }
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (parts.size() == 1 && parts[0].kind == 32) return onednn_linear(x, parts[0].packed, bias);
    torch::Tensor out;
    if (parts.size() == 1) {
      out = one(parts[0], x);
    } else {
      std::vector<torch::Tensor> outs;
      for (const Part& p : parts) outs.push_back(one(p, x));
      out = torch::cat(outs, 1);
    }
    return bias.numel() ? out.add_(bias) : out;
  }
};

// What every layer of a stack is: attention heads (query, key/value; of head_dim each), the
// attention's scale, RMSNorm's epsilon, and whether queries and keys pass a per-head RMSNorm
// before RoPE (Qwen3), or with qk_norm_full too one RMSNorm over the whole q and one over the whole
// k projection, still before RoPE (OLMoE: a head's norm then depends on every head). The MLP is
// SwiGLU, or GeGLU (gelu_tanh(gate) * up) with geglu; the norms RMSNorm (a weight is the
// multiplier: Gemma's 1 + w comes added). With sandwich (Gemma), the attention's and the MLP's
// outputs pass a norm of their own before each residual add, and the MLP's input is normed by
// pre_mlp_norm instead of post_norm (which norms the attention's output).
// softcap > 0: attention scores pass softcap * tanh(score / softcap) (Gemma 2; paged_decode).
struct StackSpec {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 0, scale = 0;
  bool qk_norm = false, geglu = false, sandwich = false;
  double softcap = 0;
  bool qk_norm_full = false;
};

// One layer's weights by name. q_norm and k_norm are [head_dim] with StackSpec::qk_norm ([q_size]
// and [kv_size] with qk_norm_full too), empty otherwise; pre_mlp_norm and post_mlp_norm [hidden]
// with StackSpec::sandwich, empty otherwise.
// window: the layer's sliding window (its LayerSpec's), 0 for none. local_rope: the layer rotates
// with forward's local tables (Gemma 3's sliding layers), not the global ones.
// A mixture-of-experts MLP (engine/models/moe.py, whose arithmetic this repeats op for op): a
// float32 router [E, hidden]; each token's top_k experts by softmax probability, renormalised
// over the k with norm_topk; each expert a SwiGLU of its own gate_up and down projections, run
// once on all the tokens that chose it, its outputs scaled by their weights and added into the
// tokens' rows in ascending expert order. With shared_gate ([1, hidden], Qwen2-MoE): a shared
// SwiGLU expert on every token, scaled by sigmoid(shared_gate . x).
struct StackMoE {
  torch::Tensor router;
  std::vector<Projection> gate_up, down;
  int64_t top_k = 0;
  bool norm_topk = true;
  Projection shared_gate_up, shared_down;
  torch::Tensor shared_gate;
};

struct StackLayer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm, pre_mlp_norm, post_mlp_norm;
  Projection qkv, o, gate_up, down;     // gate_up and down: no parts when moe is set
  int64_t window = 0;
  bool local_rope = false;
  std::optional<StackMoE> moe;
};

// Tensor parallelism's gather (DecoderStack::set_gather): the ranks' [rows, width] pieces side by
// side; empty on one rank. Its kinds: what is gathered (each rank's width differs per kind).
using Gather = std::function<torch::Tensor(torch::Tensor, int64_t)>;
constexpr int64_t kAttention = 0, kActivation = 1, kHidden = 2, kKeys = 3, kExpertActivation = 4,
                  kSharedActivation = 5, kGatherKinds = 6;

// With `gather` (tensor parallelism's exact split) each expert holds a slice of its features and
// a range of down's output rows: the chosen experts' activations are gathered in one call (their
// rows stacked in expert order) and each down runs over its expert's whole activation, so every
// number is the unsplit model's; the output is this rank's rows.
torch::Tensor moe_mlp(const StackMoE& m, const torch::Tensor& x, const Gather& gather) {
  const int64_t experts = m.router.size(0);
  auto probs = torch::softmax(torch::linear(x, m.router), -1);                    // [T, E]
  auto [weights, chosen] = torch::topk(probs, m.top_k, -1);                       // [T, k] each
  if (m.norm_topk) weights = weights / weights.sum(-1, true);
  auto flat = chosen.flatten();                                                   // [T * k]
  auto order = torch::argsort(flat, /*stable=*/true, 0, false);                   // pairs grouped by expert
  auto tokens = torch::div(order, m.top_k, "floor");
  auto scales = weights.flatten().index_select(0, order);
  auto counts = torch::bincount(flat, {}, experts).contiguous();
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t width = 0;                                                              // down's output rows
  for (const Part& p : m.down[0].parts) width += p.n;
  auto out = torch::zeros({x.size(0), width}, x.options());
  std::vector<torch::Tensor> acts;                                                // [n_e, I] per chosen expert
  for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e)
    if (count[e]) acts.push_back(silu_mul(m.gate_up[e](x.index_select(0, tokens.narrow(0, start, count[e])))));
  if (gather) {
    auto all = gather(torch::cat(acts, 0).contiguous(), kExpertActivation);       // [T * k, I whole]
    for (size_t i = 0, row = 0; i < acts.size(); row += acts[i].size(0), ++i)
      acts[i] = all.narrow(0, row, acts[i].size(0));
  }
  for (int64_t e = 0, start = 0, i = 0; e < experts; start += count[e], ++e) {
    const int64_t n = count[e];
    if (!n) continue;
    auto y = m.down[e](acts[i++]).mul_(scales.narrow(0, start, n).unsqueeze(1));
    out.index_add_(0, tokens.narrow(0, start, n), y);
  }
  if (m.shared_gate.numel()) {
    auto act = silu_mul(m.shared_gate_up(x));
    if (gather) act = gather(act.contiguous(), kSharedActivation);
    out = out + torch::sigmoid(torch::linear(x, m.shared_gate)) * m.shared_down(act);
  }
  return out;
}

// GeGLU over a fused [T, 2I] gate/up: gelu_tanh(gate) * up, as the Python layers compute it.
torch::Tensor gelu_mul(const torch::Tensor& gate_up) {
  const int64_t inter = gate_up.size(1) / 2;
  return torch::gelu(gate_up.narrow(1, 0, inter), "tanh").mul_(gate_up.narrow(1, inter, inter));
}

// A projection as the stacks accept it: at least one part, each of a known kind (float32 only
// alone), and a bias that is empty or a contiguous float32 [out]. `who` names the caller.
void check_projection(const Projection& p, const std::string& who) {
  TORCH_CHECK(!p.parts.empty(), who, ": each projection needs a part");
  int64_t total = 0;
  for (const Part& part : p.parts) {
    TORCH_CHECK(known_kind(part.kind) && (part.kind != 32 || p.parts.size() == 1), who,
                ": kind must be 4 or 8 (block bits), 100 + a K-quant type id or 32 (float32 packed by oneDNN, "
                "alone), got ", part.kind);
    total += part.n;
  }
  TORCH_CHECK(p.bias.numel() == 0 || (p.bias.scalar_type() == torch::kFloat32 && p.bias.is_contiguous() &&
                                      p.bias.numel() == total),
              who, ": a bias must be a contiguous float32 [out] or empty");
}

}  // namespace

// A decoder's layers over a step of any rows (prefill, decode, verification, mixed): embeddings
// in, the final norm's output out. Every row attends over its own prefix through its block table
// (paged_decode), so a token's bits depend on its sequence alone.
class DecoderStack {
 public:
  DecoderStack(StackSpec spec, std::vector<StackLayer> layers, torch::Tensor final_norm)
      : spec_(spec), layers_(std::move(layers)), final_norm_(final_norm) {
    TORCH_CHECK(spec_.heads >= 1 && spec_.kv_heads >= 1 && spec_.heads % spec_.kv_heads == 0 && spec_.head_dim >= 2,
                "DecoderStack: heads must be a multiple of kv_heads, both positive, head_dim at least 2");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& L = layers_[i];
      const std::string who = "DecoderStack: layer " + std::to_string(i);
      check_projection(L.qkv, who);
      check_projection(L.o, who);
      if (L.moe) {
        check_moe(*L.moe, who);
      } else {
        check_projection(L.gate_up, who);
        check_projection(L.down, who);
      }
      if (spec_.qk_norm) {
        check_f32(L.q_norm, "q_norm", 1);
        check_f32(L.k_norm, "k_norm", 1);
        if (spec_.qk_norm_full) {
          const int64_t q_size = spec_.heads * spec_.head_dim, kv_size = spec_.kv_heads * spec_.head_dim;
          TORCH_CHECK(L.q_norm.size(0) == q_size && L.k_norm.size(0) == kv_size, "DecoderStack: layer ", i,
                      ": q_norm and k_norm over whole projections must have q_size (", q_size, ") and kv_size (",
                      kv_size, ") weights");
        } else {
          TORCH_CHECK(L.q_norm.size(0) == spec_.head_dim && L.k_norm.size(0) == spec_.head_dim, "DecoderStack: layer ",
                      i, ": q_norm and k_norm must have head_dim (", spec_.head_dim, ") weights");
        }
      }
      if (spec_.sandwich) {
        check_f32(L.pre_mlp_norm, "pre_mlp_norm", 1);
        check_f32(L.post_mlp_norm, "post_mlp_norm", 1);
      }
    }
  }

  torch::Tensor forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                        std::vector<torch::Tensor> key_caches, std::vector<torch::Tensor> value_caches,
                        torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seq_lens,
                        std::optional<torch::Tensor> tail_start, std::optional<torch::Tensor> tail_slots,
                        std::optional<torch::Tensor> local_cos, std::optional<torch::Tensor> local_sin) {
    TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(),
                "DecoderStack: one cache pair per layer");
    TORCH_CHECK(local_cos.has_value() == local_sin.has_value(), "DecoderStack: local_cos and local_sin go together");
    const int64_t heads = spec_.heads, kv_heads = spec_.kv_heads, dim = spec_.head_dim;
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim, rows = h.size(0);
    auto bt = block_tables.to(torch::kInt32).contiguous();
    auto sl = seq_lens.to(torch::kInt32).contiguous();
    auto cs = cos.contiguous(), sn = sin.contiguous();
    auto lcs = local_cos ? local_cos->contiguous() : cs, lsn = local_sin ? local_sin->contiguous() : sn;
    torch::Tensor normed = rms_norm(h, layers_[0].input_norm, spec_.eps);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& L = layers_[i];
      auto qkv = L.qkv(normed);                                                     // [T, q + 2 kv]
      TORCH_CHECK(!L.local_rope || local_cos, "DecoderStack: layer ", i, " rotates with the local tables: pass them");
      auto qk = rotary(queries_and_keys(L, qkv, rows), L.local_rope ? lcs : cs, L.local_rope ? lsn : sn);  // [T, Hq + Hkv, D]
      auto k = qk.narrow(1, heads, kv_heads);
      auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, dim});
      store_kv(k, v, key_caches[i], value_caches[i], slots);
      auto attn = paged_decode(qk.narrow(1, 0, heads), key_caches[i], value_caches[i], bt, sl, spec_.scale,
                               tail_start, tail_slots, L.window, spec_.softcap);
      auto out = gathered(L.o(gathered(attn.view({rows, q_size}), kAttention)), kHidden);   // [T, hidden]
      auto hn = spec_.sandwich ? add_rms_norm(h, rms_norm(out, L.post_norm, spec_.eps), L.pre_mlp_norm, spec_.eps)
                               : add_rms_norm(h, out, L.post_norm, spec_.eps);
      torch::Tensor mlp;
      if (L.moe) {
        mlp = gathered(moe_mlp(*L.moe, hn[1], gather_), kHidden);
      } else {
        mlp = gathered(L.down(activation(L.gate_up(hn[1]))), kHidden);
      }
      if (spec_.sandwich) mlp = rms_norm(mlp, L.post_mlp_norm, spec_.eps);
      const torch::Tensor& next_norm = i + 1 < layers_.size() ? layers_[i + 1].input_norm : final_norm_;
      auto hn2 = add_rms_norm(hn[0], mlp, next_norm, spec_.eps);
      h = hn2[0];
      normed = hn2[1];
    }
    return normed;
  }

  // Tensor parallelism (engine/parallel/tensor.py): this stack holds one rank's heads, MLP
  // (or experts') features and output rows of o and down; `gather(x, what)` returns the ranks' x
  // side by side along dim 1 (the whole model's attention output, activation or hidden state;
  // the kinds above), so every projection sums over its whole input in the unsharded order.
  // `offsets[what]`: where this rank's piece starts in a gathered kind (the whole-projection q/k
  // norms read their columns back). Called with the GIL held.
  void set_gather(Gather gather, std::vector<int64_t> offsets) {
    TORCH_CHECK((int64_t)offsets.size() == kGatherKinds, "DecoderStack: set_gather needs ", kGatherKinds, " offsets");
    gather_ = std::move(gather);
    offsets_ = std::move(offsets);
  }

 private:

  static void check_moe(const StackMoE& m, const std::string& who) {
    check_f32(m.router, "router", 2);
    const int64_t experts = m.router.size(0);
    TORCH_CHECK(experts >= 1 && (int64_t)m.gate_up.size() == experts && (int64_t)m.down.size() == experts &&
                    m.top_k >= 1 && m.top_k <= experts,
                who, ": a router of E experts needs E gate_up and E down projections and 1 <= top_k <= E");
    for (int64_t e = 0; e < experts; ++e) {
      check_projection(m.gate_up[e], who + " expert " + std::to_string(e));
      check_projection(m.down[e], who + " expert " + std::to_string(e));
    }
    if (m.shared_gate.numel()) {
      check_f32(m.shared_gate, "shared_gate", 2);
      TORCH_CHECK(m.shared_gate.size(0) == 1 && m.shared_gate.size(1) == m.router.size(1),
                  who, ": shared_gate must be [1, hidden]");
      check_projection(m.shared_gate_up, who + " shared expert");
      check_projection(m.shared_down, who + " shared expert");
    }
  }

  torch::Tensor gathered(torch::Tensor x, int64_t what) const {
    if (!gather_) return x;
    torch::Tensor out = gather_(x.contiguous(), what);
    TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.scalar_type() == torch::kFloat32 && out.is_contiguous(),
                "DecoderStack: gather must return a contiguous float32 [rows, width] tensor");
    return out;
  }

  // The query and key heads of a fused projection's output [T, q + 2 kv], as [T, Hq + Hkv, D]:
  // a view, or with q/k norms (per head, or over each whole projection) the normed heads side by side.
  torch::Tensor queries_and_keys(const StackLayer& L, const torch::Tensor& qkv, int64_t rows) const {
    const int64_t heads = spec_.heads, kv_heads = spec_.kv_heads, dim = spec_.head_dim;
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
    if (!spec_.qk_norm) return qkv.narrow(1, 0, q_size + kv_size).view({rows, heads + kv_heads, dim});
    if (spec_.qk_norm_full) {
      auto q = whole_norm(qkv.narrow(1, 0, q_size).contiguous(), L.q_norm, kAttention);      // [T, q]
      auto k = whole_norm(qkv.narrow(1, q_size, kv_size).contiguous(), L.k_norm, kKeys);    // [T, kv]
      return torch::cat({q, k}, 1).view({rows, heads + kv_heads, dim});
    }
    // contiguous(): with one head (a tensor-parallel rank's single key head) reshape is a strided view.
    auto q = rms_norm(qkv.narrow(1, 0, q_size).reshape({rows * heads, dim}).contiguous(), L.q_norm, spec_.eps);
    auto k = rms_norm(qkv.narrow(1, q_size, kv_size).reshape({rows * kv_heads, dim}).contiguous(), L.k_norm, spec_.eps);
    return torch::cat({q.view({rows, heads, dim}), k.view({rows, kv_heads, dim})}, 1);
  }

  // The MLP's activation [T, I] from its gate/up [T, 2 I], whole (gathered) under tensor
  // parallelism. GeGLU gathers gate and up and runs on the whole of them: ATen's vectorised gelu
  // takes another path for a row's tail than for its body, so a narrower piece would round some
  // features differently than the unsplit model (SiLU is cpu_ops' own loop, the same at any width).
  torch::Tensor activation(const torch::Tensor& gate_up) const {
    if (!spec_.geglu) return gathered(silu_mul(gate_up), kActivation);
    if (!gather_) return gelu_mul(gate_up);
    const int64_t inter = gate_up.size(1) / 2;
    return gelu_mul(torch::cat({gathered(gate_up.narrow(1, 0, inter), kActivation),
                                gathered(gate_up.narrow(1, inter, inter), kActivation)}, 1));
  }

  // An RMSNorm over a whole projection (OLMoE) of which this rank holds x's columns and w's
  // weights: its statistics over the gathered whole row, then this rank's columns times w, which
  // is rms_norm's x * inv * w for them bit for bit (times a weight of 1 changes nothing).
  torch::Tensor whole_norm(const torch::Tensor& x, const torch::Tensor& w, int64_t what) const {
    if (!gather_) return rms_norm(x, w, spec_.eps);
    auto whole = gathered(x, what);
    auto unit = torch::ones({whole.size(1)}, whole.options());
    return rms_norm(whole, unit, spec_.eps).narrow(1, offsets_[what], x.size(1)).mul(w);
  }

  StackSpec spec_;
  std::vector<StackLayer> layers_;
  torch::Tensor final_norm_;
  Gather gather_;
  std::vector<int64_t> offsets_;
};

// EAGLE's draft layer (spec_decode/heads.py's EagleHead) for serving: the projection fc of the
// pairs (embedding, hidden state), then a Llama decoder layer without its final norm (and with an
// input norm only where the checkpoint has one). Each sequence's keys and values live in its own
// dense cache [capacity, Hkv, D] (EagleCache): its rows are written after its `before` entries and
// attend over them and causally over each other, through paged_decode with the cache as one
// block. Its weights come by name: the input norm (empty: none), the post-attention norm and
// the five projections (fc, qkv, o, gate_up, down; any kind the stacks take); its shapes from a
// StackSpec (no q/k norms: EAGLE's layers have none).
class EagleLayer {
 public:
  EagleLayer(StackSpec spec, torch::Tensor input_norm, torch::Tensor post_norm, Projection fc, Projection qkv,
             Projection o, Projection gate_up, Projection down)
      : input_norm_(input_norm), post_norm_(post_norm), fc_(std::move(fc)), qkv_(std::move(qkv)), o_(std::move(o)),
        gate_up_(std::move(gate_up)), down_(std::move(down)), heads_(spec.heads), kv_heads_(spec.kv_heads),
        dim_(spec.head_dim), eps_(spec.eps), scale_(spec.scale) {
    TORCH_CHECK(heads_ >= 1 && kv_heads_ >= 1 && heads_ % kv_heads_ == 0 && dim_ >= 2 && !spec.qk_norm,
                "EagleLayer: heads must be a multiple of kv_heads, both positive, head_dim at least 2, no q/k norms");
    for (const Projection* p : {&fc_, &qkv_, &o_, &gate_up_, &down_}) check_projection(*p, "EagleLayer");
    check_f32(post_norm_, "post_norm", 1);
    if (input_norm_.numel()) check_f32(input_norm_, "input_norm", 1);
  }

  // The pairs' embeddings and hidden states [T, H] each (each sequence's rows together, in
  // order), their positions [T] and RoPE's cos/sin tables [positions, D/2] (RotaryEmbedding's),
  // one cache pair, entry count and row count per sequence -> predicted hidden states [T, H].
  torch::Tensor forward(torch::Tensor embeds, torch::Tensor hidden, torch::Tensor positions, torch::Tensor cos_table,
                        torch::Tensor sin_table, std::vector<torch::Tensor> key_caches,
                        std::vector<torch::Tensor> value_caches, std::vector<int64_t> before, std::vector<int64_t> rows) {
    check_f32(embeds, "embeds", 2);
    check_f32(hidden, "hidden", 2);
    TORCH_CHECK(embeds.sizes() == hidden.sizes() && positions.numel() == embeds.size(0) &&
                    positions.scalar_type() == torch::kInt64,
                "EagleLayer: embeds, hidden [T, H] and int64 positions [T] must agree");
    auto cos = cos_table.index_select(0, positions), sin = sin_table.index_select(0, positions);
    torch::Tensor pairs = torch::cat({embeds, hidden}, 1);
    const size_t n = key_caches.size();
    TORCH_CHECK(value_caches.size() == n && before.size() == n && rows.size() == n,
                "EagleLayer: one value cache, entry count and row count per key cache");
    const int64_t t = pairs.size(0), q_size = heads_ * dim_, kv_size = kv_heads_ * dim_;
    int64_t total = 0;
    for (size_t i = 0; i < n; ++i) {
      const auto& kc = key_caches[i];
      TORCH_CHECK(kc.dim() == 3 && kc.size(1) == kv_heads_ && kc.size(2) == dim_ && kc.scalar_type() == torch::kFloat32 &&
                      kc.is_contiguous() && value_caches[i].sizes() == kc.sizes() && value_caches[i].is_contiguous() &&
                      value_caches[i].scalar_type() == torch::kFloat32,
                  "EagleLayer: caches must be contiguous float32 [capacity, Hkv, D]");
      TORCH_CHECK(rows[i] >= 1 && before[i] >= 0 && before[i] + rows[i] <= kc.size(0),
                  "EagleLayer: sequence ", i, "'s rows do not fit its cache");
      total += rows[i];
    }
    TORCH_CHECK(total == t, "EagleLayer: the row counts add up to ", total, ", pairs has ", t);
    torch::Tensor x = fc_(pairs);
    torch::Tensor a = input_norm_.numel() ? rms_norm(x, input_norm_, eps_) : x;
    torch::Tensor qkv = qkv_(a);
    torch::Tensor qk = rotary(qkv.narrow(1, 0, q_size + kv_size).view({t, heads_ + kv_heads_, dim_}), cos, sin);
    // Each sequence's new keys and values after its entries, then attention: a work item per
    // (sequence, KV head), its rows in order, each row over the entries up to its own.
    std::vector<int64_t> first(n + 1, 0);
    for (size_t i = 0; i < n; ++i) first[i + 1] = first[i] + rows[i];
    const float *qkp = qk.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
    const int64_t qk_row = (heads_ + kv_heads_) * dim_, qkv_row = q_size + 2 * kv_size;
    for (size_t i = 0; i < n; ++i) {
      float *kc = key_caches[i].data_ptr<float>(), *vc = value_caches[i].data_ptr<float>();
      for (int64_t r = 0; r < rows[i]; ++r) {
        std::memcpy(kc + (before[i] + r) * kv_size, qkp + (first[i] + r) * qk_row + q_size, kv_size * sizeof(float));
        std::memcpy(vc + (before[i] + r) * kv_size, qkvp + (first[i] + r) * qkv_row + q_size + kv_size,
                    kv_size * sizeof(float));
      }
    }
    torch::Tensor attn = dense_causal_attention(qk, heads_, key_caches, value_caches, before, rows, scale_);
    auto hn = add_rms_norm(x, o_(attn.view({t, q_size})), post_norm_, eps_);
    return hn[0].add_(down_(silu_mul(gate_up_(hn[1]))));
  }

 private:
  torch::Tensor input_norm_, post_norm_;
  Projection fc_, qkv_, o_, gate_up_, down_;
  int64_t heads_, kv_heads_, dim_;
  double eps_, scale_;
};

void bind_layer_stacks(pybind11::module_& mod) {
  namespace py = pybind11;
  py::class_<Part>(mod, "StackPart", py::module_local())
      .def(py::init([](torch::Tensor packed, torch::Tensor d, torch::Tensor m, int64_t kind, int64_t n) {
             return Part{packed, d, m, kind, n};
           }),
           py::arg("packed"), py::arg("d"), py::arg("m"), py::arg("kind"), py::arg("n"));
  py::class_<Projection>(mod, "StackProjection", py::module_local())
      .def(py::init([](std::vector<Part> parts, torch::Tensor bias) {
             Projection p;
             p.parts = std::move(parts);
             p.bias = bias;
             return p;
           }),
           py::arg("parts"), py::arg("bias"));
  py::class_<StackSpec>(mod, "StackSpec", py::module_local())
      .def(py::init([](int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, bool qk_norm,
                       bool geglu, bool sandwich, double softcap, bool qk_norm_full) {
             TORCH_CHECK(softcap >= 0, "StackSpec: softcap must be >= 0 (0: none), got ", softcap);
             TORCH_CHECK(qk_norm || !qk_norm_full, "StackSpec: qk_norm_full needs qk_norm");
             return StackSpec{heads, kv_heads, head_dim, eps, scale, qk_norm, geglu, sandwich, softcap, qk_norm_full};
           }),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("qk_norm"), py::arg("geglu") = false, py::arg("sandwich") = false, py::arg("softcap") = 0.0,
           py::arg("qk_norm_full") = false);
  py::class_<StackMoE>(mod, "StackMoE", py::module_local())
      .def(py::init([](torch::Tensor router, std::vector<Projection> gate_up, std::vector<Projection> down,
                       int64_t top_k, bool norm_topk, std::optional<Projection> shared_gate_up,
                       std::optional<Projection> shared_down, torch::Tensor shared_gate) {
             TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value() &&
                             shared_gate_up.has_value() == (shared_gate.numel() > 0),
                         "StackMoE: a shared expert needs its gate_up, down and shared_gate together");
             return StackMoE{router, std::move(gate_up), std::move(down), top_k, norm_topk,
                             shared_gate_up.value_or(Projection()), shared_down.value_or(Projection()), shared_gate};
           }),
           py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("top_k"), py::arg("norm_topk"),
           py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
           py::arg("shared_gate") = torch::empty({0}));
  py::class_<StackLayer>(mod, "StackLayer", py::module_local())
      .def(py::init([](torch::Tensor input_norm, torch::Tensor post_norm, Projection qkv, Projection o,
                       Projection gate_up, Projection down, torch::Tensor q_norm, torch::Tensor k_norm,
                       int64_t window, torch::Tensor pre_mlp_norm, torch::Tensor post_mlp_norm, bool local_rope,
                       std::optional<StackMoE> moe) {
             TORCH_CHECK(window >= 0, "StackLayer: window must be >= 0 (0: none), got ", window);
             return StackLayer{input_norm, post_norm, q_norm, k_norm, pre_mlp_norm, post_mlp_norm,
                               qkv, o, gate_up, down, window, local_rope, std::move(moe)};
           }),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("q_norm"), py::arg("k_norm"), py::arg("window") = 0,
           py::arg("pre_mlp_norm") = torch::empty({0}), py::arg("post_mlp_norm") = torch::empty({0}),
           py::arg("local_rope") = false, py::arg("moe") = py::none());
  py::class_<DecoderStack>(mod, "DecoderStack", py::module_local())
      .def(py::init<StackSpec, std::vector<StackLayer>, torch::Tensor>(), py::arg("spec"), py::arg("layers"),
           py::arg("final_norm"))
      .def("forward", &DecoderStack::forward, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("key_caches"),
           py::arg("value_caches"), py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("tail_start") = py::none(), py::arg("tail_slots") = py::none(),
           py::arg("local_cos") = py::none(), py::arg("local_sin") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("set_gather", &DecoderStack::set_gather, py::arg("gather"), py::arg("offsets"));
  py::class_<EagleLayer>(mod, "EagleLayer", py::module_local())
      .def(py::init<StackSpec, torch::Tensor, torch::Tensor, Projection, Projection, Projection, Projection,
                    Projection>(),
           py::arg("spec"), py::arg("input_norm"), py::arg("post_norm"), py::arg("fc"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"))
      .def("forward", &EagleLayer::forward, py::arg("embeds"), py::arg("hidden"), py::arg("positions"),
           py::arg("cos_table"), py::arg("sin_table"), py::arg("key_caches"), py::arg("value_caches"),
           py::arg("before"), py::arg("rows"), py::call_guard<py::gil_scoped_release>());
}
