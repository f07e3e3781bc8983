"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model = llama``: Llama 2, Mistral 7B, TinyLlama,
CodeLlama) tokenize exactly as transformers tokenizes the same file.

The test writes a GGUF whose vocabulary is built from a multilingual and code text: byte-fallback
pieces, every character but a few (those fall back to bytes), the ``▁``-prefixed words and all
their prefixes, with seeded random scores (so the merge order matters), a control token and a
user-defined one. Ids both ways, with and without special tokens, and decoding, are compared
with ``transformers.AutoTokenizer`` loading the same file, with ``add_space_prefix`` absent and
true. A file with ``add_space_prefix = false`` is tokenized as llama.cpp does (no ``▁`` before the
text); transformers (5.x) prepends it anyway, so there the two agree on texts that begin with a
space, and the first piece of the others has no ``▁``.
"""
from __future__ import annotations

import random

import pytest

from sluice.engine.loaders.gguf_loader import open_gguf
from sluice.engine.tokenizer import Tokenizer

TEXT = ("Hello world! Bonjour le monde, ça va? Grüße aus München. 你好，世界。\n"
        "def add(a, b):\n    return a + b  # sum <|im_end|> naïve café 😀 <tool> done")
TEXTS = [TEXT, " leading space", "double  space\tand tab", "Grüße😀😀", "<tool>call</tool>", "a", ""]
FALLBACK = set("😀ü中")     # left out of the vocabulary: byte fallback spells them


def _vocab(seed: int) -> tuple[list[str], list[float], list[int]]:
    rng = random.Random(seed)
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces: list[str] = []
    spelled = TEXT.replace(" ", "\u2581")
    for ch in dict.fromkeys(spelled + "\u2581"):
        if ch not in FALLBACK:
            pieces.append(ch)
    for word in TEXT.split():
        w = "\u2581" + word
        for k in range(2, len(w) + 1):
            if not set(w[:k]) & FALLBACK:
                pieces.append(w[:k])
        for k in range(2, len(word)):
            if not set(word[:k]) & FALLBACK:
                pieces.append(word[:k])
    pieces = [p for p in dict.fromkeys(pieces) if p not in ("<|im_end|>", "<tool>")]
    tokens += pieces
    types += [1] * len(pieces)
    tokens += ["<|im_end|>", "<tool>"]
    types += [3, 4]
    scores = [0.0] * 259 + [-rng.uniform(0, 100) for _ in pieces] + [0.0, 0.0]
    return tokens, scores, types


def _write(path, seed: int, space_prefix: bool | None):
    import gguf

    tokens, scores, types = _vocab(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if space_prefix is not None:
        writer.add_add_space_prefix(space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("seed, space_prefix", [(0, None), (1, True), (2, False)])
def test_sentencepiece_gguf_tokenizes_as_transformers(tmp_path, seed, space_prefix):
    from transformers import AutoTokenizer

    path = _write(tmp_path / "spm.gguf", seed, space_prefix)
    ours = Tokenizer.from_gguf(open_gguf(path), path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    if space_prefix is False:
        first = ours.id_to_token(ours.encode("Hello", add_special_tokens=False)[0])
        assert not first.startswith("\u2581"), first
    for text in TEXTS if space_prefix is not False else [t for t in TEXTS if t.startswith(" ")]:
        want = theirs.encode(text)
        assert ours.encode(text) == want, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        if space_prefix is False:   # nothing was prepended, so nothing is stripped: the text comes back
            assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
            continue
        assert ours.decode(want, skip_special_tokens=True) == theirs.decode(want, skip_special_tokens=True), text
        assert ours.decode(want, skip_special_tokens=False) == theirs.decode(want, skip_special_tokens=False), text
    ids = ours.encode(TEXT, add_special_tokens=False)
    assert ours.bos_token_id == 1 and ours.encode("a")[0] == 1            # BOS unless the file says not
    assert any(tok.startswith("<0x") for tok in map(ours.id_to_token, ids))  # byte fallback was used
    assert ours.is_special(ours._tok.token_to_id("<|im_end|>"))
