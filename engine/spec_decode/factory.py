"""Builds the engine's speculative decoding from its config: the draft model (small_draft) before
the KV pool is sized, or the heads (eagle, medusa), then the ``SpecDecoder`` (None when
speculation is off)."""
from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from sluice.engine.spec_decode.config import DEFAULT_TREE_WIDTH, SpeculativeConfig
from sluice.engine.spec_decode.decoder import SpecDecoder
from sluice.engine.spec_decode.draft_model import DraftModelProposer, check_same_vocabulary, kv_bytes_per_block
from sluice.engine.spec_decode.eagle import EagleProposer
from sluice.engine.spec_decode.heads import load_eagle, load_medusa, resolve_head_format
from sluice.engine.spec_decode.medusa import MedusaProposer
from sluice.engine.spec_decode.ngram import NgramProposer
from sluice.engine.spec_decode.runner_hooks import SpecRunnerHooks


def load_draft(config: SpeculativeConfig, target, load, draft=None):
    """small_draft's model: ``draft`` when given (weights already in memory), else ``load(name)``;
    checked against the target's vocabulary. None for the other modes."""
    if config.speculative_mode != "small_draft":
        return None
    draft = draft if draft is not None else load(config.additional_models)
    check_same_vocabulary(target, draft, config.additional_models)
    return draft


def load_heads(config: SpeculativeConfig, target, dtype: torch.dtype, device, heads=None):
    """eagle's or medusa's heads (``heads`` when given, else read from ``additional_models``),
    checked against the target and moved to its device and dtype. None for the other modes."""
    mode = config.speculative_mode
    if mode not in ("eagle", "medusa"):
        return None
    if heads is None:
        loader = load_eagle if mode == "eagle" else load_medusa
        heads = loader(config.additional_models, target.arch)
    if mode == "medusa" and config.spec_draft_length > heads.num_heads:
        raise ValueError(f"spec_draft_length: the Medusa heads in {config.additional_models} propose at most "
                         f"{heads.num_heads} drafts, spec_draft_length is {config.spec_draft_length}")
    return heads.to(device=device, dtype=dtype).eval()


def shared_num_blocks(target_blocks: int, target_arch, draft, dtype_bytes: int, block_size: int) -> int:
    """Blocks of one pool whose every block holds the target's KV and the draft's: the budget
    that gave ``target_blocks`` target-only blocks, spread over both."""
    if draft is None:
        return target_blocks
    t = kv_bytes_per_block(target_arch, dtype_bytes, block_size)
    d = kv_bytes_per_block(draft.arch, dtype_bytes, block_size)
    return max(1, target_blocks * t // (t + d))


class DraftTreeCosts(Protocol):
    """What a target model declares for eagle's and medusa's draft trees (``resolve_tree_width``
    asks it; ``models.llama.LlamaForCausalLM`` answers for every generating model)."""

    def supports_draft_trees(self, attn) -> bool:
        """Whether a step through ``attn`` (the attention backend) can attend through a tree."""
        ...

    def extra_rows_are_cheap(self) -> bool:
        """Whether a step's extra rows cost little (its projections are not in a block format)."""
        ...

    def rows_at_one_row_cost(self) -> int | None:
        """The rows a step runs at one row's cost, where measured (None: not known)."""
        ...


def resolve_tree_width(config: SpeculativeConfig, model: DraftTreeCosts, attn) -> SpeculativeConfig:
    """The config with ``spec_tree_width`` decided. Auto (None): DEFAULT_TREE_WIDTH for eagle and
    medusa where the step can attend through a draft tree (``supports_draft_trees``: the C++
    layer stack and the torch, Triton and flash-attn backends) and a tree's extra rows cost
    little (``extra_rows_are_cheap``: projections not in a block format), else 1. Measured on
    SmolLM2, open-ended prompts: eagle 1.55x with trees and 1.32x with chains in float32, 0.73x
    and 0.80x in w4a8 (bench/README.md). A width above 1 asked for where a step cannot attend through it
    is refused. ``spec_tree_nodes`` auto (None) with trees: the nodes that fit the rows the
    model runs at one row's cost (``rows_at_one_row_cost``), else K * W."""
    width = config.spec_tree_width
    able = config.speculative_mode in ("eagle", "medusa") and model.supports_draft_trees(attn)
    if width is None:
        auto = able and model.extra_rows_are_cheap()
        width = DEFAULT_TREE_WIDTH if auto else 1
    elif width > 1 and not able:
        raise ValueError(f"spec_tree_width: draft trees need a model and an attention backend that attend through "
                         f"them; this engine runs {type(model).__name__} with attention {attn.name!r}")
    nodes = config.spec_tree_nodes
    if nodes is None and width > 1:
        # The nodes verified freely: those that fit the rows a step runs at one row's cost, the
        # request's last known token being one of them; else all K * W.
        rows = model.rows_at_one_row_cost()
        nodes = config.spec_draft_length * width if rows is None else max(1, rows - 1)
    return replace(config, spec_tree_width=width, spec_tree_nodes=nodes)


def build_spec_decoder(config: SpeculativeConfig, runner, kv=None, draft_runner=None, heads=None,
                       seed: int = 0) -> SpecDecoder | None:
    if not config.enabled:
        return None
    mode = config.speculative_mode
    capture = None
    if mode == "ngram":
        proposer = NgramProposer(config.spec_ngram_max, config.spec_ngram_min)
    elif mode == "small_draft":
        if draft_runner is None or kv is None:
            raise ValueError("additional_models: small_draft needs its draft model loaded")
        proposer = DraftModelProposer(draft_runner, kv, kv.block_size)
    elif mode in ("eagle", "medusa"):
        if heads is None:
            raise ValueError(f"additional_models: {mode} needs its heads loaded")
        # The target hands over the hidden states the heads read: every computed row for EAGLE's
        # cache, the row behind each request's last token for Medusa. Off in the other modes.
        capture = "all" if mode == "eagle" else "last"
        cls = EagleProposer if mode == "eagle" else MedusaProposer
        # The width as resolve_tree_width decided it (the engine resolves it once, before the
        # scheduler budgets K * width; an unresolved auto counts as chains).
        tree = {"tree_width": config.tree_width, "tree_nodes": config.spec_tree_nodes} if config.tree_width > 1 else {}
        proposer = cls(heads, runner.model, runner.vocab_size, runner.device, seed,
                       min_prob=config.min_draft_prob,
                       head_format=resolve_head_format(config.spec_head_format, runner.device), **tree)
    else:   # SpeculativeConfig refuses every other mode
        raise ValueError(f"speculative_mode: {config.speculative_mode!r} has no proposer")
    decoder = SpecDecoder(config, proposer, SpecRunnerHooks(capture))
    runner.spec = decoder.hooks      # the runner calls them at its named points (runner_hooks)
    return decoder
