"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over a flattened varlen batch.

RMSNorm → fused QKV projection (+ optional bias, Qwen2) → per-head q/k RMSNorm (Qwen3) → RoPE
→ attention through the backend (which owns the paged KV cache) → output projection; RMSNorm →
fused gate/up projection → SwiGLU → down projection. Q/K/V and gate/up are each one matmul: on
a bandwidth-bound CPU, fewer and larger matmuls are faster. The layers are built from a
``layer_spec.LayerSpec``; how they run on a step (these modules, or all of them in one C++ call)
is a ``layer_stack`` strategy chosen once per model.

Weights arrive under Hugging Face names (``model.layers.N.self_attn.q_proj.weight``...) from
either loader; ``load_hf_weights`` checks every shape, fuses, and names what is wrong.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from sluice.engine.attention.base import AttentionBackend, AttentionMetadata, KVCache
from sluice.engine.errors import ModelLoadError
from sluice.engine.models import kquant, phi3
from sluice.engine.models.config import ARCHITECTURES, ModelArchConfig
from sluice.engine.models.cpu_linear import cpu_packing_available, pack_cpu_weight, packed_linear, warm_up_row_buckets
from sluice.engine.models.layer_spec import LayerSpec
from sluice.engine.models.layer_stack import PythonLayers, select_layer_stack
from sluice.engine.models.moe import SparseMoE
from sluice.engine.models.rope import RotaryEmbedding, apply_rotary


class _Linear(torch.nn.Linear):
    """A Linear left uninitialised: every weight comes from a checkpoint, so random init is wasted time.

    On CPU in float32, ``pack_for_cpu`` swaps the weight for oneDNN's packed layout: MKL's sgemv/
    small-M sgemm behind ``F.linear`` streams a row-major weight at about a third of the memory
    bandwidth, oneDNN's packed inner product at about two thirds. The dense weight is then
    released (no second copy); ``dense_weight()`` rebuilds it for inspection. ``set_quantized``
    swaps it instead for one of ``models.quant``'s formats (the bias stays float32).
    """

    packed: torch.Tensor | None = None
    quantized = None              # a models.quant *Linear, or None

    def reset_parameters(self) -> None:
        pass

    def pack_for_cpu(self) -> None:
        self.packed = pack_cpu_weight(self.weight)
        self.weight = None

    def set_quantized(self, weight) -> None:
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ModelLoadError(f"quantized weight is {weight.out_features}x{weight.in_features}, "
                                 f"expected {self.out_features}x{self.in_features}")
        self.quantized = weight
        self.weight = None

    def dense_weight(self) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.dequantize()
        return self.weight if self.packed is None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = self.quantized(x)
            return out if self.bias is None else out + self.bias
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class _Embedding(torch.nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op instead of five: the norm runs 61 times per token.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Statistics in float32 whatever the dtype; the weight multiplies in the model dtype (as HF).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm (``layer_spec`` kind "gemma_rms"): the statistics, the product with the
    weight and the weight itself in float32, the result rounded to the input's dtype last. The
    weight held is the multiplier, (1 + the checkpoint's weight): ``models.gemma`` adds the 1 at
    load, so that the norm runs as one fused op in float32."""

    def __init__(self, size: int, eps: float, **factory) -> None:
        super().__init__(size, eps, **{**factory, "dtype": torch.float32})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


def make_norm(kind: str, size: int, eps: float, **factory) -> RMSNorm:
    """A ``layer_spec.NORMS`` norm."""
    return (GemmaRMSNorm if kind == "gemma_rms" else RMSNorm)(size, eps, **factory)


class LlamaAttention(torch.nn.Module):
    def __init__(self, spec: LayerSpec, **factory) -> None:
        super().__init__()
        att = spec.attention
        self.num_heads, self.num_kv_heads, self.head_dim = att.num_heads, att.num_kv_heads, att.head_dim
        self.q_size, self.kv_size = att.q_size, att.kv_size
        self.scale = att.scale
        self.sliding_window = att.sliding_window        # this layer's window (None: global)
        # Attention soft-capping (Gemma 2), passed only when set: a backend that cannot apply it
        # is never chosen for the model (attention.selector.backend_for_models).
        self.softcap = {} if att.softcap is None else {"softcap": att.softcap}
        self.qkv_proj = _Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=att.qkv_bias, **factory)
        o_out, o_in = spec.o_shape
        self.o_proj = _Linear(o_in, o_out, bias=False, **factory)
        # Per-head norms of queries and keys (Qwen3), one weight over head_dim each; or one norm
        # over the whole q and k projections (OLMoE, qk_norm_full).
        self.qk_norm_full = att.qk_norm_full
        q_dim, k_dim = (self.q_size, self.kv_size) if att.qk_norm_full else (att.head_dim, att.head_dim)
        self.q_norm = make_norm(spec.norm, q_dim, spec.norm_eps, **factory) if att.qk_norm else None
        self.k_norm = make_norm(spec.norm, k_dim, spec.norm_eps, **factory) if att.qk_norm else None

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata, attn: AttentionBackend):
        # x [T, hidden]
        qkv = self.qkv_proj(x)                                                 # [T, q + 2 kv]
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        if self.qk_norm_full:
            q, k = qk.split((self.q_size, self.kv_size), dim=-1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-1)              # [T, q + kv]
        qk = qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim)     # [T, Hq + Hkv, D]
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # Q and K heads rotate in one call: they sit side by side in the fused projection.
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)              # [T, Hq, D], [T, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)                        # [T, Hkv, D]
        out = attn.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window, **self.softcap)  # [T, Hq, D]
        return self.o_proj(out.reshape(-1, self.q_size))                         # [T, hidden]


class LlamaMLP(torch.nn.Module):
    """SwiGLU, or GeGLU (``layer_spec.MLPS``: the activation of the gate differs)."""

    def __init__(self, spec: LayerSpec, **factory) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.geglu = spec.mlp == "geglu"
        self.gate_up_proj = _Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False, **factory)
        self.down_proj = _Linear(spec.down_shape[1], spec.down_shape[0], bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        act = F.gelu(gate, approximate="tanh") if self.geglu else F.silu(gate)
        return self.down_proj(act * up)                                          # [T, hidden]


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, spec: LayerSpec, **factory) -> None:
        super().__init__()
        self.spec = spec
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps, **factory)
        self.self_attn = LlamaAttention(spec, **factory)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps, **factory)
        # Mixture of experts (models.moe): experts are LlamaMLPs of the expert size.
        self.mlp = SparseMoE(spec, LlamaMLP, **factory) if spec.mlp == "moe" else LlamaMLP(spec, **factory)

    def forward(self, h, cos, sin, kv_cache, meta, attn):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(torch.nn.Module):
    """Parameters are allocated uninitialised (``torch.empty``); fill them with ``load_hf_weights``."""

    def __init__(
        self,
        arch: ModelArchConfig,
        max_seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.arch = arch
        self.embed_tokens = _Embedding(arch.vocab_size, arch.hidden_size, **factory)
        self.rotary = RotaryEmbedding(arch, max_seq_len, device=device)
        specs = [LayerSpec.from_arch(arch, i) for i in range(arch.num_hidden_layers)]   # per-layer windows
        spec = specs[0]
        self.layers = torch.nn.ModuleList(self.make_layer(i, s, **factory) for i, s in enumerate(specs))
        self.norm = make_norm(spec.norm, arch.hidden_size, arch.rms_norm_eps, **factory)
        # Tied: the output projection is the embedding matrix itself (no copy).
        self.lm_head = None if arch.tie_word_embeddings else _Linear(
            arch.hidden_size, arch.vocab_size, bias=False, **factory)
        self._packed_lm_head: torch.Tensor | None = None
        # Set by load_hf_weights with a quantizer (models.quant formats), in place of the float ones.
        self.quant_embedding = None
        self.quant_lm_head = None
        self.spec = spec          # layer 0's; layers differ only in their window (self_attn.sliding_window)
        self._decoder = None      # the layer stack strategy, chosen on first use (layer_stack())

    def forward(
        self,
        input_ids: torch.Tensor,       # [T] int64, all sequences' new tokens flattened
        positions: torch.Tensor,       # [T] int64
        kv_caches: list[KVCache],      # one per layer
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:                 # [T, hidden]
        h = self.embed(input_ids)                              # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)     # [T, 1, D/2] each, shared by all layers
        return self.layer_stack().forward(self, h, cos, sin, kv_caches, meta, attn)

    def make_layer(self, index: int, spec: LayerSpec, **factory) -> torch.nn.Module:
        """Layer ``index`` built from its spec (``models.gemma`` builds its own)."""
        return LlamaDecoderLayer(spec, **factory)

    def layer_stack(self):
        """How this model's layers run (``models.layer_stack``): chosen once, on the first step
        (or warm-up) after the weights are loaded and packed, since the formats decide it."""
        if self._decoder is None:
            self._decoder = select_layer_stack(self)
        return self._decoder

    def use_python_layers(self) -> None:
        """Run the Python layers whatever the formats (tensor parallelism wraps their projections
        in collectives, which the C++ stack has none of)."""
        self._decoder = PythonLayers()

    def _cpu_decoder(self):
        """The C++ stack strategy when it was chosen, else None (tests and bench/ time or inspect it)."""
        stack = self.layer_stack()
        return stack if stack.runs_in_cpp else None

    def supports_draft_trees(self, attn: AttentionBackend) -> bool:
        """Whether a step may carry draft trees (``AttentionMetadata.tree``)."""
        return self.layer_stack().attends_trees(attn)

    def linears(self) -> list[_Linear]:
        return [m for m in self.modules() if isinstance(m, _Linear)]

    def extra_rows_are_cheap(self) -> bool:
        """Whether a step's extra rows cost little next to its first: float32 projections stream
        their weights once for a few rows (SmolLM2 on 2 cores: 8 rows 25 ms, 1 row 22 ms), where
        the block formats' integer products are compute-bound from a few rows up (w4a8: 8 ms
        against 4). Speculation's draft trees pay only in the first case (bench/spec_decode.py)."""
        return not any(isinstance(m.quantized, kquant.BLOCK_CLASSES) for m in self.linears())

    def rows_at_one_row_cost(self) -> int | None:
        """The most rows a step runs for about the cost of one, where measured: 6 with every
        projection float32 and packed for oneDNN on CPU (its products pad 1-3 rows to 4
        (``row_bucket``) and stream a weight as fast at 4-6 rows; 7 rows cost ~15% more a step on
        SmolLM2 with 2 AVX-512 cores). None elsewhere. Draft trees verify that many rows'
        nodes freely (``spec_decode.tree.select``)."""
        return 6 if self._float32_packed() else None

    def _float32_packed(self) -> bool:
        """Every projection float32 and packed for oneDNN (the CPU's float32 format)."""
        linears = self.linears()
        return bool(linears) and all(m.quantized is None and m.packed is not None for m in linears)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input ids [T] → embeddings [T, hidden] (EAGLE's heads share them)."""
        embed = self.embed_tokens if self.quant_embedding is None else self.quant_embedding
        return embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab] float32."""
        if self.quant_lm_head is not None:
            return self.quant_lm_head(hidden.float())
        if self._packed_lm_head is not None:
            return packed_linear(hidden, self._packed_lm_head, None).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def pack_for_cpu(self) -> bool:
        """Pack every projection (and the LM head) for oneDNN when on CPU in float32; a no-op
        returning False elsewhere. Call after the weights are loaded."""
        weight = self.embed_tokens.weight
        if self.quant_lm_head is not None or weight is None:
            return False   # quantized (models.quant): nothing float32 left to pack
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not cpu_packing_available():
            return False
        for module in self.modules():
            if isinstance(module, _Linear) and module.packed is None:
                module.pack_for_cpu()
        if self.lm_head is None:
            # Tied: the embedding keeps its rows for lookups; the LM head gets its own packed
            # copy (vocab x hidden floats) because it is read in full for every sampled token.
            self._packed_lm_head = pack_cpu_weight(weight)
        return True

    def warm_up(self, max_rows: int, max_logit_rows: int) -> None:
        """Compile the packed projections' primitives for every step size up to ``max_rows`` tokens
        and the LM head's up to ``max_logit_rows`` sampled rows (``warm_up_row_buckets``); what an
        earlier engine on this model already warmed is not run again. A no-op unless packed.
        The layer stack is chosen here too (the C++ one built), so that a machine's first start compiles its
        kernels (about a minute, once) before the engine is ready, not inside the first request."""
        self.layer_stack()
        done = getattr(self, "_warmed", (0, 0))
        shapes = {(m.in_features, m.out_features): m.packed for m in self.modules()
                  if isinstance(m, _Linear) and m.packed is not None}
        warm_up_row_buckets(shapes, max_rows, done[0])
        if self._packed_lm_head is not None:
            hidden = self.arch.hidden_size
            warm_up_row_buckets({(hidden, 0): self._packed_lm_head}, max_logit_rows, done[1])
        self._warmed = (max(done[0], max_rows), max(done[1], max_logit_rows))

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor], quantizer=None) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; ModelLoadError names a missing/misshapen one.

        With a ``quantizer`` (``loaders.quantized.Quantizer``) the projections, the LM head and,
        where the checkpoint stores it quantized, the embedding are built in its format instead,
        and the float32 parameters they replace are released without ever being written (so they
        never become resident)."""
        arch = self.arch
        vocab_shape = self.embed_tokens.weight.shape
        with torch.no_grad():
            self.norm.weight.copy_(_take(weights, "model.norm.weight", self.norm.weight.shape))
            if quantizer is not None:
                head = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
                self.quant_lm_head = quantizer.head(weights, head, tuple(vocab_shape))
                # A tied table kept as stored by a block head: lookups read the head's blocks.
                self.quant_embedding = quantizer.embedding(weights, "model.embed_tokens.weight", tuple(vocab_shape),
                                                           tied_head=self.quant_lm_head if self.lm_head is None else None)
                self.lm_head = None
            if self.quant_embedding is None:
                self.embed_tokens.weight.copy_(_take(weights, "model.embed_tokens.weight", vocab_shape))
            else:
                self.embed_tokens.weight = None
            if self.lm_head is not None:
                self.lm_head.weight.copy_(_take(weights, "lm_head.weight", self.lm_head.weight.shape))
            release = getattr(weights, "release_read", None)   # a GGUF file's pages, once built from
            for i, layer in enumerate(self.layers):
                if release is not None:
                    release()
                _load_layer(layer, weights, f"model.layers.{i}.", arch, quantizer)
            if release is not None:
                release()


def _take(weights: Mapping[str, torch.Tensor], name: str, shape) -> torch.Tensor:
    if name not in weights:
        raise ModelLoadError(f"missing tensor {name!r}")
    t = weights[name]
    if tuple(t.shape) != tuple(shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def _fill(linear: _Linear, weights, parts: list[tuple[str, tuple[int, int]]], quantizer) -> None:
    """The fused weight of ``linear`` from its HF parts (stacked by rows, in order)."""
    if quantizer is not None:
        linear.set_quantized(quantizer.linear(weights, parts))
        return
    start = 0
    for name, shape in parts:   # copy_ into row slices avoids a concatenated temporary
        linear.weight[start:start + shape[0]].copy_(_take(weights, name, shape))
        start += shape[0]


def _load_layer(layer: LlamaDecoderLayer, weights, prefix: str, arch: ModelArchConfig, quantizer=None) -> None:
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    a, m = prefix + "self_attn.", prefix + "mlp."
    layer.input_layernorm.weight.copy_(_take(weights, prefix + "input_layernorm.weight", (h,)))
    layer.post_attention_layernorm.weight.copy_(_take(weights, prefix + "post_attention_layernorm.weight", (h,)))
    for norm, name in ((layer.self_attn.q_norm, "q_norm"), (layer.self_attn.k_norm, "k_norm")):
        if norm is not None:   # [head_dim], or [q] / [kv] over the whole projection (OLMoE)
            norm.weight.copy_(_take(weights, f"{a}{name}.weight", tuple(norm.weight.shape)))
    qkv = layer.self_attn.qkv_proj
    fused = ARCHITECTURES[arch.architecture].fused     # Phi-3 (models.phi3): stored fused already
    # Rows of the fused weight: [q | k | v].
    _fill(qkv, weights, phi3.qkv_parts(a, q, kv, h) if fused else
          [(f"{a}q_proj.weight", (q, h)), (f"{a}k_proj.weight", (kv, h)), (f"{a}v_proj.weight", (kv, h))],
          quantizer)
    if qkv.bias is not None:
        for name, start, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
            qkv.bias[start:start + rows].copy_(_take(weights, f"{a}{name}.bias", (rows,)))
    spec = layer.spec
    _fill(layer.self_attn.o_proj, weights, [(a + "o_proj.weight", spec.o_shape)], quantizer)
    if isinstance(layer.mlp, SparseMoE):
        layer.mlp.load(weights, prefix, ARCHITECTURES[arch.architecture].moe, _fill, _take, quantizer)
    else:
        _fill(layer.mlp.gate_up_proj, weights, phi3.gate_up_parts(m, inter, h) if fused else
              [(m + "gate_proj.weight", (inter, h)), (m + "up_proj.weight", (inter, h))], quantizer)
        _fill(layer.mlp.down_proj, weights, [(m + "down_proj.weight", spec.down_shape)], quantizer)
