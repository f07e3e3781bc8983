"""Builds the engine's speculative decoding from its config: the draft model (small_draft) before
the KV pool is sized, then the ``SpecDecoder`` (None when speculation is off)."""
from __future__ import annotations

from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.spec_decode.decoder import SpecDecoder
from sluice.engine.spec_decode.draft_model import DraftModelProposer, check_same_vocabulary, kv_bytes_per_block
from sluice.engine.spec_decode.ngram import NgramProposer


def load_draft(config: SpeculativeConfig, target, load, draft=None):
    """small_draft's model: ``draft`` when given (weights already in memory), else ``load(name)``;
    checked against the target's vocabulary. None for the other modes."""
    if config.speculative_mode != "small_draft":
        return None
    draft = draft if draft is not None else load(config.additional_models)
    check_same_vocabulary(target, draft, config.additional_models)
    return draft


def shared_num_blocks(target_blocks: int, target_arch, draft, dtype_bytes: int, block_size: int) -> int:
    """Blocks of one pool whose every block holds the target's KV and the draft's: the budget
    that gave ``target_blocks`` target-only blocks, spread over both."""
    if draft is None:
        return target_blocks
    t = kv_bytes_per_block(target_arch, dtype_bytes, block_size)
    d = kv_bytes_per_block(draft.arch, dtype_bytes, block_size)
    return max(1, target_blocks * t // (t + d))


def build_spec_decoder(config: SpeculativeConfig, runner, kv=None, draft_runner=None) -> SpecDecoder | None:
    if not config.enabled:
        return None
    if config.speculative_mode == "ngram":
        proposer = NgramProposer(config.spec_ngram_max, config.spec_ngram_min)
    elif config.speculative_mode == "small_draft":
        if draft_runner is None or kv is None:
            raise ValueError("additional_models: small_draft needs its draft model loaded")
        proposer = DraftModelProposer(draft_runner, kv, kv.block_size)
    else:   # SpeculativeConfig refuses every other mode
        raise ValueError(f"speculative_mode: {config.speculative_mode!r} has no proposer")
    return SpecDecoder(config, proposer, runner.draft_probs)
