"""A checkpoint's tensors into one of ``models.quant``'s weight formats, at load time.

GGUF Q4_0 / Q4_1 / Q8_0 projections go straight from their blocks into the w4a8 / w8a8 / int4
layouts, and a Q8_0 embedding is kept as stored. In w8a8 the K-quants (Q4_K, Q5_K, Q6_K) and
5-bit blocks (Q5_0, Q5_1), the 4-bit grid types (IQ4_NL, IQ4_XS), Q3_K (its values in 4-bit
fields) and Q2_K are kept as stored too (``models.kquant``), projections, LM head and embedding alike,
tensor by tensor in a file that mixes them (a fused q/k/v or gate/up whose parts differ in type
is a ``kquant.StackedLinear``); w4a8 keeps Q2_K, Q3_K, Q4_K, IQ4_NL and IQ4_XS as stored. Every other tensor is
read one at a time as float32 (dequantized by gguf, or from safetensors) and quantized, so the
load never holds a float32 copy of the model: in w8a8 that is how the other IQ types,
TQ1_0 / TQ2_0, MXFP4 and NVFP4 are held (``_ROUNDED_TYPES``: 8-bit blocks of 32, Q8_0's rule),
an untied table of these types as int8 blocks, and a tied one as its LM head's blocks.

``auto`` (``resolve_quantization``) picks the fastest format that keeps the precision the file
has, judged by the types of its projection weights:

* not on CPU: ``none`` (these formats have CPU kernels only);
* with sluice's C++ kernels built (``kernels.cpu_ext``) and vectorized for this CPU (AVX512-VNNI
  or AVX2; ``cpu_blockq.isa()``): every projection Q4_0 / Q4_1: ``w4a8``,
  every projection Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_NL /
  IQ4_XS (any mix: the files llama.cpp's ``_K_M`` / ``_K_S`` / ``Q2_K`` / ``IQ4_XS`` presets write): ``w8a8``. Both keep the file's blocks as stored
  (values and float16 scales), the LM head's too, and round activations to int8 per block of 32
  (llama.cpp rounds them per 32 for these, and per 256, Q8_K, for K-quants: ours is finer;
  perplexity +0.2-0.3% on SmolLM2, bench/README.md); they are 4-7x float32's decode rate here;
* with those kernels, every projection one of the above or one of ``_ROUNDED_TYPES`` (the IQ
  types but IQ4_NL / IQ4_XS, TQ1_0 / TQ2_0, MXFP4, NVFP4: llama.cpp's IQ3_XXS / IQ2_XXS...
  presets, which mix them with the types above): ``w8a8``, the types above as stored and these
  rounded to 8-bit blocks of 32. They hold 2-4 bits of precision a value, and the rounding is
  far below the file's own error: on SmolLM2 re-quantized from its Q4_1 file by llama-quantize,
  the RMS weight change is 1-4% of the file's own change from Q4_1, and it moves the logits by
  1-4% as much as that re-quantization did (5-11% with the int8 rounding of activations that
  every block format has; bench/README.md, "Other GGUF block types through w8a8"). Float32
  held them at 4x the bytes, at a third of w8a8's decode rate;
* without them (or with only their portable C++ loop, slower than float32: 1.2 ms against
  0.37 ms for a 3072x576 product at one row on an AVX2 CPU), every projection Q4_0 / Q4_1:
  ``int4`` (the file's own 4-bit values and its float16 scales rounded to bfloat16). Its LM
  head is int8 whatever the file (torch has no kernel for per-block scales): SmolLM2's Q8_0 head re-rounded that way is part of the measured
  int4 error, which is still under int8's (mean |logit change| 0.07, perplexity -0.2%);
* anything else (float16, bfloat16, float32 anywhere among the projections; and any block type
  but Q4_0 / Q4_1 without the kernels): ``none``, dequantized to float32 at load. int8 re-rounds each
  weight to a per-row scale (coarser than Q8_0's per-32 blocks), and measured on SmolLM2-135M
  that is not negligible: mean |logit change| 0.19 against 0.05 for the bfloat16 rounding of
  activations alone (bf16), and the top token changed on 5% of positions (bench/README.md).
  bf16 keeps a bfloat16 file's bits, but is slower than float32 from 4 rows up on a CPU
  without AVX512-BF16, so auto does not take it either; ask for int8 or bf16 by name. Without
  AVX-512 at all (AVX2 CPUs) oneDNN has no bfloat16, and bf16 is refused with that reason.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sluice.engine.config import QUANTIZATIONS
from sluice.engine.errors import ModelLoadError
from sluice.engine.models import kquant, quant
from sluice.engine.models.llama import _take

QUANTIZED = ("bf16", "int8", "int4", "w8a8", "w4a8")
_LOSSLESS_INT4 = frozenset({"Q4_0", "Q4_1"})
# Held as stored by w8a8 (the 4-bit ones, and Q4_K, by w4a8 too).
_BLOCK_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", *kquant.KQUANT_TYPES})
# Block types with at most 4 bits of precision per value (grids of 16 levels or fewer, or
# ternary) that sluice has no kernel for: w8a8 rounds them to 8-bit blocks of 32 from gguf's
# float32, one tensor at a time. That moves a weight by at most 1/254 of its 32-block's largest
# value, where these grids step by 1/15 or more of their (sub-)block's largest, so the file's
# precision is kept (a 16-value sub-block scaled far below its neighbour loses more; measured on
# SmolLM2's files, a 32-block's rounding error was at most 17% of the block's own error from the
# file it was quantized from, median 0-4%: bench/README.md, "Other GGUF block types through
# w8a8"). Listed by name, not by bits per weight: a type gguf learns later stays float32 until
# measured.
_ROUNDED_TYPES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                            "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4"})
# The kquant types w4a8 keeps as stored too (4-bit values); it rounds the others to 4-bit blocks.
_FOUR_BIT_KQUANT = frozenset({"Q2_K", "Q3_K", "Q4_K", "IQ4_NL", "IQ4_XS"})
_PROJECTIONS = ("_proj.weight",)


def check_quantization(quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError naming ``quantization`` when the format cannot run here."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization in QUANTIZED and device.type != "cpu":
        raise ValueError(f"quantization: {quantization} runs on CPU only (device is {device}); "
                         "use quantization=none on CUDA")
    if quantization in QUANTIZED and dtype != torch.float32:
        raise ValueError(f"quantization: {quantization} keeps activations in float32; "
                         f"it needs dtype float32 (or auto), got {str(dtype).removeprefix('torch.')}")
    if quantization == "bf16" and (reason := quant.bf16_unavailable_reason()) is not None:
        raise ValueError(f"quantization: {reason}; use w4a8, w8a8, int4, int8 or none")
    if quantization in quant.BLOCK_FORMATS:
        from sluice.kernels import cpu_ext

        if not cpu_ext.available():
            raise ValueError(f"quantization: {quantization} needs the block-quantized CPU kernels, which "
                             f"could not be built here ({cpu_ext.unavailable_reason()}); "
                             "use int4, int8 or none")


def projection_types(weights) -> set[str]:
    """Storage types of a checkpoint's projection weights (``Q4_1``, ``Q8_0``, ``F16``, ``BF16``...)."""
    kind = getattr(weights, "tensor_type", None)
    if kind is None:
        return {"unknown"}
    return {kind(name) for name in weights if name.endswith(_PROJECTIONS)}


def resolve_quantization(quantization: str, weights, device: torch.device) -> str:
    """The concrete format for ``quantization`` (``auto`` decided by the rule in this module's doc)."""
    if quantization != "auto":
        return quantization
    if device.type != "cpu":
        return "none"
    types = projection_types(weights)
    from sluice.kernels import cpu_blockq

    if types and types <= _BLOCK_TYPES | _ROUNDED_TYPES and cpu_blockq.vectorized():
        return "w4a8" if types <= _LOSSLESS_INT4 else "w8a8"
    return "int4" if types and types <= _LOSSLESS_INT4 else "none"


class Quantizer:
    """What ``LlamaForCausalLM.load_hf_weights`` asks for to build its weights in ``fmt``."""

    def __init__(self, fmt: str) -> None:
        if fmt not in QUANTIZED:
            raise ValueError(f"quantization: no quantized format {fmt!r}")
        self.fmt = fmt

    def linear(self, weights, parts: list[tuple[str, tuple[int, int]]]):
        """One projection from its HF parts, stacked by rows (fused q/k/v, gate/up)."""
        if self.fmt in quant.BLOCK_FORMATS:
            return _stack([self._block(weights, name, shape, quant.BLOCK_FORMATS[self.fmt]) for name, shape in parts])
        if self.fmt == "int4":
            pieces = [self._int4(weights, name, shape) for name, shape in parts]
            return quant.Int4Linear(*(torch.cat(p) for p in zip(*pieces)))
        if self.fmt == "int8":
            # Per-row scales: quantizing each part is quantizing the stacked matrix.
            pieces = [quant.quantize_rows_int8(_float(weights, name, shape)) for name, shape in parts]
            return quant.Int8Linear(torch.cat([q for q, _ in pieces]), torch.cat([s for _, s in pieces]))
        return quant.Bf16Linear(torch.cat([_float(weights, name, shape).to(torch.bfloat16) for name, shape in parts]))

    def head(self, weights, name: str, shape: tuple[int, int]):
        if self.fmt in quant.BLOCK_FORMATS:
            return _stack([self._block(weights, name, shape, 8)])
        return quant.HEAD_CLASSES[self.fmt].from_float(_float(weights, name, shape))

    def embedding(self, weights, name: str, shape: tuple[int, int], tied_head=None):
        """The token embedding as stored, or None (keep float32 rows): a tied block head holding a
        block-typed table serves the lookups from its blocks (``TiedBlockEmbedding``); else a Q8_0
        table is kept as int8 blocks, and, in the block formats, a K-quant, 5-bit, Q4_0 or Q4_1 one
        as stored and one of the ``_ROUNDED_TYPES`` as int8 blocks of 32 (Q8_0's rounding, as its head's)."""
        kind = _stored_type(weights, name)
        block = self.fmt in quant.BLOCK_FORMATS
        held = tied_head is not None and block and isinstance(tied_head, (quant.BlockQLinear, kquant.KQuantLinear))
        # The head holds the table as stored (Q4_0 / Q4_1 / Q8_0 in 8-bit blocks, K-quants, 5-bit),
        # or rounded to 8-bit blocks from a type of at most ~4 bits (_ROUNDED_TYPES): either way
        # lookups may read it, and the table is held once. (A float table stays float32 rows: an
        # 8-bit head is a rounding of it that the file does not have.)
        if held and kind in _BLOCK_TYPES | _ROUNDED_TYPES:
            return quant.TiedBlockEmbedding(tied_head)
        if kind == "Q8_0":
            return quant.embedding_from_q8_0(_raw(weights, name, shape)[1], shape)
        if kind in kquant.KQUANT_TYPES and block:
            return quant.TiedBlockEmbedding(kquant.KQuantLinear.from_gguf(*_raw(weights, name, shape), shape),
                                            owned=True)
        if kind in quant.BLOCK_BITS and block:      # Q4_0 / Q4_1: 4-bit blocks as stored (~7x smaller than float32)
            return quant.TiedBlockEmbedding(quant.BlockQLinear.from_gguf([_raw(weights, name, shape)], 4, shape[1]),
                                            owned=True)
        if kind in _ROUNDED_TYPES and block:
            # an untied table in one of these types: as float32 rows it would be ~9x its file bytes (2 GiB for a
            # 128k x 4096 table), as int8 blocks of 32 ~2.6x.
            return quant.embedding_from_float(_float(weights, name, shape))
        return None

    def _block(self, weights, name: str, shape: tuple[int, int], bits: int):
        """(format, parts) of one tensor in a block format: K-quants, 5-bit and IQ4 blocks as stored
        (w4a8: the 3- and 4-bit ones only), Q4_0 / Q4_1 / Q8_0 as stored in ``bits``-bit blocks where they fit,
        anything else rounded to ``bits``-bit blocks from float32."""
        kind = _stored_type(weights, name)
        if kind in kquant.KQUANT_TYPES and (bits == 8 or kind in _FOUR_BIT_KQUANT):
            return kind, _raw(weights, name, shape)[1]       # raw blocks: decoded a slice at a time
        if kind in quant.BLOCK_BITS and quant.BLOCK_BITS[kind] <= bits:
            return bits, _GgufBlocks(*_raw(weights, name, shape))   # packed from the bytes by _stack
        return bits, quant.float_to_block(_float(weights, name, shape), bits)

    def _int4(self, weights, name: str, shape: tuple[int, int]) -> quant.Int4Parts:
        raw = _raw(weights, name, shape)
        if raw is not None and raw[0] in quant.RAW_INT4:
            return quant.RAW_INT4[raw[0]](raw[1], shape)
        return quant.float_to_int4(_float(weights, name, shape))


class _GgufBlocks(NamedTuple):
    """A GGUF Q4_0 / Q4_1 / Q8_0 tensor's bytes [rows, bytes per row], packed by ``_stack``."""
    kind: str
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's [N, K] (gguf's block sizes)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.kind]]
        return self.blocks.shape[0], self.blocks.shape[1] // nbytes * per_block


def _stack(pieces: list):
    """Block weights from (format, parts or raw K-quant blocks) per HF part, stacked by rows: parts in the same format
    are one weight, a projection whose parts differ in format a ``kquant.StackedLinear``."""
    groups: list[tuple[object, list]] = []
    for fmt, parts in pieces:
        if groups and groups[-1][0] == fmt:
            groups[-1][1].append(parts)
        else:
            groups.append((fmt, [parts]))
    made = []
    for fmt, group in groups:
        if isinstance(fmt, int) and all(isinstance(p, _GgufBlocks) for p in group):
            made.append(quant.BlockQLinear.from_gguf(list(group), fmt, group[0].shape[1]))
        elif isinstance(fmt, int):   # some parts rounded from float: every part as (u, d, m)
            parts = [quant.block_parts(p.kind, p.blocks, p.shape, fmt) if isinstance(p, _GgufBlocks) else p
                     for p in group]
            made.append(quant.BlockQLinear(*[torch.cat(p) for p in zip(*parts)], fmt))
        else:   # K-quant blocks [rows, bytes per row]: the same bytes per row in one format, packed where they lie
            k = group[0].shape[1] // kquant._BLOCK[fmt][1] * kquant._BLOCK[fmt][0]
            raw = group[0] if len(group) == 1 else list(group)
            made.append(kquant.KQuantLinear.from_gguf(fmt, raw, (sum(p.shape[0] for p in group), k)))
    return made[0] if len(made) == 1 else kquant.StackedLinear(made)


def _stored_type(weights, name: str) -> str | None:
    kind = getattr(weights, "tensor_type", None)
    return kind(name) if kind is not None and name in weights else None


def _float(weights, name: str, shape) -> torch.Tensor:
    return _take(weights, name, shape).to(torch.float32)


def _raw(weights, name: str, shape) -> tuple[str, torch.Tensor] | None:
    """(type, blocks) of a GGUF tensor stored in one of the block types read as stored, else None."""
    blocks = getattr(weights, "blocks", None)
    if blocks is None or name not in weights:
        return None
    got = weights.shape(name)
    if tuple(got) != tuple(shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(shape)}")
    return blocks(name)
