"""Phi-3 / Phi-4 (transformers' ``Phi3ForCausalLM``; llama.cpp's ``phi3``): a Llama layer whose
checkpoints hold q/k/v and gate/up fused, with LongRoPE.

What sets it apart, all of it here, the layers being Llama's (``llama.LlamaDecoderLayer``; both
layer stacks, since the fused projections are already sluice's own layout):

* weights: ``self_attn.qkv_proj`` ([q | k | v] rows) and ``mlp.gate_up_proj`` ([gate | up]
  rows, transformers' ``chunk(2)``) are fed to the fused projections as they are
  (``qkv_parts`` / ``gate_up_parts``); llama.cpp's ``attn_qkv`` and ``ffn_up`` (gate and up
  stacked) are the same tensors (``GGUF_LAYER_NAMES``), not permuted (NEOX RoPE);
* config.json (``check_hf_config``): ``hidden_act`` must be silu; ``partial_rotary_factor``
  other than 1.0 (Phi-4-mini) is refused by name; ``rope_scaling`` "longrope" gets its
  ``original_max_position_embeddings`` from the top level when the dict lacks it, and its
  factor lists become tuples (so a config is hashable and equal to the GGUF's);
* a sliding window, when config.json gives one, slides on every layer (transformers' Phi3
  masks every layer with it: ``ArchTraits(window="always")``).

LongRoPE's short or long factors (``rope._longrope``): transformers switches to the long factors
when a sequence passes ``original_max_position_embeddings`` and recomputes the whole cache;
a paged cache must rotate a position one way for its life, so the choice is made once per
model, as llama.cpp makes it from its context: long factors when the context the model is built
for (``max_seq_len``: the engine's ``max_model_len``, else ``max_position_embeddings``) exceeds
the original length, short otherwise. That equals transformers for every sequence when the
context is at most the original length (serve Phi-3-mini-128k with ``max_model_len`` 4096 for
that), and for sequences longer than it otherwise.
"""
from __future__ import annotations

import math

# llama.cpp's fused phi3 tensors under transformers' names (the layer prefix left out).
GGUF_LAYER_NAMES = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",      # gate then up, stacked by rows
}
# The GGUF tensors that hold LongRoPE's factors (part of the architecture, not weights).
GGUF_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def qkv_parts(attn_prefix: str, q: int, kv: int, hidden: int) -> list[tuple[str, tuple[int, int]]]:
    return [(f"{attn_prefix}qkv_proj.weight", (q + 2 * kv, hidden))]


def gate_up_parts(mlp_prefix: str, inter: int, hidden: int) -> list[tuple[str, tuple[int, int]]]:
    return [(f"{mlp_prefix}gate_up_proj.weight", (2 * inter, hidden))]


def _factor_tuple(name: str, value) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0 for f in value):
        raise ValueError(f"rope_scaling.{name}: must be a list of positive finite numbers, got {value!r}")
    return tuple(float(f) for f in value)


def longrope(rs: dict, original: int | None) -> dict:
    """A "longrope" ``rope_scaling`` dict with its factor lists as tuples and the original length
    in it (``original``: the config's top-level ``original_max_position_embeddings``)."""
    out = dict(rs)
    for name in ("short_factor", "long_factor"):
        if name not in out:
            raise ValueError(f"rope_scaling: longrope scaling needs {name!r}, got keys {sorted(rs)}")
        out[name] = _factor_tuple(name, out[name])
    if out.get("original_max_position_embeddings") is None:
        if original is None:
            raise ValueError("original_max_position_embeddings: longrope scaling needs it "
                             "(in rope_scaling or at the top of config.json)")
        out["original_max_position_embeddings"] = original
    return out


def check_hf_config(cfg: dict, rope: dict | None) -> dict | None:
    """Phi-3's config.json checked (ValueError naming the field); returns ``rope`` (the normalised
    ``rope_scaling``) with LongRoPE's fields completed (``longrope``)."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: only silu is supported for phi3, got {act!r}")
    partial = (rope or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and partial != 1.0:
        raise ValueError(f"partial_rotary_factor: RoPE over part of each head (got {partial!r}, as Phi-4-mini's) "
                         "is not supported")
    if rope is None:
        return None
    rope = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    if rope == {"rope_type": "default"}:
        return None
    if rope.get("rope_type") == "su":     # early Phi-3 128k configs' name for LongRoPE (llama.cpp reads both)
        rope["rope_type"] = "longrope"
    if rope.get("rope_type") == "longrope":
        return longrope(rope, cfg.get("original_max_position_embeddings"))
    return rope
