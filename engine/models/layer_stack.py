"""How a decoder's layers run on a step: a strategy chosen once per model (``select_layer_stack``).

* ``PythonLayers``: each layer's ``forward`` in torch, attention through the step's backend
  (which owns the paged KV cache). Runs anywhere, with any weight format.
* ``CppLayers``: every layer in one call to ``kernels/cpu_stack.cpp``'s ``DecoderStack``, built
  from the model's ``LayerSpec`` and weights as named structs. Chosen when every projection is
  block-quantized (``w4a8`` / ``w8a8``: their kernels are C++ anyway) or float32 packed for oneDNN
  (``none`` on CPU, unless ``SLUICE_CPU_CPP_LAYERS=0``). Every step (prefill, decode,
  verification, mixed) then runs with the arithmetic of the Python layers (norms, RoPE, SwiGLU,
  residuals in float32), each row attending over its own causal prefix (``row_prefixes``): a
  token's bits depend only on its sequence, not on the batch, the chunking, a prefix-cache hit or
  speculation. In float32 the products are the Python layers' own (the same oneDNN operator and
  row buckets, ``cpu_linear.row_bucket``); what goes is ~0.5 ms of Python and small torch ops per
  layer and step. It reads draft trees by position, so it attends through them whatever the
  backend says; with another backend than ``torch`` (the paged cache is then not the C++ one's
  to read) it runs the Python layers.

The model is duck-typed here (``layers`` and their ``spec``, ``norm``, ``spec``, ``linears()``,
``_float32_packed()``): this module sits below ``models.llama``, which imports it.
"""
from __future__ import annotations

import torch

from sluice.engine import envs
from sluice.engine.attention.base import AttentionBackend, AttentionMetadata, row_prefixes
from sluice.engine.models import kquant

_NONE = torch.empty(0)
_FLOAT32_PACKED = 32          # cpu_stack.cpp's part kind for a oneDNN-packed float32 weight


class PythonLayers:
    runs_in_cpp = False

    def forward(self, model, h, cos, sin, kv_caches, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        if meta.tree is not None and not attn.supports_trees:
            raise RuntimeError(f"draft trees: attention backend {attn.name!r} cannot attend through them")
        if model.spec.shard is not None:
            raise RuntimeError("tensor parallelism's exact split gathers inside the C++ layer stack; "
                               "the Python layers cannot run a model split that way")
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, meta, attn)
        return model.norm(h)

    def attends_trees(self, attn: AttentionBackend) -> bool:
        """The backends that say so (``supports_trees``) attend through a draft tree by index."""
        return attn.supports_trees


class CppLayers:
    runs_in_cpp = True

    def __init__(self, stack) -> None:
        self.stack = stack              # cpu_stack.cpp's DecoderStack

    def forward(self, model, h, cos, sin, kv_caches, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        if attn.name != "torch":
            return PythonLayers().forward(model, h, cos, sin, kv_caches, meta, attn)
        keys, values = (list(c) for c in zip(*kv_caches))
        tables, lens = row_prefixes(meta)
        local = {}
        if isinstance(cos, tuple):      # (global, local) tables (models.gemma.RopeTables)
            (cos, local_cos), (sin, local_sin) = cos, sin
            local = {"local_cos": local_cos, "local_sin": local_sin}
        if meta.tree is None:
            return self.stack.forward(h, cos, sin, keys, values, meta.slot_mapping, tables, lens, **local)
        tree = meta.tree
        return self.stack.forward(h, cos, sin, keys, values, meta.slot_mapping, tables, tree.lens,
                                  tree.tail_start, tree.tail_slots, **local)

    def attends_trees(self, attn: AttentionBackend) -> bool:
        return attn.name == "torch" or attn.supports_trees


def select_layer_stack(model) -> PythonLayers | CppLayers:
    linears = model.linears()
    if not linears or any(layer.spec.cpp_stack_lacks() for layer in model.layers):
        # What cpu_stack.cpp cannot run (LayerSpec.cpp_stack_lacks; nothing so far) runs in the
        # Python layers, each projection in the model's format (block formats included).
        return PythonLayers()
    blockq = all(isinstance(m.quantized, kquant.BLOCK_CLASSES) for m in linears)
    if not (blockq or model._float32_packed()):
        return PythonLayers()
    from sluice.kernels import cpu_ext

    if not blockq and not (envs.cpu_cpp_layers() and cpu_ext.available()):
        return PythonLayers()    # float32 keeps the Python layers (the block formats need the kernels)
    return CppLayers(build_decoder_stack(model, cpu_ext.module()))


def build_decoder_stack(model, ops):
    """The model's layers as ``ops.DecoderStack`` (``ops``: the compiled module, ``cpu_ext.module()``)."""
    att = model.spec.attention
    sandwich = model.spec.sandwich_norms
    spec = ops.StackSpec(heads=att.num_heads, kv_heads=att.num_kv_heads, head_dim=att.head_dim,
                         eps=float(model.spec.norm_eps), scale=att.scale, qk_norm=att.qk_norm,
                         geglu=model.spec.mlp == "geglu", sandwich=sandwich, softcap=att.softcap or 0.0,
                         qk_norm_full=att.qk_norm_full)
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # Gemma (models.gemma): norms on both outputs and one before the MLP; Gemma 3's local RoPE.
        extra = {} if not sandwich else {
            "pre_mlp_norm": layer.pre_feedforward_layernorm.weight.detach(),
            "post_mlp_norm": layer.post_feedforward_layernorm.weight.detach(), "local_rope": layer.rope == 1}
        if layer.spec.mlp == "moe":     # models.moe.SparseMoE: the experts by name, no dense MLP
            extra["moe"] = _experts(ops, mlp)
            gate_up = down = ops.StackProjection(parts=[], bias=_NONE)
        else:
            gate_up, down = _projection(ops, mlp.gate_up_proj), _projection(ops, mlp.down_proj)
        layers.append(ops.StackLayer(**extra,
            input_norm=layer.input_layernorm.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
            qkv=_projection(ops, attn.qkv_proj), o=_projection(ops, attn.o_proj), gate_up=gate_up, down=down,
            q_norm=_NONE if attn.q_norm is None else attn.q_norm.weight.detach(),
            k_norm=_NONE if attn.k_norm is None else attn.k_norm.weight.detach(),
            window=attn.sliding_window or 0))       # the layer's own window (0: global)
    return ops.DecoderStack(spec=spec, layers=layers, final_norm=model.norm.weight.detach())


def _experts(ops, moe):
    """A ``models.moe.SparseMoE`` as ``ops.StackMoE``: its float32 router, each expert's projections
    in their format, and the shared expert with its gate when the model has one."""
    shared = {}
    if moe.shared_expert is not None:
        shared = {"shared_gate_up": _projection(ops, moe.shared_expert.gate_up_proj),
                  "shared_down": _projection(ops, moe.shared_expert.down_proj),
                  "shared_gate": moe.shared_gate.detach().float().contiguous()}
    return ops.StackMoE(router=moe.router.detach().float().contiguous(),
                        gate_up=[_projection(ops, e.gate_up_proj) for e in moe.experts],
                        down=[_projection(ops, e.down_proj) for e in moe.experts],
                        top_k=moe.top_k, norm_topk=moe.norm_topk_prob, **shared)


def _projection(ops, linear):
    """A projection's parts (several where a fused projection's parts are stored in different
    block formats, ``kquant.StackedLinear``) and its bias (empty: none)."""
    if linear.quantized is not None:
        parts = [ops.StackPart(packed=w, d=d, m=m, kind=kind, n=n)
                 for kind, w, d, m, n in kquant.block_cpp_parts(linear.quantized)]
    else:
        parts = [ops.StackPart(packed=linear.packed, d=_NONE, m=_NONE, kind=_FLOAT32_PACKED, n=linear.out_features)]
    bias = _NONE if linear.bias is None else linear.bias.detach().float().contiguous()
    return ops.StackProjection(parts=parts, bias=bias)
