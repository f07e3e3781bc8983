"""The attention-backend interface and the per-step metadata that travels with every forward.

KV cache layout, shared by every backend and by ``kernels/``: per layer a pair
``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token
``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat slot is ``block_id * block_size + offset``.

A batch is varlen: the new tokens of all sequences are flattened in schedule order. Sequence
``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those are its positions
``context_lens[i] .. seq_lens[i]-1`` and attend causally to all its earlier tokens. Plain
prefill, chunked prefill, prefix-cache hits, decode and speculative verification are all this
one shape.

Sliding windows: ``forward``'s ``window`` (the layer's ``AttentionSpec.sliding_window``) limits a
query at position p to the keys at positions p - window + 1 .. p (transformers' convention). The
block-table entries before a sequence's window may name blocks the KV manager has freed (and
another sequence now writes): a backend must never let them reach its result.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]


@dataclass(frozen=True)
class TreeRows:
    """A step with draft trees (``spec_decode.tree``). The step writes a tree's nodes after the
    sequence's known tokens, node i at index n + i of its sequence (n known tokens), but node i
    sits at position n - 1 + its depth and attends to the known tokens, then to its ancestors
    and itself only. Two descriptions of the same rows, one per kind of kernel:

    * by position, for the C++ layer stack (``kernels/cpu_ops.cpp``'s paged_decode), per query
      row: ``lens`` [T] int32 its prefix length (position + 1), ``tail_start`` [T] int32 the
      first position read from ``tail_slots`` [T, W] int64 instead of the block table (>= its
      length: none);
    * by index, for the kernels that attend over a sequence's slots in order (the torch
      backend, ``kernels/paged_prefill.py``, ``kernels._paged_common.tree_seen``): per query
      row ``node_start`` [T] int32, the index of its sequence's first node (NO_TREE for rows of
      sequences without a tree), and ``visible`` [T, N] int8, which of those nodes it sees. A row at index r sees index c when
      c <= r and (c < node_start or visible[row, c - node_start]); the known tokens' rows see
      no node (every node's index is past theirs).

    ``tree_seqs``: the host's list of the sequences (batch indices) that carry a tree."""

    lens: torch.Tensor
    tail_start: torch.Tensor
    tail_slots: torch.Tensor
    node_start: torch.Tensor
    visible: torch.Tensor
    tree_seqs: tuple[int, ...]


NO_TREE = 1 << 30     # TreeRows.node_start of a row whose sequence carries no tree


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [num_tokens] int64: flat cache slot of each new token
    query_start_loc: torch.Tensor     # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor            # [num_seqs] int32: tokens in context after this step
    context_lens: torch.Tensor        # [num_seqs] int32: tokens already cached before this step
    block_tables: torch.Tensor        # [num_seqs, max_blocks] int32, padded with 0
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so that backends that loop or branch on lengths never sync with the device.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    # Draft-tree rows (``spec_decode.tree``), or None: per query row its prefix length and where
    # its tokens leave the block table for explicit slots (``TreeRows``).
    tree: TreeRows | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


def row_prefixes(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: its sequence's block table and the length of its causal prefix (its
    position + 1), ``([num_tokens, max_blocks] int32, [num_tokens] int32)``: the input of a
    kernel that attends row by row (``kernels/cpu_ops.cpp``'s paged_decode). A decode step's rows
    are its sequences, so it is the step's own tables and lengths."""
    if meta.is_pure_decode:
        return meta.block_tables, meta.seq_lens
    q_lens = torch.tensor(meta.query_lens_cpu)
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs), q_lens)
    starts = torch.repeat_interleave(meta.query_start_loc[:-1].long().cpu(), q_lens)
    within = torch.arange(int(q_lens.sum())) - starts
    lens = meta.context_lens.long().cpu()[seq] + within + 1
    return meta.block_tables[seq.to(meta.block_tables.device)], lens.to(torch.int32).to(meta.seq_lens.device)


class AttentionBackend(ABC):
    """Stores this step's K/V into the paged cache, then attends through the block tables."""

    name: str = "abstract"
    # Whether ``forward`` reads ``AttentionMetadata.tree`` (draft trees); a backend that does not
    # never gets one (``LlamaForCausalLM.supports_draft_trees``).
    supports_trees: bool = False
    # Whether ``forward`` applies attention soft-capping (``softcap``, Gemma 2); a backend that
    # does not is never chosen for a model that needs it (``selector.backend_for_models``).
    supports_softcap: bool = False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,      # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,      # [num_tokens, num_kv_heads, head_dim]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # the layer's sliding window; None: the whole causal prefix
        softcap: float | None = None,  # scores -> cap * tanh(score / cap) before the mask (supports_softcap)
    ) -> torch.Tensor:            # [num_tokens, num_heads, head_dim]
        ...
