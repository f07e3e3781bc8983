"""The arguments of ``sluice train-heads`` (``training.train``), apart from the training code:
every ``sluice`` command builds its whole parser, and this module, unlike ``train``, imports no
torch (``sluice serve``'s supervising process never needs it)."""
from __future__ import annotations

import argparse

from sluice.engine.config import QUANTIZATIONS   # no torch import there either

DESCRIPTION = "Self-distilled draft heads: ``sluice train-heads MODEL --kind medusa|eagle --out FOLDER``."


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="sluice train-heads", description=DESCRIPTION)
    p.add_argument("model", help="the served model (short name or path)")
    p.add_argument("--kind", choices=("medusa", "eagle", "both"), default="both")
    p.add_argument("--out", required=True, help="folder for the heads (medusa/ and eagle/ inside with --kind both)")
    p.add_argument("--num-prompts", type=int, default=1920, help="conversations in the corpus (at most the distinct prompts the templates make)")
    p.add_argument("--max-tokens", type=int, default=160, help="answer length per conversation")
    p.add_argument("--medusa-heads", type=int, default=4, help="drafts Medusa can propose per step")
    p.add_argument("--medusa-layers", type=int, default=1, help="residual blocks per Medusa head")
    p.add_argument("--medusa-epochs", type=int, default=2, help="passes over the corpus")
    p.add_argument("--eagle-epochs", type=int, default=3, help="passes over the corpus")
    p.add_argument("--eagle-first-draft-only", action="store_true",
                   help="train EAGLE teacher-forced only (not also as a second draft fed its own prediction)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="EAGLE drafts from the N tokens the model's answers use most (0: the whole vocabulary)")
    p.add_argument("--eagle-intermediate-size", type=int, default=None,
                   help="the EAGLE layer's MLP width (default: the target's)")
    p.add_argument("--corpus-quantization", default="auto", choices=QUANTIZATIONS,
                   help="the weight format the engine answers the corpus prompts in (auto: the one `sluice serve` "
                        "picks for this model, w4a8 for SmolLM2's GGUF on a CPU with the block kernels); the "
                        "labels are always the float32 model's own choices")
    p.add_argument("--corpus", default=None,
                   help="a JSON file of token-id conversations: read when it exists, else generated and written there")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="prompt order, initialisation and noise")
    return p
