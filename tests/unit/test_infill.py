"""The fill-in-the-middle prompt the engine builds from a tokenizer's own FIM tokens.

CodeLlama style (SentencePiece-like ``▁<PRE>``/``▁<SUF>``/``▁<MID>``, a leading-space marker on
the first word): our ids equal transformers' ``CodeLlamaTokenizerFast(prefix, suffix=suffix)``,
the reference implementation of ``<s> <PRE> {prefix} <SUF>{suffix} <MID>``, on a tiny
Llama-style tokenizer trained here. StarCoder style (byte-level BPE, ``<fim_prefix>``...): our ids
equal the encoding of the documented text ``<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>``.
Plus: CodeLlama's ``<EOT>`` comes back as an extra stop token, a tokenizer without FIM tokens is
refused with UnsupportedError, and an empty prefix + suffix with a ValueError naming the field.
Tokenizers only (no model): runs in about a second.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers, \
    processors, trainers

from sluice.engine.input_processor import build_infill_prompt
from sluice.engine.errors import UnsupportedError
from sluice.engine.tokenizer import Tokenizer

CORPUS = ["def add(a, b):", "    return a + b", "result = add(1, 2)", "print(result)", "class Foo: pass",
          "for i in range(10):", "x = [i * i for i in xs]"]
CASES = [
    ("def add(a, b):\n    ", "\n    return result\n"),
    ("result = ", "(1, 2)\nprint(result)"),        # suffix starts mid-word: no space marker allowed
    ("class Foo", " pass"),                         # suffix starts with a real space
    ("x = [i", "for i in xs]"),
]
CODELLAMA_FIM = ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>")


def codellama_tokenizer_folder(folder: Path) -> Path:
    """A Llama-2-style tokenizer.json (BPE + byte fallback, ``Prepend("▁")`` normaliser, ``<s>``
    added in front) with CodeLlama's four infilling tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    for b in range(256):   # byte-fallback pieces, as in Llama's vocabulary ("\n" is <0x0A>)
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    tok = HFTokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CODELLAMA_FIM])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def starcoder_tokenizer_folder(folder: Path, fim: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", *(["<fim_prefix>", "<fim_middle>", "<fim_suffix>"] if fim else [])]
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


@pytest.fixture(scope="module")
def codellama(tmp_path_factory) -> Path:
    return codellama_tokenizer_folder(tmp_path_factory.mktemp("codellama"))


@pytest.mark.oracle
@pytest.mark.parametrize("prefix,suffix", CASES)
def test_codellama_prompt_equals_transformers(codellama: Path, prefix: str, suffix: str) -> None:
    from transformers import CodeLlamaTokenizerFast

    hf = CodeLlamaTokenizerFast(tokenizer_file=str(codellama / "tokenizer.json"), bos_token="<s>",
                                eos_token="</s>", unk_token="<unk>")
    ours = Tokenizer.from_folder(codellama)
    prompt = build_infill_prompt(ours, prefix, suffix)
    assert prompt.token_ids == hf(prefix, suffix=suffix)["input_ids"]
    pre, suf, mid, eot = (ours.token_to_id(t) for t in CODELLAMA_FIM)
    assert prompt.token_ids[:2] == [ours.bos_token_id, pre] and prompt.token_ids[-1] == mid
    assert prompt.token_ids.index(suf) > 1
    assert prompt.stop_token_ids == (eot,)


def test_codellama_one_sided_holes(codellama: Path) -> None:
    tok = Tokenizer.from_folder(codellama)
    pre, suf, mid, _ = (tok.token_to_id(t) for t in CODELLAMA_FIM)
    assert build_infill_prompt(tok, "def f", "").token_ids == [1, pre, *tok.encode("def f", False), suf, mid]
    only_suffix = build_infill_prompt(tok, "", "return x").token_ids
    assert only_suffix[:3] == [1, pre, suf] and only_suffix[-1] == mid
    # The suffix has no leading-space marker: it decodes to itself, not " return x".
    assert tok._tok.decode(only_suffix[3:-1]) == "return x"
    assert tok.id_to_token(only_suffix[3]).startswith("\u2581") is False


@pytest.mark.parametrize("prefix,suffix", CASES)
def test_starcoder_prompt_equals_documented_text(tmp_path: Path, prefix: str, suffix: str) -> None:
    tok = Tokenizer.from_folder(starcoder_tokenizer_folder(tmp_path))
    prompt = build_infill_prompt(tok, prefix, suffix)
    text = f"<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"
    assert prompt.token_ids == tok.encode(text, add_special_tokens=False)
    fim = tok.fim_tokens
    assert [t for t in prompt.token_ids if t in (fim.prefix, fim.suffix, fim.middle)] == [
        fim.prefix, fim.suffix, fim.middle]
    assert prompt.stop_token_ids == ()     # StarCoder ends a middle with <|endoftext|>, already eos


def test_refusals(tmp_path: Path) -> None:
    plain = Tokenizer.from_folder(starcoder_tokenizer_folder(tmp_path / "plain", fim=False))
    with pytest.raises(UnsupportedError, match="infill: the model's tokenizer has no fill-in-the-middle tokens"):
        build_infill_prompt(plain, "a", "b")
    fim = Tokenizer.from_folder(starcoder_tokenizer_folder(tmp_path / "fim"))
    with pytest.raises(ValueError, match="infill: prefix and suffix must not both be empty"):
        build_infill_prompt(fim, "", "")
    with pytest.raises(ValueError, match="infill.suffix: must be a string"):
        build_infill_prompt(fim, "a", None)
