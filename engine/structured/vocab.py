"""xgrammar's view of our tokenizer: every token id's bytes, built from ``engine.tokenizer``.

xgrammar matches grammars on bytes, so it needs the exact byte string each token stands for:
  * byte-level BPE (GPT-2 style; every GGUF ``gpt2`` vocabulary, SmolLM2, Llama 3, Qwen2): each
    character of the token's spelling is one byte through GPT-2's printable-byte table;
  * SentencePiece-style (``▁`` for a space, ``<0xNN>`` byte-fallback pieces): those rules.
Special (control) tokens, and ids past the tokenizer's vocabulary that the model's embedding pads
to, get ``b""``: xgrammar never allows an empty token, except a stop token when the grammar may end.
"""
from __future__ import annotations

import re

from sluice.engine.tokenizer import bytes_to_unicode

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """[vocab_size] the bytes of each token id (``b""`` for special and padding ids)."""
    spellings = [tokenizer.id_to_token(i) for i in range(min(vocab_size, tokenizer.vocab_size))]
    plain = [(i, s) for i, s in enumerate(spellings) if s is not None and not tokenizer.is_special(i)]
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    byte_level = _is_byte_level([s for _, s in plain], inverse)
    out = [b""] * vocab_size
    for i, s in plain:
        if byte_level and all(c in inverse for c in s):
            out[i] = bytes(inverse[c] for c in s)
        elif m := _BYTE_PIECE.fullmatch(s):
            out[i] = bytes([int(m.group(1), 16)])
        else:
            out[i] = (s.replace("\u2581", " ") if not byte_level else s).encode("utf-8")
    return out


def _is_byte_level(spellings: list[str], inverse: dict[str, int]) -> bool:
    """Byte-level BPE spells (almost) every token in the printable-byte alphabet and never uses
    SentencePiece's ``▁``; a few added tokens in plain UTF-8 do not change the verdict."""
    if not spellings or any("\u2581" in s for s in spellings[:5000]):
        return False
    inside = sum(all(c in inverse for c in s) for s in spellings)
    return inside >= 0.95 * len(spellings)


def build_tokenizer_info(tokenizer, vocab_size: int, spelled: list[bytes] | None = None):
    """``xgrammar.TokenizerInfo`` for the model: its vocabulary (padded to the model's logits
    width; ``spelled``: ``token_bytes``' result when the caller has it) and its stop tokens (the
    ones EOS-checking ends a request on)."""
    import xgrammar as xgr

    spelled = token_bytes(tokenizer, vocab_size) if spelled is None else spelled
    return xgr.TokenizerInfo(spelled, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=sorted(tokenizer.eos_token_ids))
