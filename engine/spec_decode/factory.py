"""Builds the engine's ``SpecDecoder`` from its config: None when speculation is off."""
from __future__ import annotations

from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.spec_decode.decoder import SpecDecoder
from sluice.engine.spec_decode.ngram import NgramProposer


def build_spec_decoder(config: SpeculativeConfig, runner, draft_model=None) -> SpecDecoder | None:
    if not config.enabled:
        return None
    if config.speculative_mode == "ngram":
        proposer = NgramProposer(config.spec_ngram_max, config.spec_ngram_min)
    elif config.speculative_mode == "small_draft":
        from sluice.engine.spec_decode.draft_model import DraftModelProposer

        if draft_model is None:
            raise ValueError("additional_models: small_draft needs its draft model loaded")
        proposer = DraftModelProposer(draft_model, runner)
    else:   # SpeculativeConfig refuses every other mode
        raise ValueError(f"speculative_mode: {config.speculative_mode!r} has no proposer")
    return SpecDecoder(config, proposer, runner.draft_probs)
