"""Structured output: grammar-constrained decoding with xgrammar.

``spec`` (pure Python, no xgrammar) says what a request is constrained to; ``manager`` compiles
those constraints off the step thread, keeps one matcher per constrained request and fills the
token bitmasks that the sampler applies (``bitmask``).
"""
from sluice.engine.structured.spec import GrammarSpec, StructuredOutputConfig

__all__ = ["GrammarSpec", "StructuredOutputConfig"]
