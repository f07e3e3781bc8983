"""Rotary position embedding, with the rope-scaling variants a ``config.json`` may declare.

Layout: Hugging Face's "rotate_half" (GPT-NeoX) layout, where dimension ``i`` pairs with
``i + head_dim/2``. GGUF files store Q/K permuted for llama.cpp's interleaved layout; the GGUF
loader undoes that, so this module only ever sees the HF layout.

The inverse frequencies follow the maths of transformers' ``ROPE_INIT_FUNCTIONS`` (default,
linear, dynamic, yarn, llama3); ``tests/unit/test_rope.py`` holds each against transformers.

Dynamic NTK: transformers recomputes the frequencies whenever a batch runs past the cached
length, which changes the rotation of keys already in a KV cache. A paged cache must rotate a
position the same way for its whole life, so here the frequencies are fixed once, at
``max(max_seq_len, max_position_embeddings)``: identical to transformers for any sequence that
fits ``max_position_embeddings``, and a fixed NTK stretch beyond it.
"""
from __future__ import annotations

import math

import torch

from sluice.engine.models.config import ModelArchConfig


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    # [dim // 2] float32; int64 arange then float, as transformers does, for identical rounding.
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def _linear(arch: ModelArchConfig, rs: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(arch.rope_theta, arch.head_dim) / rs["factor"], 1.0


def _dynamic(arch: ModelArchConfig, rs: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    dim, mpe, factor = arch.head_dim, arch.max_position_embeddings, rs["factor"]
    seq_len = max(seq_len or mpe, mpe)
    base = arch.rope_theta * ((factor * seq_len / mpe) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(rs: dict, factor: float) -> float:
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_correction_range(rs: dict, dim: int, base: float, original: int) -> tuple[float, float]:
    """The band of dimensions that blends interpolation and extrapolation (YaRN paper, eq. 17)."""
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_for(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(arch: ModelArchConfig, rs: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    dim, base = arch.head_dim, arch.rope_theta
    original = rs.get("original_max_position_embeddings", arch.max_position_embeddings)
    factor = rs.get("factor")
    if factor is None:
        factor = arch.max_position_embeddings / original
    attention_factor = _yarn_attention_factor(rs, factor)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)      # [dim // 2]
    low, high = _yarn_correction_range(rs, dim, base, original)
    if low == high:
        high += 0.001  # avoids a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp                                           # [dim // 2]
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def _llama3(arch: ModelArchConfig, rs: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(arch.rope_theta, arch.head_dim)
    factor, low_ff, high_ff = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _factors(arch: ModelArchConfig, rs: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """GGUF's ``rope_freqs``: the base frequencies divided by one factor each (llama.cpp's form of
    Llama 3's scaling: the factors are base / llama3 frequencies)."""
    factors = torch.tensor(rs["factors"], dtype=torch.float32)
    if factors.numel() != arch.head_dim // 2:
        raise ValueError(f"rope_scaling.factors: {factors.numel()} factors for head_dim {arch.head_dim} "
                         f"(expected {arch.head_dim // 2})")
    return _base_inv_freq(arch.rope_theta, arch.head_dim) / factors, 1.0


def _longrope(arch: ModelArchConfig, rs: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE (transformers' ``_compute_longrope_parameters``): the base frequencies
    divided by the short or the long factors. The long ones when the context the model is built
    for (``seq_len``, else max_position_embeddings) exceeds original_max_position_embeddings,
    fixed for the model's life (``models.phi3`` says why); cos/sin scaled by the attention factor,
    sqrt(1 + ln(factor) / ln(original)) unless given, factor = max_position / original unless given."""
    dim, original = arch.head_dim, rs["original_max_position_embeddings"]
    factor = rs.get("factor") or arch.max_position_embeddings / original
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    context = seq_len or arch.max_position_embeddings
    key = "long_factor" if context > original else "short_factor"
    ext = torch.tensor(rs[key], dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise ValueError(f"rope_scaling.{key}: {ext.numel()} factors for head_dim {dim} (expected {dim // 2})")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim                   # [dim // 2]
    return 1.0 / (ext * arch.rope_theta ** shape), float(attention_factor)


_SCALED = {"longrope": _longrope, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3, "factors": _factors}


def compute_inv_freq(arch: ModelArchConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32, attention_scaling)`` for ``arch.rope_scaling``."""
    rs = arch.rope_scaling
    if rs is None or rs["rope_type"] == "default":
        return _base_inv_freq(arch.rope_theta, arch.head_dim), 1.0
    return _SCALED[rs["rope_type"]](arch, rs, seq_len)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin from positions on the fly (no table: O(T * head_dim) per step, exact like HF)."""

    def __init__(
        self, arch: ModelArchConfig, max_seq_len: int | None = None, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(arch, max_seq_len)
        # [head_dim // 2] float32 whatever the model dtype: bf16 frequencies would misplace far positions.
        # (A later ``model.to(bf16)`` would cast it too: move models with ``.to(device)`` only.)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → (cos, sin), each [T, 1, head_dim // 2] in ``dtype``, ready to broadcast over heads.

        On the CPU the rows come from a table of every position so far (grown by doubling, one
        table per dtype): two lookups instead of six element-wise ops a step. The table's rows
        are computed by the same ops over ``arange``, and torch's vectorised cos/sin give an
        element the same bits wherever it sits in the tensor, so the values are the same."""
        if positions.device.type == "cpu" and self.inv_freq.device.type == "cpu" and positions.numel():
            cos, sin = self._cpu_table(int(positions.max()) + 1, dtype)
            return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]
        return self._compute(positions, dtype)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, head_dim // 2]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def _cpu_table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self.__dict__.setdefault("_tables", {})
        have = tables.get(dtype)
        if have is None or have[0].shape[0] < length:
            size = max(256, 1 << (length - 1).bit_length())
            cos, sin = self._compute(torch.arange(size), dtype)
            have = tables[dtype] = (cos[:, 0, :].contiguous(), sin[:, 0, :].contiguous())
        return have


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D/2] → rotated x [T, H, D] (rotate_half layout).

    Equal, element for element, to HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_keys(k: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys rotated for position p, [..., H, D] -> the same keys rotated for p + ``delta``.

    Rotations compose (R(p + d) = R(d) R(p)), so this is exact up to rounding for every rope whose
    cos/sin are not scaled (``sink_rotation`` refuses the others). ``k`` is a scratch copy the
    caller gives up: float32 keys are rotated in place (a third of the time of ``apply_rotary``'s
    temporaries on the CPU), others in a float32 copy. Attention sinks use it when the cache drops
    blocks (``ModelRunner.shift_keys``)."""
    x = k if k.dtype == torch.float32 else k.float()
    freqs = float(delta) * inv_freq.to(device=k.device, dtype=torch.float32)  # [D/2], broadcast
    cos, sin = freqs.cos(), freqs.sin()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    first = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1)      # x1 cos - x2 sin
    x2.mul_(cos).addcmul_(first, sin)             # x2 cos + x1 sin
    return x if x.dtype == k.dtype else x.to(k.dtype)


def sink_rotation(model: torch.nn.Module) -> torch.Tensor:
    """The inverse frequencies [head_dim // 2] that re-rotate ``model``'s cached keys for attention
    sinks, or ValueError naming ``attention_sink_size`` when a re-rotation would not give the keys
    that position computes: cos/sin scaled by an attention factor (YaRN, LongRoPE: a second
    rotation would apply it twice), a second RoPE for some layers (Gemma 3's local one), or no
    RoPE module at all."""
    rotary = getattr(model, "rotary", None)
    if not isinstance(rotary, RotaryEmbedding):
        raise ValueError(f"attention_sink_size: {type(model).__name__} has no RoPE to re-rotate its keys with")
    if getattr(model, "local_rotary", None) is not None:
        raise ValueError("attention_sink_size: a model with a second RoPE for its local layers (Gemma 3) "
                         "is not supported")
    if rotary.attention_scaling != 1.0:
        rope_type = (getattr(getattr(model, "arch", None), "rope_scaling", None) or {}).get("rope_type")
        raise ValueError(f"attention_sink_size: the model's RoPE ({rope_type}) scales cos/sin by "
                         f"{rotary.attention_scaling:g}, so re-rotating cached keys would not compose")
    return rotary.inv_freq
