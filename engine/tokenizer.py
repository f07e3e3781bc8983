"""The model's tokenizer and chat template, built on the ``tokenizers`` library.

Two sources:
  * GGUF metadata (``tokenizer.ggml.*``): ``model == "gpt2"`` is byte-level BPE; the vocabulary,
    merges and token types (3 = control → special, 4 = user-defined → added) are in the file,
    the pre-tokenizer is named by ``tokenizer.ggml.pre`` and rebuilt here (llama.cpp's
    ``llama-vocab.cpp`` lists the regexes per name). ``model == "llama"`` is a SentencePiece BPE
    vocabulary (Llama 2, Mistral 7B, TinyLlama, CodeLlama...): pieces with ``▁`` for a space,
    ``<0xNN>`` byte-fallback pieces and a score each, no merges; the merges are rebuilt from the
    scores (a pair merges with its piece's score as priority, as SentencePiece's BPE does and as
    transformers rebuilds them), ``▁`` is prepended to the text's start when
    ``tokenizer.ggml.add_space_prefix`` (the default) says so, and BOS is added unless the file
    says not to.
  * a folder with ``tokenizer.json`` (+ ``tokenizer_config.json`` for the chat template and the
    special tokens, ``generation_config.json`` for extra stop ids).

Stop tokens (``eos_token_ids``): the file's eos id, plus every end-of-turn token the chat template
writes. A chat model ends its reply with the template's end-of-turn token, which need not be the
file's eos: a GGUF converted from a base-model config can name ``<|endoftext|>`` or
``<|im_start|>`` as eos while the instruct model closes turns with ``<|im_end|>``. A serving
engine that stopped only on the file's eos would run on into a made-up next turn.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors

from sluice.engine.chat_template import render_chat_template
from sluice.engine.errors import ModelLoadError

# Tokens that close a chat turn in the common templates (ChatML, Llama 3, Phi-3, Gemma, Mistral).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>")
# (prefix, suffix, middle) spellings: StarCoder/SmolLM, Qwen2.5-Coder, CodeLlama (SentencePiece "▁<PRE>").
_FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<PRE>", "<SUF>", "<MID>"),
    ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>"),
)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4


def _byte_level(split_digits: bool = False, regex: str | None = None):
    """ByteLevel with GPT-2's regex, or after a custom split; optionally each digit alone first."""
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps)


# tokenizer.ggml.pre → pre-tokenizer. "smollm"/"starcoder": digits one by one, then GPT-2's regex.
_GGUF_PRE = {
    "default": lambda: _byte_level(),
    "gpt-2": lambda: _byte_level(),
    "gpt2": lambda: _byte_level(),
    "smollm": lambda: _byte_level(split_digits=True),
    "starcoder": lambda: _byte_level(split_digits=True),
    "refact": lambda: _byte_level(split_digits=True),
    "llama3": lambda: _byte_level(regex=_LLAMA3_SPLIT),
    "llama-bpe": lambda: _byte_level(regex=_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _byte_level(regex=_LLAMA3_SPLIT),
    "qwen2": lambda: _byte_level(regex=_QWEN2_SPLIT),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int


@dataclass(frozen=True)
class _Specials:
    bos: str | None
    eos: str | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    extra_eos_ids: tuple[int, ...] = ()
    fim_ids: tuple[int, int, int] | None = None


class Tokenizer:
    def __init__(self, backend: HFTokenizer, specials: _Specials) -> None:
        self._tok = backend
        self.chat_template = specials.chat_template
        self.bos_token = specials.bos
        self.eos_token = specials.eos
        self.bos_token_id = self._id_or_none(specials.bos)
        self.eos_token_id = self._id_or_none(specials.eos)
        self._special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.eos_token_ids = self._stop_ids(specials)
        self.fim_tokens = self._fim(specials.fim_ids)
        self._set_post_processor(specials.add_bos, specials.add_eos)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader, path: str | Path = "<gguf>") -> Tokenizer:
        from sluice.engine.loaders.gguf_loader import gguf_metadata

        def meta(key, default=None):
            return gguf_metadata(reader, f"tokenizer.{key}", default)

        kind = meta("ggml.model")
        tokens, types = meta("ggml.tokens"), meta("ggml.token_type") or []
        if kind == "llama":
            scores = meta("ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise ModelLoadError(f"{path}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
            backend = _gguf_spm(tokens, [float(s) for s in scores], types, bool(meta("ggml.add_space_prefix", True)))
        elif kind == "gpt2":
            pre = meta("ggml.pre", "default")
            if pre not in _GGUF_PRE:
                raise ModelLoadError(
                    f"{path}: GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_GGUF_PRE))}")
            backend = _gguf_bpe(tokens, meta("ggml.merges") or [], types, _GGUF_PRE[pre]())
        else:
            raise ModelLoadError(
                f"{path}: tokenizer.ggml.model {kind!r} is not supported from GGUF (byte-level BPE 'gpt2' and "
                "SentencePiece BPE 'llama' are); load the model's Hugging Face folder (tokenizer.json) instead")
        tok_at = lambda key: tokens[meta(key)] if meta(key) is not None else None  # noqa: E731
        fim = tuple(meta(f"ggml.fim_{k}_token_id") for k in ("pre", "suf", "mid"))
        specials = _Specials(
            bos=tok_at("ggml.bos_token_id"), eos=tok_at("ggml.eos_token_id"),
            add_bos=bool(meta("ggml.add_bos_token", kind == "llama")),   # SentencePiece files: BOS unless said
            add_eos=bool(meta("ggml.add_eos_token", False)),
            chat_template=meta("chat_template"),
            extra_eos_ids=tuple(i for i in (meta("ggml.eot_token_id"), meta("ggml.eom_token_id")) if i is not None),
            fim_ids=fim if None not in fim else None,
        )
        return cls(backend, specials)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{path}: unreadable tokenizer.json: {exc}") from exc
        # Some files (e.g. all-MiniLM-L6-v2) pin padding/truncation to 128; encode() returns the text's
        # own ids, and length limits are the caller's to enforce with a clear error.
        backend.no_padding()
        backend.no_truncation()
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        gen_eos = gen.get("eos_token_id")
        template_file = folder / "chat_template.jinja"
        template = _pick_template(cfg.get("chat_template"))
        if template is None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        specials = _Specials(
            bos=_token_str(cfg.get("bos_token")), eos=_token_str(cfg.get("eos_token")),
            # tokenizer.json's own post-processor already adds what the model wants.
            add_bos=False, add_eos=False, chat_template=template,
            extra_eos_ids=tuple(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []),
        )
        return cls(backend, specials)

    def save_folder(self, folder: str | Path) -> Path:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` so
        that ``from_folder(folder)`` gives this tokenizer back: the same ids both ways, special
        tokens, stop ids and chat template (e.g. a GGUF's tokenizer beside safetensors weights).
        FIM tokens are found again by their spelling."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(folder / "tokenizer.json"))   # carries the BOS/EOS post-processor
        config = {"bos_token": self.bos_token, "eos_token": self.eos_token, "chat_template": self.chat_template}
        (folder / "tokenizer_config.json").write_text(
            json.dumps({k: v for k, v in config.items() if v is not None}, ensure_ascii=False), encoding="utf-8")
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(self.eos_token_ids)}))
        return folder

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _stop_ids(self, specials: _Specials) -> frozenset[int]:
        ids = {i for i in (self.eos_token_id, *specials.extra_eos_ids) if i is not None}
        template = specials.chat_template or ""
        for token in _END_OF_TURN:
            tid = self._tok.token_to_id(token)
            if tid is not None and token in template:
                ids.add(tid)
        return frozenset(ids)

    def _fim(self, ids: tuple[int, int, int] | None) -> FimTokens | None:
        if ids is not None:
            return FimTokens(*ids)
        for spelling in _FIM_SPELLINGS:
            found = [self._tok.token_to_id(t) for t in spelling]
            if None not in found:
                return FimTokens(*found)
        return None

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        if not (add_bos or add_eos):
            return
        pieces = [(self.bos_token, self.bos_token_id)] if add_bos and self.bos_token_id is not None else []
        single = " ".join([*(t for t, _ in pieces), "$A"])
        if add_eos and self.eos_token_id is not None:
            pieces.append((self.eos_token, self.eos_token_id))
            single += f" {self.eos_token}"
        self._tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=pieces)

    # -- API ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: must be a string, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None, **extra) -> str:
        if not self.chat_template:
            raise ValueError("messages: this model has no chat template; send a plain prompt instead")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token, eos_token=self.eos_token, **extra,
        )


def _gguf_bpe(tokens: list[str], merges: list[str], types: list[int], pre) -> HFTokenizer:
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    # A few converters store a token in plain UTF-8 rather than the byte alphabet: respell those.
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    # Control tokens outside the byte alphabet are llama.cpp mislabels; adding them would grow the vocab.
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k == _CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
            if k == _USER_DEFINED and t in vocab]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


def _gguf_spm(tokens: list[str], scores: list[float], types: list[int], space_prefix: bool) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (GGUF ``llama``) as a ``tokenizers`` BPE with byte fallback."""
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, vocab), fuse_unk=True,
                                     byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if space_prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if space_prefix else []))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                        if k == _USER_DEFINED])
    return backend


def spm_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a piece into two pieces of
    the vocabulary, ranked by the whole piece's score (best first), then by longer left and right
    parts, then by the order of the pieces and their parts' ids."""
    ranked = []
    seen = set()
    for piece, score in zip(tokens, scores):
        if piece in seen:
            continue
        seen.add(piece)
        splits = [(vocab[piece[:i]], vocab[piece[i:]], i) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        for left_id, right_id, i in sorted(splits):
            ranked.append((-score, -i, -(len(piece) - i), len(ranked), piece[:i], piece[i:]))
    ranked.sort()
    return [(left, right) for *_key, left, right in ranked]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable JSON: {exc}") from exc


def _token_str(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value) -> str | None:
    """A template string, or the "default" entry of a list of named templates."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None
