"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): routing and the experts layer.

Routing is transformers' (``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter``): router logits in the
model dtype, softmax in float32, the top k probabilities, renormalised over the k when
``norm_topk_prob`` (Mixtral always). Each expert is a SwiGLU MLP (``llama.LlamaMLP``, so an
expert's projections are ``_Linear`` s: float32 packed for oneDNN, or one of ``models.quant``'s
formats, each expert kept as its file stores it). Qwen2-MoE adds a shared expert on every token,
scaled by ``sigmoid(shared_expert_gate . x)``.

The experts run batched per step: the step's (token, slot) pairs are sorted by expert and each
expert that any token chose runs once on all of its tokens; its outputs, scaled by their routing
weights, are added into the tokens' rows in ascending expert order (as transformers adds them). The C++
layer stack runs the same steps with the same ATen ops (``kernels/cpu_stack.cpp``'s ``StackMoE``,
built by ``layer_stack._experts``) when every projection is in a format it takes.
The router and the shared gate stay float32 whatever the format (llama.cpp keeps ``ffn_gate_inp``
F32 too): a rounded router could pick other experts than the model's.

Weights arrive under Hugging Face names; ``HF_NAMES`` gives the expert projections' names per
``ArchTraits.moe`` (the GGUF loader maps llama.cpp's 3-D ``ffn_*_exps`` tensors to them, one
expert at a time).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from sluice.engine.errors import ModelLoadError
from sluice.engine.models.layer_spec import LayerSpec

# ArchTraits.moe -> (the MLP's prefix in the layer, router, expert gate, up, down projections).
HF_NAMES = {
    "mixtral": ("block_sparse_moe.", "gate", "w1", "w3", "w2"),
    "qwen": ("mlp.", "gate", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp.", "gate", "gate_proj", "up_proj", "down_proj"),
}


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, experts [T, k] int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(torch.nn.Module):
    """The MLP of a ``LayerSpec`` whose ``mlp`` is "moe". ``mlp_cls`` builds a SwiGLU MLP from a
    spec (``llama.LlamaMLP``, passed in: that module imports this one)."""

    def __init__(self, spec: LayerSpec, mlp_cls, **factory) -> None:
        super().__init__()
        moe = spec.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        expert = dataclasses.replace(spec, intermediate_size=moe.intermediate_size, mlp="swiglu", moe=None)
        self.router = torch.nn.Parameter(torch.empty(moe.num_experts, spec.hidden_size, **factory))   # [E, hidden]
        self.experts = torch.nn.ModuleList(mlp_cls(expert, **factory) for _ in range(moe.num_experts))
        self.shared_expert = self.shared_gate = None
        if moe.shared_intermediate_size:
            # Under tensor parallelism's exact split its down_proj reads the whole shared activation.
            shard = None if spec.shard is None else dataclasses.replace(spec.shard, mlp_in=spec.shard.shared_in)
            shared = dataclasses.replace(expert, intermediate_size=moe.shared_intermediate_size, shard=shard)
            self.shared_expert = mlp_cls(shared, **factory)
            self.shared_gate = torch.nn.Parameter(torch.empty(1, spec.hidden_size, **factory))    # [1, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden]
        weights, experts = route(F.linear(x, self.router), self.top_k, self.norm_topk_prob)   # [T, k] each
        flat = experts.flatten()                                                   # [T * k]
        order = torch.argsort(flat, stable=True)                                   # pairs grouped by expert
        tokens = order // self.top_k                                               # [T * k] token of each pair
        scales = weights.flatten()[order]                                          # [T * k]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                rows = tokens[start:start + n]
                y = expert(x[rows]) * scales[start:start + n, None]                # [n, hidden]
                out.index_add_(0, rows, y.to(x.dtype))
                start += n
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared_expert(x)
        return out

    def load(self, weights, prefix: str, names: str, fill, take, quantizer) -> None:
        """This layer's experts from HF-named ``weights`` (``prefix``: ``model.layers.N.``; ``names``:
        an ``HF_NAMES`` key). ``fill(linear, weights, parts, quantizer)`` and ``take(weights, name,
        shape)`` are the model's own (``llama._fill`` / ``llama._take``)."""
        mlp, router, gate, up, down = HF_NAMES[names]
        base = prefix + mlp
        hidden = self.router.shape[1]
        self.router.copy_(take(weights, f"{base}{router}.weight", tuple(self.router.shape)))
        for e, expert in enumerate(self.experts):
            _load_swiglu(expert, weights, f"{base}experts.{e}.", (gate, up, down), hidden, fill, quantizer)
        if self.shared_expert is not None:
            _load_swiglu(self.shared_expert, weights, f"{base}shared_expert.",
                         ("gate_proj", "up_proj", "down_proj"), hidden, fill, quantizer)
            name = f"{base}shared_expert_gate.weight"
            if name not in weights:
                raise ModelLoadError(f"missing tensor {name!r}")
            gate_w = weights[name]
            if gate_w.numel() != hidden:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(gate_w.shape)}, expected (1, {hidden})")
            self.shared_gate.copy_(gate_w.reshape(1, hidden))   # llama.cpp stores it 1-D, [hidden]


def _load_swiglu(mlp, weights, prefix: str, names: tuple[str, str, str], hidden: int, fill, quantizer) -> None:
    gate, up, down = names
    inter = mlp.intermediate_size
    fill(mlp.gate_up_proj, weights, [(f"{prefix}{gate}.weight", (inter, hidden)),
                                     (f"{prefix}{up}.weight", (inter, hidden))], quantizer)
    down_proj = mlp.down_proj       # (hidden, inter), or a rank's output rows of the whole input (tensor parallelism)
    fill(down_proj, weights, [(f"{prefix}{down}.weight", (down_proj.out_features, down_proj.in_features))], quantizer)
