"""Draft heads that read the target's own hidden states: Medusa and EAGLE, their modules and their
checkpoint formats.

Both read ``h_t``, the target's last hidden state after its final norm (the input of its LM
head), at the row that predicted token ``t + 1``.

**Medusa** (Cai et al., 2024): K heads. Head ``k`` is ``num_layers`` residual blocks
``x + SiLU(W x + b)`` over ``h_t`` and an LM head; it predicts token ``t + 2 + k``, so after the
target samples ``t + 1`` the heads give K drafts in one pass. The public layout (FasterDecoding's
``medusa_lm_head.safetensors`` or the legacy ``medusa_lm_head.pt``, beside a ``config.json``
naming ``medusa_num_heads`` / ``medusa_num_layers``) stores head ``k``'s block ``j`` as
``{k}.{j}.linear.weight`` / ``.bias`` and its LM head as ``{k}.{num_layers}.weight``. A file
without the LM heads (every head's absent) shares the target's: what ``sluice train-heads``
writes, because SmolLM2's vocabulary would make each head's own LM head 113 MB.

**EAGLE** (Li et al., 2024): one decoder layer over ``fc(concat(embed(x_{t+1}), h_t))`` that
predicts the target's next hidden state; the target's LM head turns it into a token, and it runs
again on its own output for the next draft. It has its own small KV cache (``EagleCache``, dense,
per request) and shares the target's embedding and LM head. The public layout (SafeAILab's
EAGLE-1) is a one-layer Llama ``config.json`` plus ``model.safetensors`` or ``pytorch_model.bin``
with ``fc.weight`` (and ``fc.bias``), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight`` and no
input norm on layer 0 (a checkpoint that has one uses it). An ``embed_tokens.weight`` in the file
is ignored: the target's embedding is the one the head was trained against.

Either file may hold ``t2d``, a bool [vocab] mask as EAGLE-3 stores it, naming a draft vocabulary: drafts are drawn from those
tokens only, through just those rows of the target's LM head. On a CPU that read of the LM head is
what a draft costs (SmolLM2's is 113 MB in float32, a fifth of the model, per draft token); the
8192 most frequent tokens of the model's own answers cut it six-fold and cover nearly all of them.

**Drafting format** (``spec_head_format``). A draft only has to be likely, not exact: the rejection
rule keeps the target's distribution whatever q is. So on a CPU whose C++ block kernels are
vectorized (AVX2 or AVX512-VNNI), ``auto`` drafts with 8-bit block copies of EAGLE's eight
projections and of the draft LM head (``w8a8``: the weights rounded to 8 bits per block of 32,
the input to int8 per block), about a quarter of float32's bytes per draft token. ``float32`` keeps
the heads' own weights (oneDNN-packed on CPU). Training never sees the copies.
"""
from __future__ import annotations

import bisect
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from sluice.engine.errors import ModelLoadError
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.models.llama import cpu_packing_available, pack_cpu_weight, packed_linear
from sluice.engine.models.quant import BlockQLinear
from sluice.engine.models.rope import RotaryEmbedding, apply_rotary
from sluice.engine.spec_decode.config import HEAD_FORMATS

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
EAGLE_FILES = ("model.safetensors", "pytorch_model.bin")


def w8a8_unavailable_reason(device) -> str | None:
    """Why heads cannot draft in w8a8 on ``device`` (None: they can)."""
    if torch.device(device).type != "cpu":
        return "w8a8 drafting runs on CPU only"
    from sluice.kernels import cpu_blockq

    if cpu_blockq.vectorized():
        return None
    if cpu_blockq.isa() is None:
        return f"the C++ block kernels are not available ({cpu_blockq.unavailable_reason()})"
    return "this CPU has neither AVX2 nor AVX512-VNNI (the block kernels' portable loop is slower than float32)"


def resolve_head_format(fmt: str, device) -> str:
    """``auto`` -> ``w8a8`` where the vectorized block kernels run, else ``float32``; an explicit
    ``w8a8`` where they cannot is refused with the reason."""
    if fmt not in HEAD_FORMATS:
        raise ValueError(f"spec_head_format: must be one of {', '.join(HEAD_FORMATS)}, got {fmt!r}")
    if fmt == "float32":
        return fmt
    reason = w8a8_unavailable_reason(device)
    if fmt == "w8a8" and reason:
        raise ValueError(f"spec_head_format: w8a8 is not available: {reason}")
    return "float32" if reason else "w8a8"


def _block_copy(weight: torch.Tensor):
    """An 8-bit block copy of a float [N, K] weight for drafting (None when K is not a multiple
    of the block, 32: that projection stays float)."""
    if weight.shape[-1] % 32:
        return None
    return BlockQLinear.from_float(weight.detach().float().contiguous(), 8)


class HeadsLoadError(ModelLoadError, ValueError):
    """A heads checkpoint that cannot serve this target (named file, tensor and shapes)."""


# ---- the draft vocabulary ------------------------------------------------------------------
class _DraftVocab(torch.nn.Module):
    """An optional draft vocabulary (``t2d``): the sorted ids drafts may be, or None (all)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("draft_vocab", None)
        self._t2d_size = 0

    def set_draft_vocab(self, t2d: torch.Tensor | None) -> None:
        """``t2d``: bool [vocab], True for the tokens drafts may be."""
        self._t2d_size = 0 if t2d is None else t2d.numel()
        self.draft_vocab = None if t2d is None else t2d.nonzero().flatten().to(torch.long)

    def draft_mask(self) -> torch.Tensor | None:
        if self.draft_vocab is None:
            return None
        mask = torch.zeros(self._t2d_size, dtype=torch.bool)
        mask[self.draft_vocab.cpu()] = True
        return mask


class DraftLMHead:
    """The target's LM head for drafting: all of it, or only the draft vocabulary's rows (a packed
    copy on CPU, or an 8-bit block copy under ``w8a8``), with -inf logits for every other token
    so that nothing else is ever drafted. ``format``: what drafting reads, ``w8a8``, ``float32``
    or ``target`` (no draft vocabulary: the target's own LM head, in the target's format)."""

    def __init__(self, target, draft_vocab: torch.Tensor | None, vocab_size: int, dtype, device,
                 fmt: str = "float32") -> None:
        self.target, self.vocab, self.vocab_size = target, draft_vocab, vocab_size
        self._packed = self._weight = self._block = None
        if draft_vocab is not None:
            with torch.no_grad():
                w = target_lm_weight(target).detach()[draft_vocab.to(device)].to(dtype).contiguous()
            self._block = _block_copy(w) if fmt == "w8a8" else None
            if self._block is None:
                if w.device.type == "cpu" and w.dtype == torch.float32 and cpu_packing_available():
                    self._packed = pack_cpu_weight(w)
                else:
                    self._weight = w
        self.format = "target" if draft_vocab is None else "w8a8" if self._block is not None else "float32"

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """[n, H] → [n, V] float32."""
        if self.vocab is None:
            return self.target.compute_logits(h)
        full = torch.full((h.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=h.device)
        full[:, self.vocab] = self.draft_logits(h)
        return full

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[n, H] → the draft vocabulary's logits [n, len(vocab)] float32, column j for token
        ``vocab[j]`` (only with a draft vocabulary)."""
        if self._block is not None:
            sub = self._block(h.float().contiguous())
        elif self._packed is not None:
            sub = packed_linear(h, self._packed, None)
        else:
            sub = F.linear(h, self._weight)
        return sub.float()


# ---- Medusa --------------------------------------------------------------------------------
class ResBlock(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        torch.nn.init.zeros_(self.linear.weight)    # starts as the identity: h_t itself
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(_DraftVocab):
    """``num_heads`` heads of ``num_layers`` residual blocks each; ``vocab_size`` gives each head
    its own LM head (the public layout's), None shares the target's."""

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1, vocab_size: int | None = None) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.num_layers = hidden_size, num_heads, num_layers
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers))) for _ in range(num_heads))
        self.lm_heads = None if vocab_size is None else torch.nn.ModuleList(
            torch.nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] → [N, num_heads, H]: each head's residual stack."""
        return torch.stack([b(hidden) for b in self.blocks], dim=1)

    def logits(self, hidden: torch.Tensor, target_logits) -> torch.Tensor:
        """hidden [N, H] → [N, num_heads, V] float32; ``target_logits`` is the target's LM head
        (a ``DraftLMHead``), used unless the heads have their own."""
        feats = self.features(hidden)
        if self.lm_heads is None:
            n, k, h = feats.shape
            return target_logits(feats.reshape(n * k, h)).reshape(n, k, -1)
        return torch.stack([head(feats[:, i]) for i, head in enumerate(self.lm_heads)], dim=1).float()

    def public_state_dict(self) -> dict[str, torch.Tensor]:
        """The FasterDecoding key layout."""
        out = {}
        for k, blocks in enumerate(self.blocks):
            for j, block in enumerate(blocks):
                out[f"{k}.{j}.linear.weight"] = block.linear.weight.detach()
                out[f"{k}.{j}.linear.bias"] = block.linear.bias.detach()
            if self.lm_heads is not None:
                out[f"{k}.{self.num_layers}.weight"] = self.lm_heads[k].weight.detach()
        return out


# ---- EAGLE ---------------------------------------------------------------------------------
class EagleCache:
    """One request's EAGLE keys and values (after RoPE), dense, with the position of each entry.
    Positions only grow; entries from a position on are dropped when the target rejected drafts
    there or recomputes from there."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype, device, capacity: int = 256) -> None:
        self.k = torch.empty(capacity, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.positions: list[int] = []

    def __len__(self) -> int:
        return len(self.positions)

    def fork(self) -> "EagleCache":
        """A copy that grows apart from this one (a draft tree's sibling branches)."""
        n = len(self.positions)
        out = EagleCache.__new__(EagleCache)
        out.k, out.v = self.k[:n + 8].clone(), self.v[:n + 8].clone()
        out.positions = list(self.positions)
        return out

    def truncate(self, position: int) -> None:
        """Drop every entry at ``position`` or later."""
        del self.positions[bisect.bisect_left(self.positions, position):]

    def reserve(self, t: int) -> None:
        """Room for ``t`` more entries."""
        n = len(self.positions)
        if n + t > self.k.shape[0]:
            cap = max(2 * self.k.shape[0], n + t)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty((cap, *old.shape[1:]))
                new[:n] = old[:n]
                setattr(self, name, new)

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [T, Hkv, D] entries; returns all keys and values, these included."""
        n, t = len(self.positions), k.shape[0]
        self.reserve(t)
        self.k[n:n + t] = k
        self.v[n:n + t] = v
        self.positions.extend(positions)
        return self.k[:n + t], self.v[:n + t]


# What drafting reads: products that share an input run as one over the stacked weights.
_EAGLE_SERVING = {"fc": ("fc",), "qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                  "gate_up": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class EagleHead(_DraftVocab):
    """EAGLE-1's draft layer over the target's embedding and hidden states."""

    def __init__(self, arch: ModelArchConfig, fc_bias: bool = True, input_norm: bool = False) -> None:
        super().__init__()
        h = arch.hidden_size
        self.arch = arch
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.fc = torch.nn.Linear(2 * h, h, bias=fc_bias)
        bias = arch.attention_bias
        self.q_proj = torch.nn.Linear(h, arch.q_size, bias=bias)
        self.k_proj = torch.nn.Linear(h, arch.kv_size, bias=bias)
        self.v_proj = torch.nn.Linear(h, arch.kv_size, bias=bias)
        self.o_proj = torch.nn.Linear(arch.q_size, h, bias=False)
        self.input_layernorm = torch.nn.RMSNorm(h, eps=arch.rms_norm_eps) if input_norm else None
        self.post_attention_layernorm = torch.nn.RMSNorm(h, eps=arch.rms_norm_eps)
        self.gate_proj = torch.nn.Linear(h, arch.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(h, arch.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(arch.intermediate_size, h, bias=False)
        self.rotary = RotaryEmbedding(arch)
        self.scale = arch.head_dim ** -0.5

    def new_cache(self, capacity: int = 256) -> EagleCache:
        w = self.fc.weight
        return EagleCache(self.num_kv_heads, self.head_dim, w.dtype, w.device, capacity)

    _packed: dict | None = None     # name -> (weight as drafting reads it, bias): see pack_for_serving
    _cpp = None                     # kernels/cpu_ops.cpp's EagleLayer over _packed: see pack_for_serving

    def pack_for_serving(self, fmt: str = "float32") -> str:
        """Drafting copies of the eight projections (training keeps using the ``nn.Linear``
        weights, which stay as they are). ``w8a8``: 8-bit block copies for the C++ kernels
        (``resolve_head_format`` says where they run; a hidden size that is not a multiple of 32
        stays float32). ``float32``: on CPU, oneDNN-packed copies (the target's projections use
        the same layout): MKL's small-row products behind ``nn.Linear`` stream a weight at about
        a third of the bandwidth. Either way, where sluice's C++ CPU kernels are built, drafting
        runs the whole layer in one call to their ``EagleLayer`` (``_cpp``): a drafting step makes
        four of these calls, and the ~25 small torch ops of the Python layer cost more than its
        five products. Returns the format the projections now draft in."""
        w = self.fc.weight
        if fmt == "w8a8":
            with torch.no_grad():
                packed = {name: (_block_copy(weight), None if bias is None else bias.float())
                          for name, (weight, bias) in self._stacked().items()}
            if all(block is not None for block, _bias in packed.values()):
                self._packed = packed
                self._cpp = self._cpp_layer()
                return "w8a8"
        if w.device.type != "cpu" or w.dtype != torch.float32 or not cpu_packing_available():
            return "float32"
        with torch.no_grad():
            self._packed = {name: (pack_cpu_weight(weight), bias) for name, (weight, bias) in self._stacked().items()}
        self._cpp = self._cpp_layer()
        return "float32"

    def _cpp_layer(self):
        """``_packed`` as the C++ ``EagleLayer`` (None off a float32 CPU head, where the kernels
        are not built, or where SLUICE_CPU_CPP_LAYERS=0 asks for the Python layers)."""
        from sluice.engine import envs
        from sluice.kernels import cpu_ext

        w = self.fc.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not (envs.cpu_cpp_layers() and cpu_ext.available()):
            return None     # its caches and activations are float32 CPU tensors
        ops, none = cpu_ext.module(), torch.empty(0)
        projections = {}
        for name, (weight, bias) in self._packed.items():
            if isinstance(weight, BlockQLinear):
                part = ops.StackPart(packed=weight.packed, d=weight.d, m=weight.m, kind=weight.bits,
                                     n=weight.out_features)
            else:       # float32, packed by oneDNN (kind 32)
                n = sum(getattr(self, part).out_features for part in _EAGLE_SERVING[name])
                part = ops.StackPart(packed=weight, d=none, m=none, kind=32, n=n)
            projections[name] = ops.StackProjection(
                parts=[part], bias=none if bias is None else bias.detach().float().contiguous())
        spec = ops.StackSpec(heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             eps=float(self.arch.rms_norm_eps), scale=float(self.scale), qk_norm=False)
        norm = lambda m: none if m is None else m.weight.detach().float().contiguous()  # noqa: E731
        return ops.EagleLayer(spec=spec, input_norm=norm(self.input_layernorm),
                              post_norm=norm(self.post_attention_layernorm), fc=projections["fc"],
                              qkv=projections["qkv"], o=projections["o_proj"], gate_up=projections["gate_up"],
                              down=projections["down_proj"])

    def _stacked(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """``_EAGLE_SERVING``'s products: (weights stacked by output rows, biases or None)."""
        out = {}
        for name, parts in _EAGLE_SERVING.items():
            lins = [getattr(self, part) for part in parts]     # q/k/v all have a bias or none (arch)
            weight = torch.cat([lin.weight.detach() for lin in lins]).contiguous()
            out[name] = (weight, None if lins[0].bias is None else torch.cat([lin.bias.detach() for lin in lins]))
        return out

    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """One of ``_EAGLE_SERVING``'s products (training: the ``nn.Linear`` modules themselves)."""
        if self._packed is None:
            parts = _EAGLE_SERVING[name]
            return torch.cat([getattr(self, part)(x) for part in parts], dim=-1) if len(parts) > 1 \
                else getattr(self, parts[0])(x)
        weight, bias = self._packed[name]
        if isinstance(weight, torch.Tensor):
            return packed_linear(x, weight, bias)
        out = weight(x.float().contiguous())
        return (out if bias is None else out + bias).to(x.dtype)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: list[int],
                cache: EagleCache | None = None) -> torch.Tensor:
        """One sequence's pairs (``embed(x_{i+1})``, ``h_i``) at ``positions`` [T], each [T, H] →
        predicted hidden states [T, H] (of positions + 1). With a ``cache`` the pairs attend to its
        entries too and are added to it; without one, only to each other (causally): training."""
        return self.forward_many([(embeds, hidden, positions, cache)])[0]

    def forward_many(self, items: list[tuple[torch.Tensor, torch.Tensor, list[int], EagleCache | None]]
                     ) -> list[torch.Tensor]:
        """``forward`` for several sequences at once: the projections run once over all their
        rows (one product per weight, not one per sequence), attention per sequence."""
        sizes = [len(positions) for _e, _h, positions, _c in items]
        if self._cpp is not None and all(cache is not None for _e, _h, _p, cache in items):
            return self._forward_cpp(items, sizes)

        def attend(q, k, v):
            attended, start = [], 0
            for (_e, _h, positions, cache), n in zip(items, sizes):
                sl = slice(start, start + n)
                attended.append(self._attend(q[sl], k[sl], v[sl], positions, cache))
                start += n
            return torch.cat(attended)

        out = self._layer(torch.cat([e for e, _h, _p, _c in items]), torch.cat([h for _e, h, _p, _c in items]),
                          [p for _e, _h, positions, _c in items for p in positions], attend)
        return list(out.split(sizes))

    def _forward_cpp(self, items, sizes: list[int]) -> list[torch.Tensor]:
        caches = [cache for _e, _h, _p, cache in items]
        if len({id(c) for c in caches}) != len(caches):   # each writes after its own entries
            raise ValueError("EagleHead.forward_many: a cache appears in more than one item")
        positions = [p for _e, _h, pos, _c in items for p in pos]
        cat = lambda ts: (ts[0] if len(ts) == 1 else torch.cat(ts)).float().contiguous()  # noqa: E731
        cos, sin = self.rotary._cpu_table(max(positions) + 1, torch.float32)
        before = []
        for cache, n in zip(caches, sizes):
            cache.reserve(n)
            before.append(len(cache))
        out = self._cpp.forward(cat([e for e, _h, _p, _c in items]), cat([h for _e, h, _p, _c in items]),
                                torch.tensor(positions, dtype=torch.long), cos, sin,
                                [c.k for c in caches], [c.v for c in caches], before, sizes)
        for (_e, _h, pos, cache) in items:
            cache.positions.extend(pos)
        out = out.to(self.fc.weight.dtype)
        return [out] if len(sizes) == 1 else list(out.split(sizes))

    def forward_next_drafts(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: list[int],
                            context: tuple[torch.Tensor, torch.Tensor, list[int]]) -> torch.Tensor:
        """Training with the head fed its own outputs (as every draft after the first is at
        serving): row j, a pair at ``positions[j]`` whose hidden state the head predicted, sees
        the ``context`` entries (keys, values [C, Hkv, D] and their positions) before its position
        and itself, not the other rows: each row is a separate request's next draft."""
        ctx_k, ctx_v, ctx_pos = context
        dev = embeds.device
        pos = torch.tensor(positions, device=dev)
        seen = torch.cat((torch.tensor(ctx_pos, device=dev)[None, :] < pos[:, None],
                          torch.eye(len(positions), dtype=torch.bool, device=dev)), dim=1)    # [T, C + T]

        def attend(q, k, v):
            k, v = torch.cat((ctx_k, k)), torch.cat((ctx_v, v))
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 attn_mask=seen, scale=self.scale, enable_gqa=True)
            return out.transpose(0, 1).reshape(q.shape[0], -1)

        return self._layer(embeds, hidden, positions, attend)

    def keys_values(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [T, Hkv, D] pairs at ``positions`` put in a cache."""
        _x, _q, k, v = self._qkv(embeds, hidden, positions)
        return k, v

    def _qkv(self, embeds, hidden, positions: list[int]):
        x = self._lin("fc", torch.cat((embeds, hidden), dim=-1))
        t = x.shape[0]
        a = x if self.input_layernorm is None else self.input_layernorm(x)
        pos = torch.tensor(positions, dtype=torch.long, device=x.device)
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        q, k, v = self._lin("qkv", a).split([self.arch.q_size, self.arch.kv_size, self.arch.kv_size], dim=-1)
        q = apply_rotary(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
        return x, q, k, v.reshape(t, self.num_kv_heads, self.head_dim)

    def _layer(self, embeds, hidden, positions: list[int], attend) -> torch.Tensor:
        """The decoder layer over pairs [T, H] each; ``attend(q, k, v)`` -> [T, heads * D]."""
        x, q, k, v = self._qkv(embeds, hidden, positions)
        x = x + self._lin("o_proj", attend(q, k, v))
        m = self.post_attention_layernorm(x)
        gate, up = self._lin("gate_up", m).chunk(2, dim=-1)
        return x + self._lin("down_proj", F.silu(gate) * up)

    def _attend(self, q, k, v, positions: list[int], cache: EagleCache | None) -> torch.Tensor:
        """One sequence's new rows q/k/v [T, heads, D] → [T, heads * D]."""
        t = q.shape[0]
        before = 0 if cache is None else len(cache)
        if cache is not None:
            k, v = cache.append(k, v, positions)
        # Grouped-query attention as two batched products per KV head, each over the query heads
        # that share it (SDPA's enable_gqa takes its math path on CPU and copies K/V out to every
        # query head first: twice the time for one drafting row over 300 entries). New pair i
        # sees every earlier entry and the new ones up to itself.
        kv_heads, d = k.shape[1], k.shape[2]
        group = q.shape[1] // kv_heads
        qg = q.reshape(t, kv_heads, group, d).permute(1, 0, 2, 3).reshape(kv_heads, t * group, d)
        scores = torch.bmm(qg, k.permute(1, 2, 0)) * self.scale                       # [Hkv, t * G, N]
        if t > 1:
            seen = torch.ones(t, before + t, dtype=torch.bool, device=q.device).tril(before)
            scores = scores.masked_fill(~seen.repeat_interleave(group, dim=0), float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))               # [Hkv, t * G, D]
        return out.reshape(kv_heads, t, group, d).permute(1, 0, 2, 3).reshape(t, -1)

    def public_state_dict(self) -> dict[str, torch.Tensor]:
        """SafeAILab's EAGLE-1 key layout."""
        out = {"fc.weight": self.fc.weight.detach()}
        if self.fc.bias is not None:
            out["fc.bias"] = self.fc.bias.detach()
        p = "layers.0."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(self, name)
            out[p + f"self_attn.{name}.weight"] = lin.weight.detach()
            if lin.bias is not None:
                out[p + f"self_attn.{name}.bias"] = lin.bias.detach()
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.{name}.weight"] = getattr(self, name).weight.detach()
        out[p + "post_attention_layernorm.weight"] = self.post_attention_layernorm.weight.detach()
        if self.input_layernorm is not None:
            out[p + "input_layernorm.weight"] = self.input_layernorm.weight.detach()
        return out


def eagle_config(target: ModelArchConfig, intermediate_size: int | None = None) -> dict:
    """A one-layer Llama ``config.json`` for an EAGLE head over ``target``."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": target.hidden_size, "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
        "rope_scaling": target.rope_scaling, "bias": True,
    }


# ---- loading and writing -------------------------------------------------------------------
def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise HeadsLoadError(f"additional_models: {folder} has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HeadsLoadError(f"additional_models: {path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise HeadsLoadError(f"additional_models: {path} must hold a JSON object")
    return cfg


def _read_tensors(folder: Path, names: tuple[str, ...]) -> tuple[Path, dict[str, torch.Tensor]]:
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return path, load_file(str(path))
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:   # noqa: BLE001 - any unreadable file gets the same clear error
            raise HeadsLoadError(f"additional_models: cannot read {path}: {type(exc).__name__}: {exc}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise HeadsLoadError(f"additional_models: {path} is not a state dict of tensors")
        return path, state
    raise HeadsLoadError(f"additional_models: {folder} holds none of {', '.join(names)}")


def _int_field(cfg: dict, name: str, path: Path, lo: int = 1) -> int:
    v = cfg.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise HeadsLoadError(f"additional_models: {path / 'config.json'}: {name} must be an integer >= {lo}, got {v!r}")
    return v


def _check_shape(path: Path, state: dict, name: str, shape: tuple[int, ...], target: ModelArchConfig) -> torch.Tensor:
    if name not in state:
        raise HeadsLoadError(f"additional_models: {path} has no tensor {name!r}")
    t = state[name]
    if tuple(t.shape) != shape:
        raise HeadsLoadError(f"additional_models: {path}: {name} has shape {tuple(t.shape)}, expected {shape} "
                             f"for the target (hidden size {target.hidden_size}, vocabulary {target.vocab_size})")
    return t


def _read_t2d(module: _DraftVocab, path: Path, state: dict, target: ModelArchConfig) -> None:
    if "t2d" not in state:
        return
    t2d = _check_shape(path, state, "t2d", (target.vocab_size,), target)
    if t2d.dtype != torch.bool or not t2d.any():
        raise HeadsLoadError(f"additional_models: {path}: t2d must be a bool mask with at least one "
                             f"token set, got {t2d.dtype} with {int(t2d.count_nonzero())} set")
    module.set_draft_vocab(t2d)


def load_medusa(folder: str | Path, target: ModelArchConfig) -> MedusaHeads:
    folder = Path(folder)
    cfg = _read_config(folder)
    heads = _int_field(cfg, "medusa_num_heads", folder)
    layers = _int_field(cfg, "medusa_num_layers", folder)
    path, state = _read_tensors(folder, MEDUSA_FILES)
    h, vocab = target.hidden_size, target.vocab_size
    own = [f"{k}.{layers}.weight" in state for k in range(heads)]
    if any(own) and not all(own):
        raise HeadsLoadError(f"additional_models: {path}: heads {[k for k in range(heads) if not own[k]]} have no "
                             f"LM head ({{k}}.{layers}.weight) and the others do; give every head one or none")
    module = MedusaHeads(h, heads, layers, vocab if all(own) else None)
    expected = set()
    with torch.no_grad():
        for k in range(heads):
            for j in range(layers):
                lin = module.blocks[k][j].linear
                lin.weight.copy_(_check_shape(path, state, f"{k}.{j}.linear.weight", (h, h), target))
                lin.bias.copy_(_check_shape(path, state, f"{k}.{j}.linear.bias", (h,), target))
                expected |= {f"{k}.{j}.linear.weight", f"{k}.{j}.linear.bias"}
            if module.lm_heads is not None:
                name = f"{k}.{layers}.weight"
                module.lm_heads[k].weight.copy_(_check_shape(path, state, name, (vocab, h), target))
                expected.add(name)
    _read_t2d(module, path, state, target)
    extra = sorted(set(state) - expected - {"t2d"})
    if extra:
        raise HeadsLoadError(f"additional_models: {path} has tensors a {heads}-head, {layers}-layer Medusa does "
                             f"not: {', '.join(extra[:5])} (medusa_num_heads / medusa_num_layers wrong?)")
    return module.eval()


def load_eagle(folder: str | Path, target: ModelArchConfig) -> EagleHead:
    folder = Path(folder)
    cfg = _read_config(folder)
    cfg = {"model_type": "llama", **cfg}
    try:
        arch = ModelArchConfig.from_hf_config(cfg)
    except ValueError as exc:
        raise HeadsLoadError(f"additional_models: {folder / 'config.json'}: {exc}") from None
    if arch.hidden_size != target.hidden_size:
        raise HeadsLoadError(f"additional_models: the EAGLE head in {folder} is for hidden size {arch.hidden_size}, "
                             f"the target's is {target.hidden_size}")
    if cfg.get("vocab_size") is not None and arch.vocab_size != target.vocab_size:
        raise HeadsLoadError(f"additional_models: the EAGLE head in {folder} is for a vocabulary of "
                             f"{arch.vocab_size} tokens, the target's has {target.vocab_size}")
    if arch.num_hidden_layers != 1:
        raise HeadsLoadError(f"additional_models: {folder / 'config.json'}: an EAGLE head has one layer, "
                             f"num_hidden_layers is {arch.num_hidden_layers}")
    path, state = _read_tensors(folder, EAGLE_FILES)
    p = "layers.0."
    module = EagleHead(arch, fc_bias="fc.bias" in state, input_norm=p + "input_layernorm.weight" in state)
    own = module.public_state_dict()
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(_check_shape(path, state, name, tuple(param.shape), target))
    _read_t2d(module, path, state, target)
    extra = sorted(set(state) - set(own) - {"embed_tokens.weight", "t2d"})
    if extra:
        raise HeadsLoadError(f"additional_models: {path} has tensors a one-layer EAGLE head does not: "
                             f"{', '.join(extra[:5])}")
    return module.eval()


def target_lm_weight(model) -> torch.Tensor:
    """The target's LM head as a dense [V, H] tensor (however it is stored: tied, packed, quantized)."""
    if model.quant_lm_head is not None:
        return model.quant_lm_head.dequantize()
    if model.lm_head is not None:
        return model.lm_head.dense_weight()
    return model.embed_tokens.weight
