"""The shape of a Llama-family decoder, whichever file it came from (GGUF or a Hugging Face folder).

``ARCHITECTURES`` says what sets each supported architecture's layers apart (``ArchTraits``);
``models.layer_spec`` turns a config into the layer description both layer stacks build from.

``rope_scaling`` keeps Hugging Face's semantics (the ``rope_scaling`` / ``rope_parameters`` dict
of ``config.json``, normalised so the kind is under ``"rope_type"``); ``engine.models.rope`` is
the one reader of it. Tokenizer facts (special tokens, FIM tokens) belong to the tokenizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from sluice.engine.models import gemma_config
from sluice.engine.models.gemma_config import GemmaParams


@dataclass(frozen=True)
class ArchTraits:
    """What an architecture's layers do beyond the Llama layer, whatever its config.json says."""
    qkv_bias: bool = False          # q/k/v projections always carry a bias (Qwen2); others say so with attention_bias
    qk_norm: bool = False           # queries and keys pass a per-head RMSNorm before RoPE (Qwen3)
    qk_norm_full: bool = False      # ... one RMSNorm over the whole q and k projections instead (OLMoE)
    # Whether config.json's sliding_window is in force: "never" (Llama's configs carry one that
    # nothing reads), "always" (Mistral), or only with use_sliding_window (Qwen2, Qwen3).
    window: str = "always"
    # Mixture of experts (``models.moe``): how config.json names the expert fields, None for a
    # dense MLP. "mixtral": num_local_experts, intermediate_size per expert, always renormalised;
    # "qwen": num_experts, moe_intermediate_size, norm_topk_prob, shared_expert_intermediate_size;
    # "olmoe": num_experts, intermediate_size per expert, norm_topk_prob.
    moe: str | None = None
    # The checkpoint holds q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``: Phi-3,
    # ``models.phi3``), fed to the fused projections as they are.
    fused: bool = False
    # Gemma 2 / Gemma 3 (``models.gemma``, ``gemma_config``): GeGLU, (1 + weight) norms around
    # attention and MLP, scaled embeddings, soft-capping; ``ModelArchConfig.gemma`` holds the rest.
    gemma: bool = False


ARCHITECTURES = {
    "llama": ArchTraits(window="never"),
    "mistral": ArchTraits(),
    "qwen2": ArchTraits(qkv_bias=True, window="opt_in"),
    "qwen3": ArchTraits(qk_norm=True, window="opt_in"),
    "mixtral": ArchTraits(moe="mixtral"),
    "qwen2_moe": ArchTraits(qkv_bias=True, window="opt_in", moe="qwen"),
    "qwen3_moe": ArchTraits(qk_norm=True, window="opt_in", moe="qwen"),
    "olmoe": ArchTraits(qk_norm=True, qk_norm_full=True, window="never", moe="olmoe"),
    "phi3": ArchTraits(fused=True),
    # Their sliding windows come with their own layer pattern (gemma_config), not config._sliding_window.
    "gemma2": ArchTraits(window="never", gemma=True),
    "gemma3": ArchTraits(qk_norm=True, window="never", gemma=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# "factors": per-frequency divisors of the base frequencies, as GGUF files carry Llama 3.1/3.2's
# scaling (a ``rope_freqs.weight`` tensor, llama.cpp's precomputed llama3 factors).
# "longrope": Phi-3's per-frequency short and long factors (``models.phi3`` says which is used).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "factors", "longrope")

# Keys each rope type must carry besides "rope_type" (HF validation, less the optional ones).
_ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (),  # factor, or original_max_position_embeddings to derive it
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "factors": ("factors",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a positive finite number, got {value!r}")


def normalize_rope_scaling(raw: dict | None) -> dict | None:
    """HF spells the kind ``type`` (old) or ``rope_type`` (new); ``default``/None means no scaling."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"rope_scaling: must be a dict or None, got {type(raw).__name__}")
    out = {k: v for k, v in raw.items() if k not in ("type", "rope_theta")}
    out["rope_type"] = raw.get("rope_type", raw.get("type", "default"))
    if out["rope_type"] == "default" and len(out) == 1:
        return None
    return out


def _validate_rope_scaling(rs: dict | None) -> None:
    if rs is None:
        return
    kind = rs.get("rope_type")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope_type must be one of {ROPE_TYPES}, got {kind!r}")
    for key in _ROPE_REQUIRED[kind]:
        if key not in rs:
            raise ValueError(f"rope_scaling: {kind} scaling needs {key!r}, got keys {sorted(rs)}")
    # YaRN alone may leave factor None: it is then max_position_embeddings / original (HF).
    if kind == "longrope":
        from sluice.engine.models.phi3 import longrope

        longrope(rs, rs["original_max_position_embeddings"])     # the factor lists' checks
        _positive_int("rope_scaling.original_max_position_embeddings", rs["original_max_position_embeddings"])
        for key in ("factor", "attention_factor"):
            if rs.get(key) is not None:
                _positive_float(f"rope_scaling.{key}", rs[key])
        return
    if kind == "factors":
        if not rs["factors"] or not all(isinstance(f, float) and math.isfinite(f) and f > 0 for f in rs["factors"]):
            raise ValueError("rope_scaling.factors: must be positive finite numbers")
        return
    if not (kind == "yarn" and rs.get("factor") is None and "original_max_position_embeddings" in rs):
        if kind != "default":
            _positive_float("rope_scaling.factor", rs.get("factor"))


def _sliding_window(cfg: dict, model_type: str) -> int | None:
    """The window config.json puts in force (``ArchTraits.window``), None when none is, it spans
    the whole context, or no layer slides (``_sliding_layers``)."""
    window, rule = cfg.get("sliding_window"), ARCHITECTURES[model_type].window
    if window is None or rule == "never" or (rule == "opt_in" and not cfg.get("use_sliding_window")):
        return None
    _positive_int("sliding_window", window)
    if window >= cfg.get("max_position_embeddings", 2048):
        return None
    return window if _sliding_layers(cfg, model_type) != () else None


def _sliding_layers(cfg: dict, model_type: str) -> tuple[int, ...] | None:
    """Which layers attend through the window: None for every layer (Mistral), else the indices.
    Qwen2/Qwen3 as transformers reads them: ``layer_types`` when given ("sliding_attention"),
    else the layers from ``max_window_layers`` (default 28) on."""
    if ARCHITECTURES[model_type].window != "opt_in":
        return None
    num_layers = cfg.get("num_hidden_layers", 0)
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or \
                not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError("layer_types: must list sliding_attention or full_attention for each of the "
                             f"{num_layers} layers, got {types!r}")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        first = cfg.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"max_window_layers: must be a non-negative integer, got {first!r}")
        layers = tuple(range(first, num_layers))
    return None if len(layers) == num_layers else layers


# config.json fields that must be positive integers when present (a string "64" would fail later,
# deep in the model's construction, with a TypeError that names nothing).
_HF_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str                       # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None        # HF semantics, see module docstring
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # q/k/v projections carry a bias (always in Qwen2)
    # Sliding-window attention (Mistral, Qwen2 with use_sliding_window): a token at position p
    # attends to positions p - sliding_window + 1 .. p (transformers' sliding_window_overlay).
    sliding_window: int | None = None
    # The layers that slide (indices, ascending); None: every layer, when sliding_window is set.
    # The others attend over the whole context. See layer_window / kv_window.
    sliding_layers: tuple[int, ...] | None = None
    # Mixture of experts (every layer sparse; models.moe): 0 experts is a dense MLP. Each token
    # runs its top ``num_experts_per_tok`` experts (SwiGLU of ``moe_intermediate_size``), weighted
    # by their softmax probabilities, renormalised over the k when ``norm_topk_prob``; a shared
    # expert (``shared_expert_intermediate_size`` > 0, Qwen2-MoE) runs on every token, scaled by
    # a sigmoid gate.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # One rank's share under tensor parallelism's exact split (engine.parallel.tensor): o_proj and
    # down_proj hold ``output_shard[0]`` of the hidden_size output rows and read the whole model's
    # attention output (``[1]`` wide) and MLP activation (``[2]`` wide: each routed expert's with
    # experts; ``[3]``: the shared expert's, 0 without one), which the ranks gather.
    # None: the projections are whole (or row-parallel, summed by the ranks).
    output_shard: tuple[int, int, int, int] | None = None
    # Gemma 2 / 3 (exactly when ArchTraits.gemma): attention scale, soft-caps, local RoPE.
    gemma: GemmaParams | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: {self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: rotary embedding needs an even head_dim, got {self.head_dim}")
        _positive_float("rms_norm_eps", self.rms_norm_eps)
        _positive_float("rope_theta", self.rope_theta)
        _validate_rope_scaling(self.rope_scaling)
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        layers = self.sliding_layers
        if layers is not None and (list(layers) != sorted(set(layers)) or
                                   any(not 0 <= i < self.num_hidden_layers for i in layers)):
            raise ValueError(f"sliding_layers: must be ascending layer indices below "
                             f"{self.num_hidden_layers}, got {layers!r}")
        self._check_experts()
        if self.output_shard is not None:
            rows, attn_in, mlp_in, shared_in = self.output_shard
            for name, v in (("rows", rows), ("attention input", attn_in), ("MLP input", mlp_in)):
                _positive_int(f"output_shard {name}", v)
            if (shared_in > 0) != (self.shared_expert_intermediate_size > 0):
                raise ValueError(f"output_shard: a shared expert input of {shared_in} for "
                                 f"{self.shared_expert_intermediate_size} shared expert features held")
            if rows > self.hidden_size:
                raise ValueError(f"output_shard: {rows} rows of a hidden size of {self.hidden_size}")
        if (self.gemma is not None) != ARCHITECTURES[self.architecture].gemma:
            raise ValueError(f"gemma: a {self.architecture} model {'needs' if self.gemma is None else 'takes no'} "
                             "GemmaParams")
        if self.gemma is not None and any(not 0 <= i < self.num_hidden_layers for i in self.gemma.local_layers):
            raise ValueError(f"gemma.local_layers: must be layer indices below {self.num_hidden_layers}")

    def _check_experts(self) -> None:
        moe = ARCHITECTURES[self.architecture].moe
        if moe is None:
            if self.num_experts:
                raise ValueError(f"num_experts: a {self.architecture} model has no experts, got {self.num_experts}")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            _positive_int(name, getattr(self, name))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} is more than the "
                             f"{self.num_experts} experts")
        shared = self.shared_expert_intermediate_size
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"shared_expert_intermediate_size: must be a non-negative integer, got {shared!r}")

    def layer_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends through, or None (the whole context)."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window past which no layer reads a token's K/V (the KV manager frees its blocks):
        the sliding window when every layer slides, else None."""
        if self.sliding_layers is not None and len(self.sliding_layers) < self.num_hidden_layers:
            return None
        return self.sliding_window

    def with_sliding_window(self, size: int) -> ModelArchConfig:
        """MLC's ``sliding_window_size`` applied: ``-1`` turns the window off (every layer attends
        over the whole context); a positive size replaces the window of the layers that slide.
        A model with no sliding layer is refused: which layers would slide is not the config's."""
        if size == -1:
            return replace(self, sliding_window=None, sliding_layers=None)
        _positive_int("sliding_window_size", size)
        if self.sliding_window is None:
            raise ValueError(f"sliding_window_size: a {self.architecture} model with no sliding-window layers "
                             "cannot be given a window (-1 turns a model's window off)")
        if size >= self.max_position_embeddings:
            return replace(self, sliding_window=None, sliding_layers=None)
        return replace(self, sliding_window=size)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:  # noqa: C901 - a flat list of checks
        """From a parsed ``config.json``; raises ValueError naming the missing or bad field."""
        model_type = gemma_config.check_model_type(cfg.get("model_type")) or cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in _HF_INT_FIELDS:
            v = cfg.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: must be a positive integer in config.json, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = cfg.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{name}: must be a number in config.json, got {v!r}")
        try:
            hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
            # Newer configs nest rope_theta inside rope_parameters.
            rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
            theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
            rope_scaling = normalize_rope_scaling(rope)
            if model_type == "phi3":
                from sluice.engine.models.phi3 import check_hf_config

                rope_scaling = check_hf_config(cfg, rope_scaling)
            fields = dict(
                architecture=model_type,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=ARCHITECTURES[model_type].qkv_bias or bool(cfg.get("attention_bias", False)),
                sliding_window=_sliding_window(cfg, model_type),
                sliding_layers=_sliding_layers(cfg, model_type) if _sliding_window(cfg, model_type) else None,
                **_experts(cfg, model_type),
            )
            if ARCHITECTURES[model_type].gemma:
                gemma = gemma_config.hf_fields(cfg, model_type)
                gemma["rope_scaling"] = normalize_rope_scaling(gemma["rope_scaling"])
                fields.update(gemma)
            return cls(**fields)
        except KeyError as exc:
            raise ValueError(f"{exc.args[0]}: missing from config.json") from None


def _experts(cfg: dict, model_type: str) -> dict:
    """The expert fields of ``ModelArchConfig`` from config.json (``ArchTraits.moe`` says how it
    names them); KeyError for a missing one. Dense layers among sparse ones (Qwen's
    ``mlp_only_layers`` / ``decoder_sparse_step``) are refused by name."""
    moe = ARCHITECTURES[model_type].moe
    if moe is None:
        return {}
    if moe == "mixtral":
        return {"num_experts": cfg["num_local_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}
    if moe == "olmoe":
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"clip_qkv: clamping q/k/v (OLMoE's clip_qkv={cfg['clip_qkv']!r}) is not supported")
        return {"num_experts": cfg["num_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["intermediate_size"],
                "norm_topk_prob": bool(cfg.get("norm_topk_prob", False))}
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"mlp_only_layers / decoder_sparse_step: a {model_type} model with dense layers among "
                         f"its sparse ones is not supported (got mlp_only_layers={cfg.get('mlp_only_layers')!r}, "
                         f"decoder_sparse_step={cfg.get('decoder_sparse_step')!r})")
    shared = cfg.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    # The hub's Qwen configs say num_experts; transformers 5 writes Qwen3-MoE's as num_local_experts.
    experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    return {"num_experts": experts, "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "shared_expert_intermediate_size": shared or 0}
