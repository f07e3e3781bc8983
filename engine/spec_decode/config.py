"""Speculative decoding's configuration: one frozen dataclass, validated before anything loads.

Modes follow ``mlc_llm serve --speculative-mode`` (``disable``, ``small_draft``, ``eagle``,
``medusa``) plus sluice's ``ngram`` (prompt lookup). ``small_draft`` drafts with a second model,
``eagle`` and ``medusa`` with heads over the target's hidden states (``heads``); all three name
what they load with ``additional_models``.
"""
from __future__ import annotations

from dataclasses import dataclass

SPEC_MODES = ("disable", "ngram", "small_draft", "eagle", "medusa")
NEEDS_MODEL = {"small_draft": "a draft model", "eagle": "EAGLE heads", "medusa": "Medusa heads"}
MAX_DRAFT_LENGTH = 16
# Above this many running requests no drafts are proposed. Measured with bench/spec_decode.py
# (sweep, SmolLM2 on 2 CPU cores, K=5): ngram over no drafts 2.55-2.81x at batch 1, 1.48x at 2,
# 1.29x at 3, 0.95x at 4, 0.76x at 8; forced on at 32 streams 0.50x. See bench/README.md.
DEFAULT_MAX_BATCH_SIZE = 3
# eagle / medusa chains: a request's draft ends before the first token its head gives less than
# this probability (EAGLE-2's observation: a head's confidence tracks how often the target
# agrees), so steps stop paying for drafts that will be rejected. Measured with
# bench/spec_decode.py (batch1, self-distilled SmolLM2 heads, K=4, 2 CPU cores): see bench/README.md.
DEFAULT_MIN_DRAFT_PROB = 0.35
# eagle / medusa draft trees: a node is kept while the product of the head's probabilities along
# its path is at least this, with each node's DEFAULT_TREE_WIDTH likeliest children. Measured the
# same way (widths 2-4, thresholds 0.05-0.2 within noise of each other; see bench/README.md).
DEFAULT_TREE_MIN_SCORE = 0.1
DEFAULT_TREE_WIDTH = 3
# eagle/medusa: the weights drafting reads (heads.resolve_head_format)
HEAD_FORMATS = ("auto", "float32", "w8a8")
MAX_TREE_WIDTH = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_mode: str = "disable"
    spec_draft_length: int = 4             # K: draft tokens proposed per request and step
    spec_ngram_max: int = 3                # n-gram proposer: longest suffix matched ...
    spec_ngram_min: int = 1                # ... down to this length
    additional_models: str | None = None   # small_draft: the draft model; eagle/medusa: the heads' folder
    spec_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # drafting stops above this many running requests
    # eagle/medusa: a chain ends before a token its head gives less (default 0.35); a draft tree
    # keeps a node while its path's probability is at least this (default 0.1). None: the default.
    spec_min_draft_prob: float | None = None
    # eagle/medusa: the weights drafting reads: auto (w8a8 where the CPU block kernels are
    # vectorized, else float32) | float32 | w8a8 (heads.resolve_head_format)
    spec_head_format: str = "auto"
    # eagle/medusa: children per draft node. 1: a chain, which ends before the first token the
    # head gives less than spec_min_draft_prob. W > 1: draft trees (spec_decode.tree) for requests
    # without a grammar: each node's W likeliest children, kept while the product of the head's
    # probabilities along the path is at least spec_min_draft_prob (EAGLE-2's score), at most K
    # deep and K * W nodes. None (auto): DEFAULT_TREE_WIDTH where the projections are not in a
    # block format (w4a8, w8a8), else 1 (factory.resolve_tree_width, once the model is loaded).
    spec_tree_width: int | None = None
    # eagle/medusa draft trees: nodes a step verifies per request, those of highest path score;
    # of the others (up to K * W) those whose scores pay for the larger step (tree.select).
    # None (auto): what the target runs at one row's cost (LlamaForCausalLM.rows_at_one_row_cost:
    # 5 nodes on the float32 CPU stack), else K * W (factory.resolve_tree_width).
    spec_tree_nodes: int | None = None

    def __post_init__(self) -> None:
        mode = self.speculative_mode
        if mode not in SPEC_MODES:
            raise ValueError(f"speculative_mode: must be one of {', '.join(SPEC_MODES)}, got {mode!r}")
        _int_in("spec_draft_length", self.spec_draft_length, 1, MAX_DRAFT_LENGTH)
        _int_in("spec_ngram_min", self.spec_ngram_min, 1, 64)
        _int_in("spec_ngram_max", self.spec_ngram_max, 1, 64)
        if self.spec_ngram_min > self.spec_ngram_max:
            raise ValueError(f"spec_ngram_min: must be <= spec_ngram_max ({self.spec_ngram_max}), "
                             f"got {self.spec_ngram_min}")
        _int_in("spec_max_batch_size", self.spec_max_batch_size, 1, 1 << 20)
        p = self.spec_min_draft_prob
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0):
            raise ValueError(f"spec_min_draft_prob: must be a number in [0, 1), got {p!r}")
        if self.spec_tree_width is not None:
            _int_in("spec_tree_width", self.spec_tree_width, 1, MAX_TREE_WIDTH)
        if self.spec_tree_nodes is not None:
            _int_in("spec_tree_nodes", self.spec_tree_nodes, 1, MAX_DRAFT_LENGTH * MAX_TREE_WIDTH)
        if (self.spec_tree_width or 1) > 1 and mode not in ("eagle", "medusa"):
            raise ValueError(f"spec_tree_width: draft trees are drafted by speculative_mode eagle or medusa, not {mode}")
        if self.spec_head_format not in HEAD_FORMATS:
            raise ValueError(f"spec_head_format: must be one of {', '.join(HEAD_FORMATS)}, "
                             f"got {self.spec_head_format!r}")
        if self.additional_models is not None and not isinstance(self.additional_models, str):
            raise ValueError("additional_models: must be one path (a string), got "
                             f"{type(self.additional_models).__name__} {self.additional_models!r}")
        if mode in NEEDS_MODEL and not self.additional_models:
            raise ValueError(f"additional_models: speculative_mode {mode} needs {NEEDS_MODEL[mode]} "
                             "(--additional-models PATH)")
        if mode not in NEEDS_MODEL and self.additional_models:
            raise ValueError(f"additional_models: only speculative_mode small_draft, eagle or medusa load "
                             f"additional models, not {mode}")

    @property
    def enabled(self) -> bool:
        return self.speculative_mode != "disable"

    @property
    def tree_width(self) -> int:
        """Children per draft node (1: chains); auto counts as 1 until it is resolved."""
        return self.spec_tree_width or 1

    @property
    def min_draft_prob(self) -> float:
        """spec_min_draft_prob, or its default for the draft's shape (chain or tree)."""
        if self.spec_min_draft_prob is not None:
            return float(self.spec_min_draft_prob)
        return DEFAULT_TREE_MIN_SCORE if self.tree_width > 1 else DEFAULT_MIN_DRAFT_PROB

    @property
    def num_speculative_tokens(self) -> int:
        """What the scheduler budgets per request: K when drafting (K * W for draft trees), else 0."""
        return self.spec_draft_length * self.tree_width if self.enabled else 0


def _int_in(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}: must be an integer in [{lo}, {hi}], got {value!r}")
