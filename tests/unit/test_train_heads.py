"""``sluice train-heads`` end to end on the random-weight model with SmolLM2's tokenizer and chat
template: it generates its corpus with the engine, trains both kinds of heads, and writes them in
the public layouts the loaders read (FasterDecoding's Medusa without per-head LM heads and
EAGLE-1, both with a ``t2d`` draft vocabulary); the training reduces its loss; the engine serves with the
written heads and greedy output stays that of no speculation. The training's pieces (prompts,
labels, the draft vocabulary) are checked on their own."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from sluice.engine.cli import main as cli_main
from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.training import train
from sluice.engine.spec_decode.heads import load_eagle, load_medusa

pytestmark = pytest.mark.timeout(300)


def test_prompts_are_distinct_bounded_and_not_the_benchmarks():
    every = train.training_prompts(train.MAX_PROMPTS)
    assert len(set(every)) == len(every) == train.MAX_PROMPTS == len(train.training_prompts(train.MAX_PROMPTS + 9))
    how = {t.format(a) for a in train.ACTIVITIES for t in train.HOW_TASKS}
    assert 0 < len(how & set(train.training_prompts(200))) < 200     # both families are drawn from
    assert train.training_prompts(5, seed=1) == train.training_prompts(5, seed=1) != train.training_prompts(5)
    from bench.prompts import GROUNDED, OPEN
    assert not set(every) & set(GROUNDED + OPEN)


def test_a_corpus_format_that_does_not_exist_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(["smollm2", "--out", str(tmp_path), "--corpus-quantization", "int3"])
    assert "--corpus-quantization: invalid choice: 'int3'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_labels_are_the_greedy_choices_and_the_draft_vocabulary_the_most_frequent():
    w = torch.randn(10, 4)
    f = torch.randn(7, 4)
    (labels,) = train.greedy_labels([f], w, chunk=3)
    assert torch.equal(labels, (f @ w.T).argmax(-1))
    mask = train.draft_vocabulary([torch.tensor([3, 3, 3, 5, 5, 1, 9])], 10, 2)
    assert mask.tolist() == [i in (3, 5) for i in range(10)]


def test_only_answer_positions_are_trained_and_scored(tmp_path):
    # Conversation of 8 tokens whose answer starts at 5: y_j (label j) is the choice for token j + 1.
    lab = torch.arange(10, 18)
    first, second = train._answer_targets(lab, 5, 7)
    # The first draft from the pair at i >= 4 (the prompt's last position), labels y_{i+1}.
    assert first.tolist() == [-100] * 4 + [15, 16, 17]
    # The second draft's row p - 1 drafts y_{p+1}, for p >= 5.
    assert second.tolist() == [-100] * 4 + [16, 17]
    # Medusa head k on h_t (t >= 4) learns y_{t+1+k}.
    y = train._medusa_targets([lab], 2, [5])
    assert y[:, 0].tolist() == [-100] * 4 + [15, 16, 17, -100]
    assert y[:, 1].tolist() == [-100] * 4 + [16, 17, -100, -100]
    # The corpus keeps where each answer starts; a file without it is refused, not misread.
    path = tmp_path / "corpus.json"
    train.write_corpus(path, [[1, 2, 3], [4, 5]], [2, 1])
    assert train.read_corpus(path) == ([[1, 2, 3], [4, 5]], [2, 1])
    path.write_text(json.dumps([[1, 2, 3]]))
    with pytest.raises(SystemExit, match="answer_start"):
        train.read_corpus(path)


def test_train_heads_writes_public_layouts_that_serve(tiny_smollm2, tmp_path, capsys):
    out = tmp_path / "heads"
    corpus = tmp_path / "corpus.json"
    rc = cli_main(["train-heads", str(tiny_smollm2), "--out", str(out), "--num-prompts", "12", "--max-tokens", "24",
                   "--medusa-heads", "3", "--medusa-epochs", "6", "--eagle-epochs", "6", "--draft-vocab", "256",
                   "--corpus", str(corpus)])
    assert rc == 0
    log = capsys.readouterr().err
    # The losses fall over the epochs.
    medusa = [float(x) for x in re.findall(r"medusa epoch \d+/\d+: loss ([\d.]+)", log)]
    eagle = [float(x) for x in re.findall(r"eagle epoch \d+/\d+: smooth-L1 ([\d.]+)", log)]
    assert len(medusa) == len(eagle) == 6
    assert medusa[-1] < medusa[0] and eagle[-1] < eagle[0], log
    sequences, starts = train.read_corpus(corpus)
    assert len(sequences) == len(starts) == 12 and all(isinstance(t, int) for s in sequences for t in s)
    assert all(0 < a < len(s) for s, a in zip(sequences, starts))     # a prompt, then an answer

    # The files are the public layouts, read back by the loaders.
    cfg = json.loads((out / "medusa" / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 1)
    keys = set(load_file(str(out / "medusa" / "medusa_lm_head.safetensors")))
    assert keys == {f"{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias")} | {"t2d"}
    state = load_file(str(out / "eagle" / "model.safetensors"))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight", "t2d"} <= set(state)
    assert state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 256
    loaded = load_model(str(tiny_smollm2))
    medusa_heads = load_medusa(out / "medusa", loaded.arch)
    assert medusa_heads.num_heads == 3 and medusa_heads.draft_vocab.numel() == 256
    assert load_eagle(out / "eagle", loaded.arch).draft_vocab.numel() == 256

    # Served: greedy output identical to no speculation, with drafts proposed.
    opts = dict(device="cpu", num_threads=1, spec_max_batch_size=8)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["Write a poem about the sea.", "Hello there, how are you?"]
    want = [r.outputs[0].token_ids for r in LLM(loaded=loaded, device="cpu", num_threads=1).generate(prompts, sp)]
    for mode, k in (("medusa", 3), ("eagle", 4)):
        llm = LLM(loaded=loaded, speculative_mode=mode, additional_models=str(out / mode), spec_draft_length=k, **opts)
        got = llm.generate(prompts, sp)
        assert [r.outputs[0].token_ids for r in got] == want, mode
        assert sum(r.usage.draft_tokens for r in got) > 0, mode


@pytest.mark.oracle    # builds its models with transformers (the dev extra)
@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
def test_train_heads_on_other_architectures(arch, smollm2_tokenizer, tmp_path, capsys):
    """Not only Llamas: Gemma 3 (embeddings scaled by sqrt(hidden), tied and soft-capped logits,
    sliding layers) and Qwen3-MoE (routed experts, q/k norms), tiny random-weight models of
    tests/model/tiny_archs. Both kinds train (their cross-entropies fall), are read back, and
    serve with greedy output identical to no speculation. The random Gemma 3 answers by repeating
    tokens, which its heads learn: served on the conversations they trained on, their drafts are
    accepted (heads fed other hidden states than they trained on would not be)."""
    from tests.model import tiny_archs

    folder = tiny_archs.write_folder(tmp_path / arch, tiny_archs.build(arch, smollm2_tokenizer.vocab_size),
                                     smollm2_tokenizer)
    out = tmp_path / "heads"
    rc = cli_main(["train-heads", str(folder), "--out", str(out), "--num-prompts", "8", "--max-tokens", "16",
                   "--medusa-heads", "2", "--medusa-epochs", "3", "--eagle-epochs", "3", "--draft-vocab", "256"])
    assert rc == 0
    log = capsys.readouterr().err
    medusa = [float(x) for x in re.findall(r"medusa epoch \d+/\d+: loss ([\d.]+)", log)]
    eagle = [float(x) for x in re.findall(r"eagle epoch \d+/\d+: smooth-L1 [\d.]+, CE ([\d.]+)", log)]
    assert len(medusa) == len(eagle) == 3 and medusa[-1] < medusa[0] and eagle[-1] < eagle[0], log
    loaded = load_model(str(folder))
    assert loaded.arch.architecture == arch
    assert load_medusa(out / "medusa", loaded.arch).num_heads == 2
    assert load_eagle(out / "eagle", loaded.arch).draft_vocab.numel() == 256
    small = dict(device="cpu", num_threads=1, max_num_seqs=8, max_num_batched_tokens=64)
    sp = SamplingParams(temperature=0, max_tokens=16)
    chats = [[{"role": "user", "content": p}] for p in train.training_prompts(8)[:3]]
    want = [r.outputs[0].token_ids for r in LLM(loaded=loaded, **small).chat(chats, sp)]
    for mode in ("medusa", "eagle"):
        llm = LLM(loaded=loaded, speculative_mode=mode, additional_models=str(out / mode), spec_draft_length=2,
                  spec_max_batch_size=8, **small)
        got = llm.chat(chats, sp)
        assert [r.outputs[0].token_ids for r in got] == want, mode
        assert sum(r.usage.draft_tokens for r in got) > 0, mode
        if arch == "gemma3":
            assert sum(r.usage.accepted_tokens for r in got) > 0, mode
