"""Gemma 2 and Gemma 3 (text): what their config.json and GGUF metadata say beyond a Llama
config, read into ``GemmaParams`` and the window / RoPE fields of ``config.ModelArchConfig``.

Pure Python (no torch, nothing of sluice): ``config`` imports it, ``models.gemma`` (the layers)
and ``loaders.gguf_loader`` read it.

Facts this relies on (transformers' ``Gemma2Config`` / ``Gemma3TextConfig``, llama.cpp's gemma2
and gemma3 graphs):

* layers alternate sliding and global attention: transformers' ``layer_types`` when given, else
  a pattern, layer i sliding unless (i + 1) % pattern == 0 (Gemma 2: pattern 2; Gemma 3:
  ``sliding_window_pattern``, default 6). llama.cpp: ``<arch>.attention.sliding_window_pattern``
  (an int, or a bool per layer) with the same defaults;
* queries are scaled by ``query_pre_attn_scalar ** -0.5``. GGUF files do not carry it: llama.cpp
  uses hidden / heads for the 27B models (46 layers for gemma2, 62 for gemma3) and head_dim for
  the others, and so do we when reading a GGUF;
* Gemma 2 soft-caps attention scores (``attn_logit_softcapping``) and the final logits
  (``final_logit_softcapping``): x -> cap * tanh(x / cap). Gemma 3 has no attention cap (a config
  that sets one is served with it); its final cap is optional;
* Gemma 3's sliding layers rotate with their own base (``rope_local_base_freq``, default 10000;
  llama.cpp ``<arch>.rope.freq_base_swa``) and no scaling; its global layers with ``rope_theta``
  (default 1e6) and the config's ``rope_scaling``. transformers 5 writes both as
  ``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``. Gemma 2 rotates
  every layer alike;
* every RMSNorm multiplies by (1 + weight). llama.cpp's converter stores the weights with the 1
  already added; the GGUF loader takes it off again, so that both loaders hand the model
  transformers' values (``GGUF_NORM_OFFSET``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Our architecture name -> the pattern its layers alternate with by default.
DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}
# config.json model_type -> our architecture name. A multimodal Gemma 3 folder (model_type
# "gemma3", Gemma3ForConditionalGeneration) is refused by name (``check_model_type``).
HF_MODEL_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
# GGUF layer tensors whose Hugging Face names differ from a Llama's (the layer prefix left out).
# llama.cpp's ffn_norm is Gemma's pre-feed-forward norm; post_attention_norm and post_ffw_norm
# are the norms on the attention's and the MLP's outputs.
GGUF_LAYER_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GGUF_NORM_OFFSET = 1.0        # what llama.cpp's converter adds to every Gemma "*norm.weight"
# llama.cpp's layer counts of the 27B models, whose query scale is (hidden / heads) ** -0.5.
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
ACTIVATIONS = ("gelu_pytorch_tanh",)


@dataclass(frozen=True)
class GemmaParams:
    """What a Gemma layer stack does beyond a Llama one (``models.gemma``)."""
    query_pre_attn_scalar: float           # queries scaled by its ** -0.5 (not head_dim's)
    attn_softcap: float | None = None      # attention scores -> cap * tanh(score / cap) before the mask
    final_softcap: float | None = None     # the same on the output logits
    # Gemma 3: the RoPE base (unscaled) of the layers in ``local_layers`` (the sliding-type ones,
    # whether or not their window is in force); None: every layer rotates alike.
    local_rope_theta: float | None = None
    local_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is None and name != "query_pre_attn_scalar":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name}: must be a positive finite number, got {value!r}")


def check_model_type(model_type) -> str | None:
    """Our architecture name for a Gemma config.json model_type; None when it is not Gemma.
    ValueError for the Gemma models we do not serve, naming them."""
    if model_type == "gemma3":
        raise ValueError("model_type: 'gemma3' is the multimodal Gemma3ForConditionalGeneration (vision tower "
                         "and projector); it is not supported, only its text-only form (model_type "
                         "'gemma3_text', Gemma3ForCausalLM) is")
    if model_type in ("gemma", "gemma3n"):
        raise ValueError(f"model_type: {model_type!r} is not supported (gemma2 and gemma3_text are)")
    return HF_MODEL_TYPES.get(model_type)


def sliding_layers(num_layers: int, pattern: int | list, source: str) -> tuple[int, ...]:
    """The sliding layers' indices from a pattern (layer i slides unless (i + 1) % pattern == 0)
    or an explicit list (transformers' layer_types strings, or llama.cpp's bools)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{source}: must give each of the {num_layers} layers, got {len(pattern)}")
        if all(isinstance(p, bool) for p in pattern):
            return tuple(i for i, p in enumerate(pattern) if p)
        if not set(pattern) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"{source}: must list sliding_attention or full_attention per layer, got {pattern!r}")
        return tuple(i for i, p in enumerate(pattern) if p == "sliding_attention")
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"{source}: must be a positive integer, got {pattern!r}")
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


def _window(window, max_pos: int, layers: tuple[int, ...], num_layers: int) -> dict:
    """``sliding_window`` / ``sliding_layers`` of ModelArchConfig (as config._sliding_window:
    none when the window spans the context or no layer slides; None layers: every one)."""
    if window is None or not layers:
        return {"sliding_window": None, "sliding_layers": None}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window: must be a positive integer, got {window!r}")
    if window >= max_pos:
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_window": window, "sliding_layers": None if len(layers) == num_layers else layers}


def _gemma3_rope(cfg: dict) -> tuple[float, dict | None, float]:
    """(global theta, global rope_scaling as config.json gives it, local theta) of a Gemma 3 config."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention: RoPE scaling of the sliding layers "
                             f"({local.get('rope_type')!r}) is not supported")
        theta = full.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        return theta, full, local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta") or (scaling or {}).get("rope_theta") or 1_000_000.0
    return theta, scaling, cfg.get("rope_local_base_freq", 10_000.0)


def hf_fields(cfg: dict, architecture: str) -> dict:
    """The ModelArchConfig fields a Gemma config.json sets differently from a Llama one: window,
    RoPE (``rope_theta`` and the raw ``rope_scaling`` dict, which config normalises) and ``gemma``.
    ValueError naming each feature that is not supported."""
    # transformers reads hidden_activation only (Gemma 2/3 configs also carry a hidden_act it ignores).
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_activation: only gelu_pytorch_tanh (GeGLU) is supported for {architecture}, "
                         f"got {act!r}")
    if cfg.get("attention_bias"):
        raise ValueError(f"attention_bias: biases on a {architecture} model's projections are not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: bidirectional (non-causal) attention is not supported")
    num_layers = cfg.get("num_hidden_layers", 0)
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise ValueError(f"layer_types: must be a list, got {types!r}")
        layers = sliding_layers(num_layers, types, "layer_types")
    else:
        pattern = cfg.get("sliding_window_pattern", DEFAULT_PATTERN[architecture]) if architecture == "gemma3" \
            else DEFAULT_PATTERN[architecture]
        layers = sliding_layers(num_layers, pattern, "sliding_window_pattern")
    window = cfg.get("sliding_window", 4096)
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if architecture == "gemma2":
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10_000.0
        local = None
        attn_cap, final_cap = cfg.get("attn_logit_softcapping", 50.0), cfg.get("final_logit_softcapping", 30.0)
    else:
        theta, rope, local = _gemma3_rope(cfg)
        attn_cap, final_cap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
    for name, value in (("rope_theta", theta), ("rope_local_base_freq", local)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{name}: must be a number in config.json, got {value!r}")
    gemma = GemmaParams(query_pre_attn_scalar=scalar, attn_softcap=attn_cap, final_softcap=final_cap,
                        local_rope_theta=None if local is None else float(local),
                        local_layers=() if local is None else layers)
    return {"rope_theta": float(theta), "rope_scaling": rope, "gemma": gemma,
            **_window(window, cfg.get("max_position_embeddings", 8192), layers, num_layers)}


def gguf_fields(meta, architecture: str, num_layers: int, hidden: int, heads: int, head_dim: int,
                max_pos: int) -> dict:
    """The same from llama.cpp's metadata (``meta(key, default)`` reads ``<arch>.key``)."""
    scalar = hidden // heads if num_layers == _GGUF_27B_LAYERS[architecture] else head_dim
    if architecture == "gemma2":
        window, local = meta("attention.sliding_window", 4096), None
        attn_cap, final_cap = meta("attn_logit_softcapping", 50.0), meta("final_logit_softcapping", 30.0)
    else:
        window = meta("attention.sliding_window")
        local = meta("rope.freq_base_swa", 10_000.0)
        attn_cap, final_cap = None, meta("final_logit_softcapping")
        if window is not None and int(window) == 0:
            window = None
    pattern = meta("attention.sliding_window_pattern", DEFAULT_PATTERN[architecture])
    layers = sliding_layers(num_layers, pattern, f"{architecture}.attention.sliding_window_pattern")
    gemma = GemmaParams(query_pre_attn_scalar=scalar, attn_softcap=None if attn_cap is None else float(attn_cap),
                        final_softcap=float(final_cap) if final_cap else None,
                        local_rope_theta=None if local is None or window is None else float(local),
                        local_layers=() if local is None or window is None else layers)
    return {"gemma": gemma, **_window(None if window is None else int(window), max_pos, layers, num_layers)}
