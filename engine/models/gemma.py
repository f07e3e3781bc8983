"""Gemma 2 and Gemma 3 text (transformers' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``;
llama.cpp's ``gemma2`` / ``gemma3``) over the shared Llama layers.

What sets them apart, all of it here or in ``gemma_config`` (their config and metadata):

* a layer is norm → attention → norm, added to the residual; norm → GeGLU MLP → norm, added
  (``GemmaDecoderLayer``; four norms, ``LayerSpec.sandwich_norms``). Every norm, the final one and
  Gemma 3's per-head q/k norms included, multiplies by (1 + weight) in float32
  (``llama.GemmaRMSNorm``): the 1 is added here, at load (``_NormsPlusOne``), so the weight held
  is the multiplier;
* the embeddings are multiplied by sqrt(hidden), rounded to the model's dtype first (as
  transformers does); the output projection is the embedding matrix (tied) unless the
  checkpoint has its own;
* queries are scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps the attention
  scores (``AttentionSpec.softcap``: the attention backend applies it; a backend that cannot is
  never chosen, ``attention.selector.backend_for_models``) and the final logits
  (``compute_logits``);
* sliding and global layers alternate (per-layer windows, ``ModelArchConfig.layer_window``);
  Gemma 3's sliding-type layers rotate with their own RoPE base, unscaled (``local_rope``): the
  model hands the layer stack both tables and each layer takes its own (``RopeTables``).

They run on either layer stack (``models.layer_stack``: the C++ stack builds Gemma's layer from
``LayerSpec``'s geglu / sandwich_norms / softcap and the layers' ``rope``), in float32 or any
block format, with the torch attention backend, or Triton / flash-attn on CUDA for Gemma 3 (no
attention soft-cap).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from sluice.engine.models.config import ModelArchConfig
from sluice.engine.models.layer_spec import LayerSpec
from sluice.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, _take, make_norm
from sluice.engine.models.rope import RotaryEmbedding

# Gemma 3's two RoPE tables travel as one pair through the layer stack: (global, local).
RopeTables = tuple[torch.Tensor, torch.Tensor]


class GemmaDecoderLayer(torch.nn.Module):
    """``rope``: which of the model's RoPE tables this layer reads (0: global, 1: Gemma 3's local)."""

    def __init__(self, spec: LayerSpec, rope: int = 0, **factory) -> None:
        super().__init__()
        self.spec, self.rope = spec, rope
        h, eps = spec.hidden_size, spec.norm_eps
        self.input_layernorm = make_norm(spec.norm, h, eps, **factory)
        self.self_attn = LlamaAttention(spec, **factory)
        self.post_attention_layernorm = make_norm(spec.norm, h, eps, **factory)
        self.pre_feedforward_layernorm = make_norm(spec.norm, h, eps, **factory)
        self.mlp = LlamaMLP(spec, **factory)
        self.post_feedforward_layernorm = make_norm(spec.norm, h, eps, **factory)

    def forward(self, h, cos: RopeTables, sin: RopeTables, kv_cache, meta, attn):
        # h [T, hidden]
        out = self.self_attn(self.input_layernorm(h), cos[self.rope], sin[self.rope], kv_cache, meta, attn)
        h = h + self.post_attention_layernorm(out)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class _NormsPlusOne(Mapping):
    """The checkpoint's tensors with 1 added to every norm weight (float32): Gemma's norms
    multiply by (1 + weight), ``llama.GemmaRMSNorm`` by its weight. Everything else (and the
    quantizer's ``tensor_type`` / ``blocks`` / ``shape`` reads) passes through."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self._weights[name]
        return w.float() + 1.0 if name.endswith("norm.weight") else w

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __getattr__(self, name: str):
        return getattr(self._weights, name)


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArchConfig, max_seq_len: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(arch, max_seq_len, dtype, device)
        local = self._local_layers()
        self.local_rotary = None if not local else RotaryEmbedding(
            replace(arch, rope_theta=arch.gemma.local_rope_theta, rope_scaling=None), max_seq_len, device=device)
        # sqrt(hidden) in the model's dtype, as transformers rounds it.
        self.register_buffer("embed_scale", torch.tensor(arch.hidden_size ** 0.5, dtype=dtype, device=device),
                             persistent=False)
        self.final_softcap = arch.gemma.final_softcap

    def _local_layers(self) -> tuple[int, ...]:
        """The layers that rotate with Gemma 3's local RoPE table."""
        gemma = self.arch.gemma
        return gemma.local_layers if gemma.local_rope_theta is not None else ()

    def make_layer(self, index: int, spec: LayerSpec, **factory) -> GemmaDecoderLayer:
        return GemmaDecoderLayer(spec, rope=int(index in self._local_layers()), **factory)

    def forward(self, input_ids, positions, kv_caches, meta, attn) -> torch.Tensor:   # [T, hidden]
        h = self.embed(input_ids)                                             # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)                    # [T, 1, D/2] each
        if self.local_rotary is None:
            tables = (cos, cos), (sin, sin)
        else:
            local_cos, local_sin = self.local_rotary.cos_sin(positions, h.dtype)
            tables = (cos, local_cos), (sin, local_sin)
        return self.layer_stack().forward(self, h, *tables, kv_caches, meta, attn)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(input_ids)
        return h * self.embed_scale.to(h.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)                               # [N, vocab] float32
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor], quantizer=None) -> None:
        weights = _NormsPlusOne(weights)
        super().load_hf_weights(weights, quantizer)
        h = self.arch.hidden_size
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                    getattr(layer, name).weight.copy_(_take(weights, f"model.layers.{i}.{name}.weight", (h,)))
