"""Per-request sampling parameters, validated on construction.

Every bad value raises ``ValueError`` whose message starts with the field name, so that the
gRPC servicer and the HTTP facade can report which parameter was wrong.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from sluice.engine.structured.spec import GrammarSpec


GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None: until the context window is full
    min_tokens: int = 0
    temperature: float = 1.0             # 0 means greedy
    top_k: int = 0                       # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None          # None: none; k >= 0: sampled token's logprob + top-k
    prompt_logprobs: int | None = None   # reserved; rejected until implemented
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: GrammarSpec | None = None  # a grammar the output must follow (engine.structured)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    # Kept separate so callers that mutate a copy can re-check it.
    def validate(self) -> None:  # noqa: C901 - a flat list of checks reads best
        _int("n", self.n, lo=1)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, lo=1)
        _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _num("temperature", self.temperature, lo=0.0)
        _int("top_k", self.top_k, lo=-1)
        _num("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        _num("min_p", self.min_p)
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        _num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _num("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        # The penalty divides or multiplies float32 logits: a value float32 rounds to 0 (5e-324)
        # or to infinity made them inf / NaN and failed the step.
        _num("repetition_penalty", self.repetition_penalty, lo=1e-6, hi=1e6)
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias: must be a mapping of token id to bias")
        for tok, bias in self.logit_bias.items():
            _int("logit_bias", tok, lo=0)
            _num("logit_bias", bias, lo=-100.0, hi=100.0)
        if self.seed is not None:
            _int("seed", self.seed)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop: must be a string or a list of strings, got {type(self.stop).__name__}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError("stop_token_ids: must be a list of token ids")
        for tok in self.stop_token_ids:
            _int("stop_token_ids", tok, lo=0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0, hi=20)
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not supported yet")
        if self.structured is not None:
            self._validate_structured()

    def _validate_structured(self) -> None:
        if not isinstance(self.structured, GrammarSpec):
            raise ValueError(f"structured: must be a GrammarSpec, got {type(self.structured).__name__}")
        # The grammar decides where the output may end (EOS only when it is complete): a floor on
        # the length or an EOS that does not end would contradict it, so neither is accepted.
        if self.min_tokens:
            raise ValueError(f"min_tokens: cannot be combined with {self.structured.field} (the grammar "
                             "decides where the output ends)")
        if self.ignore_eos:
            raise ValueError(f"ignore_eos: cannot be combined with {self.structured.field} (the grammar "
                             "decides where the output ends)")

    @property
    def greedy(self) -> bool:
        # A temperature below GREEDY_BELOW is greedy too: dividing float32 logits by it would
        # overflow them to inf (5e-324 is 0 in float32), and the draw is the argmax anyway.
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the parameters must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias)), ("stop_token_ids", self.stop_token_ids)):
            for tok in ids:
                if tok >= vocab_size:
                    raise ValueError(f"{name}: token id {tok} is outside the vocabulary (size {vocab_size})")


def _int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value}")


def _num(name: str, value: object, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value}")
