"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flattened varlen batch.

RMSNorm → fused QKV projection (+ optional bias, Qwen2) → RoPE → attention through the
backend (which owns the paged KV cache) → output projection; RMSNorm → fused gate/up
projection → SwiGLU → down projection. Q/K/V and gate/up are each one matmul: on a
bandwidth-bound CPU, fewer and larger matmuls are faster.

Weights arrive under Hugging Face names (``model.layers.N.self_attn.q_proj.weight``...) from
either loader; ``load_hf_weights`` checks every shape, fuses, and names what is wrong.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from sluice.engine import envs
from sluice.engine.attention.base import AttentionBackend, AttentionMetadata, KVCache, row_prefixes
from sluice.engine.errors import ModelLoadError
from sluice.engine.models import kquant, quant
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.models.rope import RotaryEmbedding, apply_rotary


# The row count oneDNN lays packed weights out for. Measured on 2 EPYC cores (float32, 30
# matrices of 3456x576 streamed from memory): packed with this hint the product ran 2.2x faster
# than F.linear at 1 row, 2.9x at 8, 2.2x at 32 and 1.4x at 512 rows.
_CPU_PACK_ROWS_HINT = 32


def cpu_packing_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] float32 weight reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _CPU_PACK_ROWS_HINT)


# oneDNN (and ideep in front of it) build and cache one JIT-compiled primitive per input shape:
# about 0.5-1 MB and 1.5 ms each, in two LRU caches of 1024 entries. A step's row count (tokens
# in the batch) takes hundreds of values under mixed prefill, so an engine that saw each one
# grew by ~1 GB before the caches filled (the soak: +130 MB in 60 s on the tiny model). Rows are
# therefore zero-padded up to a bucket: exact from _MIN_ROWS to _EXACT_ROWS, then four
# buckets per doubling (at most 25% padding, ~12% on average): 41 shapes per projection up to
# 2048 rows, 49 up to 8192, all compiled within the first few hundred steps.
# Below _MIN_ROWS rows, _MIN_ROWS: oneDNN streams a weight from memory faster for 4-6 rows than
# for 1-3 (80 distinct SmolLM2 MLP weights, cold: 25-26 GB/s at 4-6 rows, 22 at 1, 20 at 2, 21
# at 7-8), so a batch-1 float32 decode step padded to 4 rows takes 24 ms instead of 29 here.
_MIN_ROWS = 4
_EXACT_ROWS = 16


def row_bucket(rows: int) -> int:
    """The row count a packed projection of ``rows`` rows runs at (>= rows; few distinct values)."""
    if rows < _MIN_ROWS:
        return _MIN_ROWS
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)   # a quarter of the doubling rows falls in
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = row_bucket(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))   # rows are independent
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def warm_up_row_buckets(shapes: dict[tuple[int, int], torch.Tensor], max_rows: int, done: int) -> None:
    """Run each packed weight of ``shapes`` ((in, out) -> packed weight) once at every row bucket
    in (``done``, ``max_rows``], so that oneDNN compiles and caches all the primitives a step can
    need now rather than one by one under load (each ~0.5 MB: an engine that meets them
    gradually grows by ~100 MB over hours, which looks like a leak and is not one)."""
    buckets = sorted({row_bucket(r) for r in range(done + 1, max_rows + 1)})
    with torch.inference_mode():
        for (inp, _out), packed in shapes.items():
            for rows in buckets:
                torch.ops.mkldnn._linear_pointwise(torch.zeros(rows, inp), packed, None, "none", [], "")


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


class LlamaAttention(torch.nn.Module):
    def __init__(self, arch: ModelArchConfig, **factory) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim)
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = arch.head_dim ** -0.5
        self.qkv_proj = _Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias, **factory)
        self.o_proj = _Linear(self.q_size, arch.hidden_size, bias=False, **factory)

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata, attn: AttentionBackend):
        # x [T, hidden]
        qkv = self.qkv_proj(x)                                                 # [T, q + 2 kv]
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # Q and K heads rotate in one call: they sit side by side in the fused projection.
        qk = apply_rotary(qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)              # [T, Hq, D], [T, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)                        # [T, Hkv, D]
        out = attn.forward(q, k, v, kv_cache, meta, self.scale)                  # [T, Hq, D]
        return self.o_proj(out.reshape(-1, self.q_size))                         # [T, hidden]


class LlamaMLP(torch.nn.Module):
    def __init__(self, arch: ModelArchConfig, **factory) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = _Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False, **factory)
        self.down_proj = _Linear(arch.intermediate_size, arch.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)                                 # [T, hidden]


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, arch: ModelArchConfig, **factory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **factory)
        self.self_attn = LlamaAttention(arch, **factory)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **factory)
        self.mlp = LlamaMLP(arch, **factory)

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
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(arch, **factory) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **factory)
        # Tied: the output projection is the embedding matrix itself (no copy).
        self.lm_head = None if arch.tie_word_embeddings else _Linear(
            arch.hidden_size, arch.vocab_size, bias=False, **factory)
        self._packed_lm_head: torch.Tensor | None = None
        # Set by load_hf_weights with a quantizer (models.quant formats), in place of the float ones.
        self.quant_embedding = None
        self.quant_lm_head = None
        self._decoder = None      # _cpu_decoder(): built on the first step

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
        if attn.name == "torch" and self._cpu_decoder() is not None:
            keys, values = zip(*kv_caches)
            tables, lens = row_prefixes(meta)
            if meta.tree is None:
                return self._decoder.forward(h, cos, sin, list(keys), list(values), meta.slot_mapping, tables, lens)
            return self._decoder.forward(h, cos, sin, list(keys), list(values), meta.slot_mapping, tables,
                                         meta.tree.lens, meta.tree.tail_start, meta.tree.tail_slots)
        if meta.tree is not None and not attn.supports_trees:
            raise RuntimeError(f"draft trees: attention backend {attn.name!r} cannot attend through them")
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, meta, attn)
        return self.norm(h)

    def _cpu_decoder(self):
        """The C++ layer stack (``kernels/cpu_ops.cpp``'s LlamaDecoder) when every projection is
        either block-quantized (``w4a8`` / ``w8a8``) or float32 packed for oneDNN (``none`` on
        CPU), with or without biases (Qwen2's q/k/v); None otherwise. Every step (prefill,
        decode, verification, mixed) then runs all the layers in one call, with the arithmetic of
        the layers here (norms, RoPE, SwiGLU, residuals in float32), each row attending over its
        own causal prefix (``row_prefixes``): a token's bits depend only on its sequence, not on
        the batch, the chunking, a prefix-cache hit or speculation. In float32 the products are
        the Python layers' own (the same oneDNN operator and row buckets, ``row_bucket``); what
        goes is ~0.5 ms of Python and small torch ops per layer and step."""
        if self._decoder is None:
            self._decoder = False
            linears = [m for m in self.modules() if isinstance(m, _Linear)]
            blockq = all(isinstance(m.quantized, kquant.BLOCK_CLASSES) for m in linears)
            packed = self._float32_packed()
            if linears and (blockq or packed):
                from sluice.kernels import cpu_ext

                if not blockq and not (envs.cpu_cpp_layers() and cpu_ext.available()):
                    return None    # float32 keeps the Python layers (the block formats need the kernels)
                none = torch.empty(0)
                tensors, shapes = [], []
                for layer in self.layers:
                    attn, mlp = layer.self_attn, layer.mlp
                    projs = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
                    norms = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
                    biases = [none if p.bias is None else p.bias.detach().float().contiguous() for p in projs]
                    # Per projection its parts (kind, packed, d, m, out): several where a fused
                    # projection's parts are stored in different block formats (kquant.StackedLinear).
                    parts = [kquant.block_cpp_parts(p.quantized) if blockq else [(32, p.packed, none, none, p.out_features)]
                             for p in projs]
                    tensors.append(norms + biases + [t for ps in parts for (_, w, d, m, _) in ps for t in (w, d, m)])
                    shapes.append([v for ps in parts for v in (len(ps), *[x for (kind, *_, n) in ps for x in (kind, n)])])
                arch, ops = self.arch, cpu_ext.module()
                self._decoder = ops.LlamaDecoder(
                    tensors, shapes, self.norm.weight.detach(), arch.num_attention_heads,
                    arch.num_key_value_heads, arch.head_dim, float(arch.rms_norm_eps), arch.head_dim ** -0.5)
        return self._decoder or None

    def supports_draft_trees(self, attn: AttentionBackend) -> bool:
        """Whether a step may carry draft trees (``AttentionMetadata.tree``): the C++ layer stack
        reads them by position, the backends that say so (``supports_trees``) by index."""
        return attn.supports_trees or (attn.name == "torch" and self._cpu_decoder() is not None)

    def extra_rows_are_cheap(self) -> bool:
        """Whether a step's extra rows cost little next to its first: float32 projections stream
        their weights once for a few rows (SmolLM2 on 2 cores: 8 rows 25 ms, 1 row 22 ms), where
        the block formats' integer products are compute-bound from a few rows up (w4a8: 8 ms
        against 4). Speculation's draft trees pay only in the first case (bench/spec_decode.py)."""
        return not any(isinstance(m, _Linear) and isinstance(m.quantized, kquant.BLOCK_CLASSES) for m in self.modules())

    def rows_at_one_row_cost(self) -> int | None:
        """The most rows a step runs for about the cost of one, where measured: 6 with every
        projection float32 and packed for oneDNN on CPU (its products pad 1-3 rows to 4
        (``row_bucket``) and stream a weight as fast at 4-6 rows; 7 rows cost ~15% more a step on
        SmolLM2 with 2 AVX-512 cores). None elsewhere. Draft trees verify that many rows'
        nodes freely (``spec_decode.tree.select``)."""
        return 6 if self._float32_packed() else None

    def _float32_packed(self) -> bool:
        """Every projection float32 and packed for oneDNN (the CPU's float32 format)."""
        linears = [m for m in self.modules() if isinstance(m, _Linear)]
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
        The C++ layer stack is made here too, so that a machine's first start compiles its
        kernels (about a minute, once) before the engine is ready, not inside the first request."""
        self._cpu_decoder()
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
            for i, layer in enumerate(self.layers):
                _load_layer(layer, weights, f"model.layers.{i}.", arch, quantizer)


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
    qkv = layer.self_attn.qkv_proj
    # Rows of the fused weight: [q | k | v].
    _fill(qkv, weights, [(f"{a}q_proj.weight", (q, h)), (f"{a}k_proj.weight", (kv, h)),
                         (f"{a}v_proj.weight", (kv, h))], quantizer)
    if qkv.bias is not None:
        for name, start, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
            qkv.bias[start:start + rows].copy_(_take(weights, f"{a}{name}.bias", (rows,)))
    _fill(layer.self_attn.o_proj, weights, [(a + "o_proj.weight", (h, q))], quantizer)
    _fill(layer.mlp.gate_up_proj, weights, [(m + "gate_proj.weight", (inter, h)),
                                            (m + "up_proj.weight", (inter, h))], quantizer)
    _fill(layer.mlp.down_proj, weights, [(m + "down_proj.weight", (h, inter))], quantizer)
