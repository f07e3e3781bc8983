"""Read a GGUF file (llama.cpp's format) into a ``ModelArchConfig`` and HF-named float tensors.

Facts this relies on (llama.cpp's ``convert_hf_to_gguf.py``, mirrored by transformers'
``modeling_gguf_pytorch_utils.py`` when it loads a GGUF):

* numpy's view of a GGUF tensor is in PyTorch order: ``dequantize`` of a ``[in, out]`` GGUF
  tensor gives ``[out, in]``, the layout of ``torch.nn.Linear.weight``.
* For architectures whose llama.cpp RoPE is the interleaved "NORM" kind (llama, mistral) the
  converter permutes the rows of ``attn_q`` / ``attn_k`` within each head, from HF's
  rotate-half pairing ``(i, i + D/2)`` to adjacent pairs ``(2i, 2i + 1)``. We undo it
  (``unpermute_qk``) so the model uses HF's layout. Qwen2 is converted unpermuted (NEOX rope).
* The metadata keys are ``{arch}.block_count``, ``{arch}.attention.head_count`` and so on; see
  ``_arch_from_metadata``.
"""
from __future__ import annotations

import functools
import gc
import mmap
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from sluice.engine.errors import ModelLoadError
from sluice.engine.models.config import ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelArchConfig
from sluice.engine.models import gemma_config, phi3
from sluice.engine.models.moe import HF_NAMES

ProgressFn = Callable[[int, int], None]   # (tensors done, tensors total)

# llama.cpp architectures whose Q/K rows the converter permuted for interleaved RoPE (Mixtral
# is converted as a "llama" with experts).
_PERMUTED_QK = ("llama", "mistral", "mixtral")

# llama.cpp's architecture names that are not ours (general.architecture -> ModelArchConfig's);
# a "llama" with ``llama.expert_count`` is a Mixtral (``_architecture``).
_GGUF_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Whether llama.cpp renormalises the top-k expert weights when the file does not say
# (``<arch>.expert_weights_norm``): its qwen2moe and olmoe graphs do not, llama (Mixtral) and qwen3moe do.
_EXPERT_WEIGHTS_NORM = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}
# llama.cpp's expert tensors: 3-D [experts, out, in] (PyTorch order), one per projection; read
# one expert at a time under HF's per-expert names (models.moe.HF_NAMES' index into them).
_EXPERT_TENSORS = {"ffn_gate_exps.weight": 2, "ffn_up_exps.weight": 3, "ffn_down_exps.weight": 4}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",     # Qwen3's per-head norms; OLMoE's over q
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@functools.cache
def plain_array_reader():
    """gguf's ``GGUFReader`` parsing over a plain ndarray view of its memory map, with a fast path
    for metadata arrays.

    - The reader slices its ``np.memmap`` once per metadata value, and every slice of a memmap runs
      numpy's Python-level ``memmap.__array_finalize__``: a 49k-token vocabulary and its merges are
      ~250k slices, ~2.8 s of the ~2.9 s that parsing SmolLM2's header took here. Slices of a plain
      view of the same mapping are the same bytes at C speed.
    - That still left ~1.5 s, nearly all of it gguf's per-element walk of the vocabulary, merges
      and token types (a recursive call, an enum lookup and four numpy views per entry). Arrays of
      strings and of numbers are walked here instead, with ``struct`` for the lengths and one
      slice per part: ~0.2 s for the whole header.

    Fields (name, types, parts, data, contents), tensor descriptions and tensor data are equal to
    the stock reader's (tests/unit/test_gguf_reader.py); tensors are ndarray views into the mapping
    instead of memmaps. Files in the other byte order, and arrays of arrays, take gguf's own path."""
    import struct

    from gguf import GGUFReader, GGUFValueType

    array, string = int(GGUFValueType.ARRAY), int(GGUFValueType.STRING)
    length = struct.Struct("=Q")

    class PlainArrayReader(GGUFReader):
        def __init__(self, path, mode: str = "r", arrays: bool = True) -> None:
            # arrays=False: metadata arrays are walked for their size only and left out of ``fields``.
            self.skip_arrays = not arrays
            super().__init__(path, mode)
            if self.skip_arrays:
                for name in [k for k, f in self.fields.items() if f.types[:1] == [GGUFValueType.ARRAY]]:
                    del self.fields[name]

        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._plain = mapped.view(np.ndarray)   # keeps the memmap (and so the mapping) as its base

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if int(raw_type) != array or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            item = int(raw_itype[0])
            scalar = self.gguf_scalar_to_np.get(item)   # keyed by GGUFValueType, an IntEnum: ints find it
            if item != string and scalar is None:
                return super()._get_field_parts(orig_offs, raw_type)
            alen = self._get(orig_offs + 4, np.uint64)
            n, offs = int(alen[0]), orig_offs + 12
            types = [GGUFValueType.ARRAY] + ([GGUFValueType(item)] if n else [])
            buf = self._plain
            if scalar is not None:      # one [1] view per element, as gguf makes them
                size = np.dtype(scalar).itemsize
                values = buf[offs:offs + n * size].view(scalar)
                if values.shape[0] != n:
                    raise ValueError(f"array of {n} values runs past the end of the file")
                if self.skip_arrays:
                    return 12 + n * size, [raw_itype, alen], [], types
                return 12 + n * size, [raw_itype, alen, *values.reshape(n, 1)], list(range(2, 2 + n)), types
            parts, end, keep = [raw_itype, alen], buf.shape[0], not self.skip_arrays
            for _ in range(n):          # each string: its uint64 length, then its bytes
                if offs + 8 > end:
                    raise ValueError("string array runs past the end of the file")
                (size,) = length.unpack_from(buf, offs)
                if offs + 8 + size > end:
                    raise ValueError("string array runs past the end of the file")
                if keep:
                    parts.append(buf[offs:offs + 8].view(np.uint64))
                    parts.append(buf[offs + 8:offs + 8 + size])
                offs += 8 + size
            return offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)) if keep else [], types

    return PlainArrayReader


def open_gguf(path: str | Path, arrays: bool = True):
    """A ``GGUFReader`` over ``path`` (``plain_array_reader``'s); ModelLoadError when it is missing,
    truncated or not a GGUF. ``arrays=False``: the metadata arrays (the vocabulary, merges, token
    types) are skipped over and absent from ``fields``, for a caller that needs only scalars (SmolLM2's
    header then parses in a tenth of the time)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return plain_array_reader()(path, arrays=arrays)
    except Exception as exc:  # the reader raises ValueError/IndexError/... on bad bytes
        raise ModelLoadError(f"{path}: not a readable GGUF file (corrupt or truncated?): {exc}") from exc


def gguf_metadata(reader, key: str, default=None):
    """The decoded value of one metadata key (scalars as Python values, arrays as lists)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader, path: Path) -> str:
    """general.architecture (the prefix of the file's metadata keys): llama.cpp's name, which
    ``_architecture`` maps to ours."""
    arch = gguf_metadata(reader, "general.architecture")
    gguf_names = [a for a in SUPPORTED_ARCHITECTURES
                  if a != "mixtral" and a not in _GGUF_ARCHITECTURES.values()] + list(_GGUF_ARCHITECTURES)
    if arch not in gguf_names:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(gguf_names)}")
    return arch


def _architecture(reader, gguf_arch: str) -> str:
    if gguf_arch == "llama" and int(gguf_metadata(reader, "llama.expert_count", 0) or 0) > 0:
        return "mixtral"
    return _GGUF_ARCHITECTURES.get(gguf_arch, gguf_arch)


def _experts(reader, prefix: str, architecture: str, req) -> dict:
    """The expert fields of ``ModelArchConfig`` (none for a dense model)."""
    if architecture not in _EXPERT_WEIGHTS_NORM:
        return {}
    def meta(key, default=None):
        return gguf_metadata(reader, f"{prefix}.{key}", default)
    inter = meta("expert_feed_forward_length") or req("feed_forward_length")
    return {"num_experts": int(req("expert_count")), "num_experts_per_tok": int(req("expert_used_count")),
            "moe_intermediate_size": int(inter),
            "norm_topk_prob": bool(meta("expert_weights_norm", _EXPERT_WEIGHTS_NORM[architecture])),
            "shared_expert_intermediate_size": int(meta("expert_shared_feed_forward_length", 0) or 0)}


def _rope_scaling(reader, arch: str, path: Path) -> dict | None:
    kind = gguf_metadata(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = gguf_metadata(reader, f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        rs = {"rope_type": "yarn", "factor": float(factor) if factor is not None else None}
        for gguf_key, hf_key in (("original_context_length", "original_max_position_embeddings"),
                                 ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = gguf_metadata(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                rs[hf_key] = value
        return rs
    raise ModelLoadError(f"{path}: unsupported rope scaling type {kind!r} (supported: none, linear, yarn)")


ROPE_FREQS = "rope_freqs.weight"


def _rope_freqs(reader, path: Path) -> dict | None:
    """Llama 3.1/3.2 files carry their RoPE scaling as per-frequency divisors (``rope_freqs``)."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    if tensor.tensor_type.name != "F32":
        raise ModelLoadError(f"{path}: {ROPE_FREQS} is {tensor.tensor_type.name}, expected F32")
    return {"rope_type": "factors", "factors": tuple(float(f) for f in np.asarray(tensor.data).reshape(-1))}


def _longrope(reader, arch: str, path: Path) -> dict | None:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: ``rope_factors_long`` / ``_short``
    tensors (F32, head_dim / 2 each), ``<arch>.rope.scaling.original_context_length`` and the
    attention factor ``<arch>.rope.scaling.attn_factor``; None when the file has no factors."""
    tensors = {t.name: t for t in reader.tensors if t.name in phi3.GGUF_ROPE_FACTORS}
    if not tensors:
        return None
    if len(tensors) != len(phi3.GGUF_ROPE_FACTORS):
        raise ModelLoadError(f"{path}: LongRoPE needs both {' and '.join(phi3.GGUF_ROPE_FACTORS)}, "
                             f"found only {', '.join(tensors)}")
    rs = {"rope_type": "longrope"}
    for name, key in phi3.GGUF_ROPE_FACTORS.items():
        if tensors[name].tensor_type.name != "F32":
            raise ModelLoadError(f"{path}: {name} is {tensors[name].tensor_type.name}, expected F32")
        rs[key] = tuple(float(f) for f in np.asarray(tensors[name].data).reshape(-1))
    original = gguf_metadata(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"{path}: LongRoPE factors without {arch}.rope.scaling.original_context_length")
    rs["original_max_position_embeddings"] = int(original)
    attn_factor = gguf_metadata(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        rs["attention_factor"] = float(attn_factor)
    return rs


def _check_rotary_dims(reader, arch: str, head_dim: int, path: Path) -> None:
    """llama.cpp's ``rope.dimension_count`` below head_dim is partial rotary (Phi-4-mini): refused."""
    dims = gguf_metadata(reader, f"{arch}.rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        raise ModelLoadError(f"{path}: {arch}.rope.dimension_count: RoPE over {dims} of each head's {head_dim} "
                             "dimensions (partial_rotary_factor) is not supported")


def _arch_from_metadata(reader, path: Path) -> ModelArchConfig:
    arch = gguf_architecture(reader, path)          # the metadata keys' prefix
    architecture = _architecture(reader, arch)
    names = {t.name for t in reader.tensors}

    def req(key: str):
        value = gguf_metadata(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    vocab = gguf_metadata(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    head_dim = gguf_metadata(reader, f"{arch}.attention.key_length") or hidden // heads
    _check_rotary_dims(reader, arch, int(head_dim), path)
    try:
        gemma = {}
        if ARCHITECTURES[architecture].gemma:
            gemma = gemma_config.gguf_fields(
                lambda key, default=None: gguf_metadata(reader, f"{arch}.{key}", default), architecture,
                int(req("block_count")), hidden, heads, int(head_dim), int(req("context_length")))
        fields = dict(
            architecture=architecture,
            vocab_size=int(vocab) if vocab is not None else 0,
            hidden_size=hidden,
            intermediate_size=int(req("feed_forward_length")),
            num_hidden_layers=int(req("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(gguf_metadata(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
            rope_theta=float(gguf_metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(req("context_length")),
            rope_scaling=_rope_freqs(reader, path) or _longrope(reader, arch, path) or _rope_scaling(reader, arch, path),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            sliding_window=_sliding_window(reader, arch),
            **_experts(reader, arch, architecture, req),
        )
        return ModelArchConfig(**{**fields, **gemma})
    except ValueError as exc:
        raise ModelLoadError(f"{path}: bad model metadata: {exc}") from exc


def _sliding_window(reader, arch: str) -> int | None:
    """llama.cpp's ``<arch>.attention.sliding_window``, for every layer; None when absent or when
    it spans the whole context (a window of 0 is none, as llama.cpp reads it)."""
    window = gguf_metadata(reader, f"{arch}.attention.sliding_window")
    if window is None or int(window) == 0:
        return None
    window = int(window)
    return window if window < int(gguf_metadata(reader, f"{arch}.context_length", 0) or 0) else None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows of each head from (D/2, 2) order back to (2, D/2).

    w is [n_head * D, ...] (a weight or a bias); the converter did
    ``w.reshape(n_head, 2, D/2, ...).swapaxes(1, 2)``, so we reshape to (n_head, D/2, 2, ...)
    and swap back.
    """
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _moe_layer_names(moe: str | None) -> dict[str, str]:
    """The router's and the shared expert's names (``ArchTraits.moe``; none for a dense model)."""
    if moe is None:
        return {}
    mlp, router = HF_NAMES[moe][:2]
    return {"ffn_gate_inp.weight": f"{mlp}{router}.weight",
            "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
            "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
            "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
            "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}


def hf_name(gguf_name: str, path: Path, moe: str | None = None, fused: bool = False, gemma: bool = False) -> str:
    """``fused``: the architecture's checkpoints hold q/k/v and gate/up fused (``ArchTraits.fused``,
    Phi-3's ``attn_qkv`` and ``ffn_up``); ``gemma``: Gemma's four norms a layer."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    names = {**_LAYER_NAMES, **_moe_layer_names(moe), **(phi3.GGUF_LAYER_NAMES if fused else {}),
             **(gemma_config.GGUF_LAYER_NAMES if gemma else {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    raise ModelLoadError(f"{path}: unexpected tensor {gguf_name!r} for a Llama-family model")


def _expert_names(tensor, moe: str | None, path: Path) -> list[str] | None:
    """HF's per-expert names for the experts of a 3-D ``ffn_*_exps`` tensor, in expert order;
    None for any other tensor."""
    parts = tensor.name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _EXPERT_TENSORS:
        return None
    if moe is None or len(tensor.shape) != 3:
        raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r} (shape {tuple(tensor.shape)}) "
                             "for a model without 3-D experts")
    mlp, proj = HF_NAMES[moe][0], HF_NAMES[moe][_EXPERT_TENSORS[parts[2]]]
    return [f"model.layers.{parts[1]}.{mlp}experts.{e}.{proj}.weight" for e in range(int(tensor.shape[2]))]


class _Expert:
    """One expert's slice of a 3-D GGUF expert tensor, read like a 2-D tensor (``name``, ``tensor_type``,
    ``shape`` in GGUF order, ``data``: the expert's rows, as stored)."""

    def __init__(self, tensor, index: int) -> None:
        self.name, self.tensor_type = f"{tensor.name}[{index}]", tensor.tensor_type
        self.shape = tensor.shape[:2]
        self._tensor, self._index = tensor, index

    @property
    def data(self) -> np.ndarray:
        return np.asarray(self._tensor.data)[self._index]


def _dequantized(tensor, arch: ModelArchConfig, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        # np.asarray drops the np.memmap subclass, whose per-slice bookkeeping doubles the time.
        w = dequantize(np.asarray(tensor.data), tensor.tensor_type)   # float32, PyTorch order
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r}: {exc}") from exc
    if arch.architecture in _PERMUTED_QK:
        if ".attn_q." in tensor.name:
            w = unpermute_qk(w, arch.num_attention_heads)
        elif ".attn_k." in tensor.name:
            w = unpermute_qk(w, arch.num_key_value_heads)
    # F32 tensors come back as read-only views of the memory map; torch wants writable memory.
    return w if w.flags.writeable else w.copy()


# GGUF block types that models.quant and models.kquant read as stored (no float32 round trip).
RAW_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K")


def _raw_blocks(tensor, arch: ModelArchConfig) -> torch.Tensor:
    """[rows, bytes per row] uint8 blocks of a block-quantized tensor, Q/K rows unpermuted: a
    row's blocks run along the input, so undoing the row permutation moves whole rows of blocks.
    Not a copy where no rows move: a read-only view of the file's mapping, which every consumer
    (the C++ packers, the int4 and int8 converters, a tensor-parallel slice) reads once into
    tensors of its own; copying it first cost ~0.5 s a GB of load."""
    data = np.asarray(tensor.data)
    if arch.architecture in _PERMUTED_QK:
        if ".attn_q." in tensor.name:
            data = unpermute_qk(data, arch.num_attention_heads)
        elif ".attn_k." in tensor.name:
            data = unpermute_qk(data, arch.num_key_value_heads)
    data = np.ascontiguousarray(data)
    if data.flags.writeable:
        return torch.from_numpy(data)
    with warnings.catch_warnings():   # torch warns that it cannot mark the tensor read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _check_size(tensor, path: Path) -> None:
    """A truncated file maps fewer bytes than the header promises; say so by name."""
    expected = int(tensor.n_bytes)
    got = int(tensor.data.nbytes)
    if got != expected:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} is truncated: {got} of {expected} bytes")


class GGUFWeights(Mapping):
    """HF name → float32 tensor, dequantized on access so that peak memory is the model plus one tensor.

    Every tensor's name and byte size are checked up front, so a bad file fails before any work.
    """

    def __init__(self, reader, arch: ModelArchConfig, path: Path, progress: ProgressFn | None = None) -> None:
        self._arch, self._path, self._progress = arch, path, progress
        self._tensors = {}
        for tensor in reader.tensors:
            _check_size(tensor, path)
            if tensor.name == ROPE_FREQS or tensor.name in phi3.GGUF_ROPE_FACTORS:
                continue                         # part of the architecture (_rope_freqs, _longrope), not weights
            traits = ARCHITECTURES[arch.architecture]
            moe = traits.moe
            experts = _expert_names(tensor, moe, path)
            if experts is not None:
                self._tensors.update((name, _Expert(tensor, e)) for e, name in enumerate(experts))
                continue
            self._tensors[hf_name(tensor.name, path, moe, traits.fused, traits.gemma)] = tensor
        # llama.cpp stores Gemma's norm weights with 1 added (gemma_config.GGUF_NORM_OFFSET); taken
        # off here, so that both loaders give transformers' values.
        self._norm_offset = gemma_config.GGUF_NORM_OFFSET if ARCHITECTURES[arch.architecture].gemma else 0.0
        self._done = 0
        self._mapping = _file_mapping(reader)
        self._read: list[tuple[int, int]] = []     # file ranges handed out since the last release_read

    def __getitem__(self, name: str) -> torch.Tensor:
        self._note_read(name)
        w = torch.from_numpy(_dequantized(self._tensors[name], self._arch, self._path))
        if self._norm_offset and name.endswith("norm.weight"):
            w = w - self._norm_offset
        self._advance()
        return w

    def _advance(self) -> None:
        self._done += 1
        if self._progress is not None:
            self._progress(min(self._done, len(self._tensors)), len(self._tensors))

    def tensor_type(self, name: str) -> str:
        """The GGML type name of a tensor as stored (``Q4_1``, ``Q8_0``, ``F32``...)."""
        return self._tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """PyTorch-order shape ([out, in] for a weight)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """``(type, raw blocks [rows, bytes per row] uint8)`` for a ``RAW_BLOCK_TYPES`` tensor, None
        for any other type (read it dequantized through ``self[name]``)."""
        tensor = self._tensors[name]
        kind = tensor.tensor_type.name
        if kind not in RAW_BLOCK_TYPES:
            return None
        self._note_read(name)
        raw = _raw_blocks(tensor, self._arch)
        self._advance()
        return kind, raw

    def _note_read(self, name: str) -> None:
        tensor = self._tensors[name]
        if isinstance(tensor, _Expert):                       # its slice of the stacked experts
            whole = tensor._tensor
            size = int(whole.n_bytes) // int(np.asarray(whole.data).shape[0])
            self._read.append((int(whole.data_offset) + tensor._index * size, size))
        else:
            self._read.append((int(tensor.data_offset), int(tensor.n_bytes)))

    def release_read(self) -> None:
        """Unmap the file pages of the tensors read since the last call (``madvise(MADV_DONTNEED)``
        over each one's whole pages), once the model has built its own weights from them: a
        mapped page counts in the process's RSS for as long as it stays mapped, so a load holding
        them all until its end peaked at the file plus its packed weights. The pages stay in the
        page cache, and a later read of the same bytes (a view a weight kept) maps them again:
        nothing is lost, the peak is a layer's pages over the weights. A no-op without the mapping."""
        read, self._read = self._read, []
        if self._mapping is None:
            return
        page = mmap.PAGESIZE
        for offset, size in read:
            start, end = -(-offset // page) * page, (offset + size) // page * page
            if end > start:
                self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read (dequantize) the tensor just to test membership.
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _file_mapping(reader) -> mmap.mmap | None:
    """The ``mmap`` under the reader's memmap, where there is one and it can be advised."""
    base = reader.data
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    mapping = getattr(base, "_mmap", None)
    return mapping if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED") else None


def drop_vocabulary(reader) -> None:
    """Forget the reader's ``tokenizer.ggml.*`` arrays once the tokenizer is built. gguf's reader
    holds every vocabulary entry and merge as numpy views of its own (~160 MiB of small objects for
    a 49k vocabulary); freed before the model's weights are built, their memory is reused instead
    of staying resident in fragments (~17 MiB for the default model)."""
    for key in [k for k in reader.fields if k.startswith("tokenizer.ggml.")]:
        del reader.fields[key]
    gc.collect()


def load_gguf(path: str | Path, progress: ProgressFn | None = None) -> tuple[ModelArchConfig, GGUFWeights, object]:
    """``(arch, lazy HF-named float32 weights, reader)``; the reader is kept for the tokenizer."""
    path = Path(path)
    reader = open_gguf(path)
    arch = _arch_from_metadata(reader, path)
    return arch, GGUFWeights(reader, arch, path, progress), reader
