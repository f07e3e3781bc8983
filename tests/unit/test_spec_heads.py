"""Medusa and EAGLE heads on the tiny random-weight model: the loaders read the public checkpoint
layouts (FasterDecoding's Medusa as ``medusa_lm_head.safetensors`` and the legacy
``medusa_lm_head.pt``, with and without per-head LM heads; SafeAILab's EAGLE-1 as
``pytorch_model.bin`` and ``model.safetensors``, with its ignored ``embed_tokens`` and an
optional input norm), written here by hand from plain dicts of tensors, and load what was written
with the layout's meaning (a residual block, the concat order of EAGLE's ``fc``); a checkpoint
that cannot serve the target is refused with a clear error naming the file, tensor and shapes;
greedy output with either mode is token for token the output without speculation, alone and for
16 mixed concurrent requests; and the KV pool and the EAGLE proposer's per-request state come
back to their baseline after rejections, cancellations and preemptions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.heads import EagleHead, HeadsLoadError, MedusaHeads, load_eagle, load_medusa
from sluice.engine.spec_decode.medusa import MedusaProposer
from tests.tiny_model import HEADS, HIDDEN, INTER, KV_HEADS, VOCAB, prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(300)
OPTS = dict(device="cpu", block_size=4, max_total_tokens=2048, num_threads=1)
HEAD_DIM = HIDDEN // HEADS
NUM_MEDUSA = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(folder):
    return load_model(str(folder))


@pytest.fixture(scope="module")
def base(tiny):
    return LLM(loaded=tiny, **OPTS)


# ---- the public layouts, by hand ----------------------------------------------------------------
def _rand(gen: torch.Generator, *shape: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale


def medusa_state(num_heads: int = NUM_MEDUSA, num_layers: int = 1, lm_heads: bool = True, hidden: int = HIDDEN,
                 vocab: int = VOCAB, seed: int = 0) -> dict[str, torch.Tensor]:
    """FasterDecoding's keys: head k's block j ``{k}.{j}.linear.{weight,bias}``, its LM head
    ``{k}.{num_layers}.weight`` (the last module of head k's Sequential)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k in range(num_heads):
        for j in range(num_layers):
            state[f"{k}.{j}.linear.weight"] = _rand(g, hidden, hidden)
            state[f"{k}.{j}.linear.bias"] = _rand(g, hidden)
        if lm_heads:
            state[f"{k}.{num_layers}.weight"] = _rand(g, vocab, hidden)
    return state


def write_medusa(folder: Path, state: dict, num_heads: int = NUM_MEDUSA, num_layers: int = 1,
                 fmt: str = "safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "tiny"}))
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(state, str(folder / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, folder / "medusa_lm_head.pt")
    return folder


def eagle_state(fc_bias: bool = True, input_norm: bool = False, embed: bool = False, hidden: int = HIDDEN,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """SafeAILab's EAGLE-1 keys: ``fc`` over concat(embedding, hidden), one Llama decoder layer
    without the input norm (unless ``input_norm``), optionally the embedding it was trained on."""
    g = torch.Generator().manual_seed(seed)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    p = "layers.0."
    state = {
        "fc.weight": _rand(g, hidden, 2 * hidden),
        p + "self_attn.q_proj.weight": _rand(g, q, hidden),
        p + "self_attn.k_proj.weight": _rand(g, kv, hidden),
        p + "self_attn.v_proj.weight": _rand(g, kv, hidden),
        p + "self_attn.o_proj.weight": _rand(g, hidden, q),
        p + "mlp.gate_proj.weight": _rand(g, INTER, hidden),
        p + "mlp.up_proj.weight": _rand(g, INTER, hidden),
        p + "mlp.down_proj.weight": _rand(g, hidden, INTER),
        p + "post_attention_layernorm.weight": 1 + _rand(g, hidden),
    }
    if fc_bias:
        state["fc.bias"] = _rand(g, hidden)
    if input_norm:
        state[p + "input_layernorm.weight"] = 1 + _rand(g, hidden)
    if embed:
        state["embed_tokens.weight"] = _rand(g, VOCAB, hidden)
    return state


def eagle_json(**changes) -> dict:
    """A one-layer Llama config.json as SafeAILab ships it (no head_dim: hidden / heads)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True, "hidden_act": "silu",
            "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 1024, "vocab_size": VOCAB,
            "torch_dtype": "float16"} | changes


def write_eagle(folder: Path, state: dict, cfg: dict | None = None, fmt: str = "safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg or eagle_json()))
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


@pytest.fixture(scope="module")
def heads_folders(tmp_path_factory):
    """mode -> a folder of random heads (seeded, small weights: see medusa_state / eagle_state)."""
    root = tmp_path_factory.mktemp("heads")
    return {"medusa": write_medusa(root / "medusa", medusa_state(lm_heads=False)),
            "eagle": write_eagle(root / "eagle", eagle_state())}


@pytest.fixture(scope="module")
def heads_with_draft_vocab(tmp_path_factory):
    """The same heads with a draft vocabulary (``t2d``) of every token: drafts are unchanged, but
    they go through the draft LM head's own copy, the part ``spec_head_format`` decides."""
    root = tmp_path_factory.mktemp("heads_t2d")
    every = {"t2d": torch.ones(VOCAB, dtype=torch.bool)}
    return {"medusa": write_medusa(root / "medusa", medusa_state(lm_heads=False) | every),
            "eagle": write_eagle(root / "eagle", eagle_state() | every)}


def _spec(tiny, mode: str, heads_folders, **kw) -> LLM:
    # Every draft proposed (spec_min_draft_prob=0): random heads are seldom confident, and these
    # tests are about verification; the stopping rule has its own test. Chains (the default for
    # the block formats); draft trees, the default for float32 models like this one, have
    # tests/unit/test_spec_tree.py.
    return LLM(loaded=tiny, speculative_mode=mode, additional_models=str(heads_folders[mode]),
               **(OPTS | dict(spec_max_batch_size=8, spec_min_draft_prob=0.0, spec_tree_width=1) | kw))


# ---- loading ------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("lm_heads", [True, False])
def test_medusa_public_layout_loads_what_was_written(tiny, tmp_path, fmt, lm_heads):
    layers = 2
    state = medusa_state(num_heads=3, num_layers=layers, lm_heads=lm_heads)
    heads = load_medusa(write_medusa(tmp_path / "m", state, 3, layers, fmt), tiny.arch)
    assert isinstance(heads, MedusaHeads) and (heads.num_heads, heads.num_layers) == (3, layers)
    assert (heads.lm_heads is None) == (not lm_heads)   # without: the target's LM head is shared
    assert heads.public_state_dict().keys() == state.keys()
    for name, t in heads.public_state_dict().items():
        assert torch.equal(t, state[name]), name
    # The layout's meaning: head k is x + SiLU(W x + b), block after block, then its LM head.
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = heads.logits(h, tiny.model.compute_logits)
        for k in range(3):
            x = h
            for j in range(layers):
                x = x + F.silu(x @ state[f"{k}.{j}.linear.weight"].T + state[f"{k}.{j}.linear.bias"])
            want = x @ state[f"{k}.{layers}.weight"].T if lm_heads else tiny.model.compute_logits(x)
            torch.testing.assert_close(got[:, k], want.float(), rtol=1e-4, atol=1e-4)


def test_medusa_safetensors_is_preferred_to_the_legacy_pt(tiny, tmp_path):
    folder = write_medusa(tmp_path / "m", medusa_state(seed=1))
    torch.save(medusa_state(seed=2), folder / "medusa_lm_head.pt")
    heads = load_medusa(folder, tiny.arch)
    assert torch.equal(heads.blocks[0][0].linear.weight, medusa_state(seed=1)["0.0.linear.weight"])


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("extras", [dict(), dict(embed=True, input_norm=True), dict(fc_bias=False)])
def test_eagle_public_layout_loads_what_was_written(tiny, tmp_path, fmt, extras):
    state = eagle_state(**extras)
    head = load_eagle(write_eagle(tmp_path / "e", state, fmt=fmt), tiny.arch)
    assert isinstance(head, EagleHead)
    assert (head.input_layernorm is not None) == ("layers.0.input_layernorm.weight" in state)
    assert (head.fc.bias is not None) == ("fc.bias" in state)
    own = head.public_state_dict()
    assert own.keys() == state.keys() - {"embed_tokens.weight"}   # the target's embedding is used
    for name, t in own.items():
        assert torch.equal(t, state[name]), name
    # The layout's meaning, on one pair (attention over one entry is its value; RoPE leaves
    # values alone): fc over concat(embedding, hidden) first, then the decoder layer.
    g = torch.Generator().manual_seed(4)
    e, h = torch.randn(1, HIDDEN, generator=g), torch.randn(1, HIDDEN, generator=g)
    p = "layers.0."
    x = torch.cat((e, h), -1) @ state["fc.weight"].T + state.get("fc.bias", 0)
    a = _rms(x, state[p + "input_layernorm.weight"]) if p + "input_layernorm.weight" in state else x
    v = (a @ state[p + "self_attn.v_proj.weight"].T).reshape(1, KV_HEADS, HEAD_DIM)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1).reshape(1, -1)   # GQA: query head i reads kv head i // 2
    x = x + v @ state[p + "self_attn.o_proj.weight"].T
    m = _rms(x, state[p + "post_attention_layernorm.weight"])
    want = x + (F.silu(m @ state[p + "mlp.gate_proj.weight"].T) * (m @ state[p + "mlp.up_proj.weight"].T)) \
        @ state[p + "mlp.down_proj.weight"].T
    with torch.no_grad():
        got = head(e, h, [7])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_heads_module_given_directly_skips_the_file(base, tiny):
    module = MedusaHeads(HIDDEN, NUM_MEDUSA, 1)   # zero blocks: every head proposes from h_t itself
    llm = LLM(loaded=tiny, speculative_mode="medusa", additional_models="/no/such/folder", heads=module,
              spec_max_batch_size=8, **OPTS)
    assert isinstance(llm.engine.spec.proposer, MedusaProposer) and llm.engine.spec.proposer.heads is module
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = llm.generate([prompt(7)], sp)[0]
    assert got.outputs[0].token_ids == base.generate([prompt(7)], sp)[0].outputs[0].token_ids
    assert got.usage.draft_tokens > 0


# ---- errors -------------------------------------------------------------------------------------
def _without(state: dict, *names: str) -> dict:
    return {k: v for k, v in state.items() if k not in names}


def _medusa_case(name: str, tmp: Path) -> Path:
    s = medusa_state()
    if name == "wrong shape":
        return write_medusa(tmp, s | {"1.0.linear.bias": torch.zeros(HIDDEN + 1)})
    if name == "other hidden size":
        return write_medusa(tmp, medusa_state(hidden=32))
    if name == "other vocabulary":
        return write_medusa(tmp, medusa_state(vocab=VOCAB + 5))
    if name == "some LM heads":
        return write_medusa(tmp, _without(s, "2.1.weight"))
    if name == "no config":
        (write_medusa(tmp, s) / "config.json").unlink()
        return tmp
    if name == "no weights":
        (write_medusa(tmp, s) / "medusa_lm_head.safetensors").unlink()
        return tmp
    if name == "extra tensors":
        return write_medusa(tmp, s, num_heads=3)
    if name == "wrong layers":
        return write_medusa(tmp, s, num_layers=2)
    if name == "bad config":
        write_medusa(tmp, s)
        (tmp / "config.json").write_text(json.dumps({"medusa_num_layers": 1}))
        return tmp
    if name == "unreadable":
        write_medusa(tmp, s, fmt="pt")
        (tmp / "medusa_lm_head.pt").write_bytes(b"not a checkpoint")
        return tmp
    raise AssertionError(name)


@pytest.mark.parametrize("case, message", [
    ("wrong shape", r"medusa_lm_head\.safetensors: 1\.0\.linear\.bias has shape \(65,\), expected \(64,\)"),
    ("other hidden size", r"0\.0\.linear\.weight has shape \(32, 32\), expected \(64, 64\) for the target "
                          r"\(hidden size 64"),
    ("other vocabulary", r"0\.1\.weight has shape \(133, 64\), expected \(128, 64\) .*vocabulary 128"),
    ("some LM heads", r"heads \[2\] have no LM head \(\{k\}\.1\.weight\) and the others do"),
    ("no config", r"has no config\.json"),
    ("no weights", r"holds none of medusa_lm_head\.safetensors, medusa_lm_head\.pt"),
    ("extra tensors", r"has tensors a 3-head, 1-layer Medusa does not: 3\.0\.linear\.bias"),
    ("wrong layers", r"has no tensor '0\.1\.linear\.weight'"),
    ("bad config", r"medusa_num_heads must be an integer >= 1, got None"),
    ("unreadable", r"cannot read .*medusa_lm_head\.pt"),
])
def test_medusa_checkpoint_that_cannot_serve_the_target_is_refused(tiny, tmp_path, case, message):
    folder = _medusa_case(case, tmp_path / "m")
    with pytest.raises(HeadsLoadError, match=message) as err:
        load_medusa(folder, tiny.arch)
    assert isinstance(err.value, ValueError) and str(err.value).startswith("additional_models: ")


def _eagle_case(name: str, tmp: Path) -> Path:
    s = eagle_state()
    if name == "wrong shape":   # a k_proj for as many heads as the queries (no GQA)
        return write_eagle(tmp, s | {"layers.0.self_attn.k_proj.weight": torch.zeros(HIDDEN, HIDDEN)})
    if name == "other hidden size":
        return write_eagle(tmp, eagle_state(hidden=32), eagle_json(hidden_size=32))
    if name == "other vocabulary":
        return write_eagle(tmp, s, eagle_json(vocab_size=32000))
    if name == "two layers":
        return write_eagle(tmp, s, eagle_json(num_hidden_layers=2))
    if name == "no config":
        (write_eagle(tmp, s) / "config.json").unlink()
        return tmp
    if name == "no weights":
        (write_eagle(tmp, s) / "model.safetensors").unlink()
        return tmp
    if name == "extra tensors":
        return write_eagle(tmp, s | {"layers.1.mlp.up_proj.weight": torch.zeros(INTER, HIDDEN)})
    if name == "missing tensor":
        return write_eagle(tmp, _without(s, "layers.0.mlp.down_proj.weight"), fmt="bin")
    if name == "not tensors":
        write_eagle(tmp, s, fmt="bin")
        torch.save({"fc.weight": 1}, tmp / "pytorch_model.bin")
        return tmp
    if name == "bad config":
        return write_eagle(tmp, s, _without(eagle_json(), "intermediate_size"))
    raise AssertionError(name)


@pytest.mark.parametrize("case, message", [
    ("wrong shape", r"model\.safetensors: layers\.0\.self_attn\.k_proj\.weight has shape \(64, 64\), "
                    r"expected \(32, 64\)"),
    ("other hidden size", r"is for hidden size 32, the target's is 64"),
    ("other vocabulary", r"is for a vocabulary of 32000 tokens, the target's has 128"),
    ("two layers", r"an EAGLE head has one layer, num_hidden_layers is 2"),
    ("no config", r"has no config\.json"),
    ("no weights", r"holds none of model\.safetensors, pytorch_model\.bin"),
    ("extra tensors", r"has tensors a one-layer EAGLE head does not: layers\.1\.mlp\.up_proj\.weight"),
    ("missing tensor", r"pytorch_model\.bin has no tensor 'layers\.0\.mlp\.down_proj\.weight'"),
    ("not tensors", r"pytorch_model\.bin is not a state dict of tensors"),
    ("bad config", r"config\.json: intermediate_size: missing from config\.json"),
])
def test_eagle_checkpoint_that_cannot_serve_the_target_is_refused(tiny, tmp_path, case, message):
    folder = _eagle_case(case, tmp_path / "e")
    with pytest.raises(HeadsLoadError, match=message) as err:
        load_eagle(folder, tiny.arch)
    assert isinstance(err.value, ValueError) and str(err.value).startswith("additional_models: ")


@pytest.mark.parametrize("mode, write, message", [
    ("medusa", lambda d: write_medusa(d, medusa_state(hidden=32)), r"expected \(64, 64\)"),
    ("eagle", lambda d: write_eagle(d, eagle_state(), eagle_json(vocab_size=256)), "vocabulary of 256 tokens"),
    ("eagle", lambda d: d, "has no config.json"),
])
def test_the_engine_refuses_such_heads_at_start_up(tiny, tmp_path, mode, write, message):
    folder = tmp_path / "heads"
    folder.mkdir()
    with pytest.raises(HeadsLoadError, match=message):
        LLM(loaded=tiny, speculative_mode=mode, additional_models=str(write(folder)), **OPTS)


def test_more_drafts_than_medusa_heads_is_refused_at_start_up(tiny, heads_folders):
    with pytest.raises(ValueError, match=rf"spec_draft_length: the Medusa heads in .* propose at most "
                                         rf"{NUM_MEDUSA} drafts, spec_draft_length is 5"):
        _spec(tiny, "medusa", heads_folders, spec_draft_length=5)
    with pytest.raises(ValueError, match="propose at most 2 drafts, spec_draft_length is 4"):
        LLM(loaded=tiny, speculative_mode="medusa", additional_models="in-memory", heads=MedusaHeads(HIDDEN, 2),
            **OPTS)
    _spec(tiny, "medusa", heads_folders, spec_draft_length=NUM_MEDUSA)   # as many as heads: fine


@pytest.mark.parametrize("mode, words", [("eagle", "needs EAGLE heads"), ("medusa", "needs Medusa heads")])
def test_heads_folder_missing_is_a_config_error_before_anything_loads(tmp_path, mode, words):
    missing = tmp_path / "no-such-model"   # loading it would raise ModelLoadError, not ValueError
    with pytest.raises(ValueError, match=f"additional_models: speculative_mode {mode} {words} "
                                         r"\(--additional-models PATH\)") as err:
        LLM(str(missing), device="cpu", speculative_mode=mode)
    assert not isinstance(err.value, HeadsLoadError)


# ---- greedy output identical ---------------------------------------------------------------------
def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        go, wo = g.outputs[0], w.outputs[0]
        assert go.token_ids == wo.token_ids
        assert go.finish_reason == wo.finish_reason
        assert (go.logprobs is None) == (wo.logprobs is None)
        for a, b in zip(go.logprobs or (), wo.logprobs or (), strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def single_requests_same_as(llm: LLM, base: LLM) -> tuple[int, int]:
    """Four greedy requests one at a time, with logprobs and a penalty or a bias, each checked
    against ``base``; returns the drafts verified and accepted."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, presence_penalty=0.2)
    # The bias makes the output run through w7, where even random heads' drafts are accepted.
    biased = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, logit_bias={7: 4.0})
    drafted = accepted = 0
    for p, params in ((prompt(5), sp), (prompt(23) + " w1 w2 w3 w1 w2", sp), ("w9 w9 w9 w9", biased),
                      (prompt(11), biased)):
        got = llm.generate([p], params)
        _assert_same(got, base.generate([p], params))
        drafted += got[0].usage.draft_tokens
        accepted += got[0].usage.accepted_tokens
    return drafted, accepted


@pytest.mark.parametrize("head_format", ["float32", "w8a8"])
@pytest.mark.parametrize("mode", ["eagle", "medusa"])
def test_greedy_identical_to_no_speculation_one_request_at_a_time(base, tiny, heads_with_draft_vocab, mode,
                                                                   head_format):
    llm = _spec(tiny, mode, heads_with_draft_vocab, spec_head_format=head_format)
    proposer = llm.engine.spec.proposer
    assert proposer._lm.format == proposer.head_format == head_format   # the LM head's copy, and EAGLE's layer
    drafted, accepted = single_requests_same_as(llm, base)
    assert drafted > accepted > 0   # logprobs inside accepted runs, and after rejections
    if mode == "eagle":
        assert not llm.engine.spec.proposer._caches   # dropped as each request finished


def _mixed(base) -> tuple[list[str], list[SamplingParams]]:
    """16 requests: prompt lengths 3-45, max_tokens 6-40, some with stop ids (a token the
    unstopped output reaches), penalties, logprobs, and a logit bias that makes the output run
    through w7 often, where even random heads' drafts are accepted (the rest are mostly not)."""
    prompts = [prompt(3 + 3 * i) + (" w1 w2 w1 w2" if i % 4 == 1 else "") for i in range(16)]
    kws = []
    for i in range(16):
        kw = dict(temperature=0, max_tokens=6 + (i * 7) % 35, ignore_eos=True)
        if i % 4 == 2:
            kw["presence_penalty"] = 0.5
        if i % 5 == 1:
            kw |= dict(frequency_penalty=0.3, repetition_penalty=1.2)
        if i % 4 == 3:
            kw["logit_bias"] = {7: 4.0}
        if i % 2 == 1:
            kw["logprobs"] = 1 + i % 3
        kws.append(kw)
    free = base.generate(prompts, [SamplingParams(**kw) for kw in kws])
    for i in range(0, 16, 3):
        toks = free[i].outputs[0].token_ids
        kws[i]["stop_token_ids"] = [toks[len(toks) // 2]]
    return prompts, [SamplingParams(**kw) for kw in kws]


@pytest.mark.parametrize("mode", ["eagle", "medusa"])
def test_greedy_identical_for_16_mixed_concurrent_requests(base, tiny, heads_folders, mode):
    prompts, params = _mixed(base)
    llm = _spec(tiny, mode, heads_folders, spec_max_batch_size=16)
    got = llm.generate(prompts, params)
    want = base.generate(prompts, params)
    _assert_same(got, want)
    assert sum(w.outputs[0].finish_reason == "stop" for w in want) >= 3   # the stops cut somewhere
    assert all(r.usage.draft_tokens > 0 for r in got if len(r.outputs[0].token_ids) > 2)
    assert sum(r.usage.accepted_tokens for r in got) > 0
    if mode == "eagle":
        assert not llm.engine.spec.proposer._caches


# ---- the KV pool and the proposer's state -------------------------------------------------------
def _assert_pool_idle(llm, finals: list[list[int]], block_size: int = 4) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    st = kv.stats()
    assert st.in_use == 0 and st.free + st.cached == st.total
    chunks = {tuple(t[i:i + block_size]) for t in finals for i in range(0, len(t) - block_size + 1, block_size)}
    for block in kv.pool.created:   # the blocks ever handed out
        if block.block_hash is not None:   # only verified tokens are ever registered
            assert block.token_ids in chunks, block.token_ids


@pytest.mark.parametrize("width", [1, 3])    # chains, draft trees
@pytest.mark.parametrize("mode", ["eagle", "medusa"])
def test_pool_and_proposer_back_to_baseline_after_rejections_cancellations_and_preemptions(tiny, heads_folders,
                                                                                          mode, width):
    # 24 blocks of 4 tokens for four requests that each grow to ~50 tokens: preemptions, after
    # which EAGLE's head recomputes its cache with the target (the output shows it did right).
    llm = _spec(tiny, mode, heads_folders, max_total_tokens=96, spec_tree_width=width)
    ref = LLM(loaded=tiny, device="cpu", block_size=4, max_total_tokens=96, num_threads=1)
    prompts = [prompt(10) + " w3 w4 w3 w4", prompt(14), "w1 w2 " * 6, prompt(8)]
    sp = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    got = llm.generate(prompts, sp)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in ref.generate(prompts, sp)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(r.usage.draft_tokens for r in got) > sum(r.usage.accepted_tokens for r in got)   # rejections
    _assert_pool_idle(llm, [r.prompt_token_ids + r.outputs[0].token_ids for r in got])
    proposer = llm.engine.spec.proposer
    if mode == "eagle":
        assert not proposer._caches and not proposer._next and not proposer._preemptions
    core = llm.engine   # cancellations mid-run, drafts outstanding, sampled (draft distributions kept)
    for i, p in enumerate(prompts):
        core.add_request(f"c{i}", p, SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True, seed=i))
    for _ in range(6):
        core.step()
    assert any(r.spec_token_ids and (r.spec_parents is not None) == (width > 1) for r in core.scheduler.running)
    core.abort_request([f"c{i}" for i in range(len(prompts))])
    while core.has_unfinished_requests():
        core.step()
    core.kv.check_invariants()
    assert core.kv.stats().in_use == 0
    assert not core.runner.spec.draft_probs
    if mode == "eagle":
        assert not proposer._caches and not proposer._next and not proposer._preemptions
    assert not proposer.generators._by_request


def _echo_heads(mode: str):
    """Heads whose every draft is the token the target just emitted (greedy, no penalties): Medusa
    with zero residual blocks and the target's LM head reads h_t itself; EAGLE with fc = [0 | I]
    and every other weight zero predicts h_t again (attention and MLP add nothing). So a draft
    that is not the last token means the proposer read some other hidden row than the one behind
    it (a stale one, a rejected draft's, the wrong position after a preemption)."""
    if mode == "medusa":
        return MedusaHeads(HIDDEN, NUM_MEDUSA, 1)   # ResBlocks start at zero
    state = {k: torch.zeros_like(v) for k, v in eagle_state().items()}
    state["fc.weight"][:, HIDDEN:] = torch.eye(HIDDEN)
    state["layers.0.post_attention_layernorm.weight"] += 1
    head = EagleHead(ModelArchConfig.from_hf_config(eagle_json()))
    with torch.no_grad():
        for name, t in head.public_state_dict().items():
            t.copy_(state[name])
    return head


@pytest.mark.parametrize("mode, width", [("eagle", 1), ("eagle", 3), ("medusa", 1), ("medusa", 3)])
def test_heads_read_the_row_behind_the_last_token_through_rejections_and_preemptions(tiny, mode, width):
    # float32 drafting: the echo must be exact (w8a8's rounded copies echo h_t only nearly).
    llm = LLM(loaded=tiny, speculative_mode=mode, additional_models="in-memory", heads=_echo_heads(mode),
              spec_max_batch_size=8, spec_min_draft_prob=0.0, spec_head_format="float32", spec_tree_width=width,
              **(OPTS | dict(max_total_tokens=96)))
    proposer = llm.engine.spec.proposer
    seen = {"drafts": 0, "preempted": 0}
    inner_propose, inner_observe = proposer.propose, proposer.observe

    def propose(requests, k):
        out = inner_propose(requests, k)
        by_id = {r.request_id: r for r in requests}
        for rid, draft in out.items():
            req = by_id[rid]
            # A tree's first node is the root's likeliest child; the rest are its other guesses.
            echoed = draft.token_ids if draft.parents is None else draft.token_ids[:1]
            assert echoed == [req.all_token_ids[-1]] * len(echoed), (rid, req.num_tokens)
            assert (draft.parents is None) == (width != 3)
            seen["drafts"] += 1
            seen["preempted"] += req.num_preemptions > 0
        return out

    def observe(requests, hidden_states):
        inner_observe(requests, hidden_states)
        for cache in getattr(proposer, "_caches", {}).values():   # EAGLE: positions only grow
            assert all(a < b for a, b in zip(cache.positions, cache.positions[1:])), cache.positions

    proposer.propose, proposer.observe = propose, observe
    ref = LLM(loaded=tiny, device="cpu", block_size=4, max_total_tokens=96, num_threads=1)
    prompts = [prompt(10) + " w3 w4 w3 w4", prompt(14), "w1 w2 " * 6, prompt(8)]
    sp = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    got = llm.generate(prompts, sp)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in ref.generate(prompts, sp)]
    assert llm.engine.scheduler.num_preemptions > 0 and seen["preempted"] > 0 and seen["drafts"] > 20


# ---- drafts end at the head's first unconfident token ---------------------------------------------
@pytest.mark.parametrize("mode", ["eagle", "medusa"])
def test_a_draft_ends_before_the_first_token_its_head_gives_less_than_min_prob(base, tiny, heads_folders,
                                                                             mode, monkeypatch):
    """One request at a time, so each propose() draws one request's drafts in order: the draft
    keeps exactly the leading tokens whose probability is at least the threshold, and ends at the
    first one under it. Output stays identical to no speculation."""
    import sluice.engine.spec_decode.eagle as eagle_mod
    import sluice.engine.spec_decode.medusa as medusa_mod
    from sluice.engine.spec_decode.proposer import draft_prob

    mod = eagle_mod if mode == "eagle" else medusa_mod
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={7: 3.0})
    # The threshold: the median probability the heads give their drafts here, so that drafts
    # end early in some steps and run to K in others.
    seen: list[float] = []
    monkeypatch.setattr(mod, "draft_prob", lambda *a: seen.append(draft_prob(*a)) or seen[-1])
    _spec(tiny, mode, heads_folders).generate([prompt(9)], sp)
    threshold = sorted(seen)[len(seen) // 2]

    calls: list[tuple[list[float], int]] = []
    llm = _spec(tiny, mode, heads_folders, spec_min_draft_prob=threshold)
    proposer = llm.engine.spec.proposer
    real = proposer.propose

    def propose(requests, k):
        seen.clear()
        out = real(requests, k)
        calls.append((list(seen), sum(len(d.token_ids) for d in out.values())))
        return out

    monkeypatch.setattr(proposer, "propose", propose)
    got = llm.generate([prompt(9)], sp)
    _assert_same(got, base.generate([prompt(9)], sp))
    lengths = []
    for probs, kept in calls:
        if not probs:
            continue
        assert all(p >= threshold for p in probs[:kept]), (probs, kept)
        assert kept == len(probs) or (kept == len(probs) - 1 and probs[-1] < threshold), (probs, kept)
        lengths.append(kept)
    assert 0 in lengths and any(n > 0 for n in lengths), lengths        # cut at once, and not


def test_min_draft_prob_is_checked_before_anything_loads():
    from sluice.engine.spec_decode.config import SpeculativeConfig

    for bad in (-0.1, 1.0, "0.5", True):
        with pytest.raises(ValueError, match="spec_min_draft_prob: must be a number in \\[0, 1\\)"):
            SpeculativeConfig(speculative_mode="eagle", additional_models="heads", spec_min_draft_prob=bad)
    with pytest.raises(ValueError, match="additional_models: must be one path"):
        SpeculativeConfig(speculative_mode="eagle", additional_models=["a", "b"])


def test_eagle_head_over_several_sequences_at_once_equals_one_at_a_time(tiny):
    """observe() runs the head once over every request's new pairs: each sequence must come out
    as if it ran alone, against its own cache (different lengths, positions and cache contents)."""
    from sluice.engine.spec_decode.heads import eagle_config

    torch.manual_seed(0)
    head = EagleHead(ModelArchConfig.from_hf_config(eagle_config(tiny.arch)))
    with torch.no_grad():
        for prm in head.parameters():
            prm.copy_(torch.randn(prm.shape) * 0.2)
    head.pack_for_serving()
    seqs = [(3, 0), (1, 7), (5, 2)]          # (new pairs, entries already in the cache)

    def fresh_caches():
        caches = []
        for _n, cached in seqs:
            cache = head.new_cache(4)        # small: the appends below also grow it
            if cached:
                g = torch.Generator().manual_seed(cached)
                kv = torch.randn(cached, head.num_kv_heads, head.head_dim, generator=g)
                cache.append(kv, -kv, list(range(cached)))
            caches.append(cache)
        return caches

    items = []
    for i, (n, cached) in enumerate(seqs):
        g = torch.Generator().manual_seed(100 + i)
        items.append((torch.randn(n, HIDDEN, generator=g), torch.randn(n, HIDDEN, generator=g),
                      list(range(cached, cached + n))))
    alone_caches, many_caches = fresh_caches(), fresh_caches()
    with torch.inference_mode():
        alone = [head(e, h, p, c) for (e, h, p), c in zip(items, alone_caches)]
        many = head.forward_many([(e, h, p, c) for (e, h, p), c in zip(items, many_caches)])
    for a, b, ca, cb in zip(alone, many, alone_caches, many_caches):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert ca.positions == cb.positions
        torch.testing.assert_close(cb.k[:len(cb)], ca.k[:len(ca)])
        torch.testing.assert_close(cb.v[:len(cb)], ca.v[:len(ca)])


@pytest.mark.parametrize("fmt", ["float32", "w8a8"])
@pytest.mark.parametrize("input_norm", [False, True])
def test_eagle_layer_in_cpp_equals_the_python_layer(tiny, fmt, input_norm):
    """Drafting runs the head through the C++ EagleLayer (kernels/cpu_stack.cpp): over the same
    drafting copies it must give the Python layer's hidden states and leave the same keys and
    values in every cache, for several sequences of different lengths, caches that grow, and a
    forked cache, as a draft tree uses them."""
    from sluice.engine.spec_decode.heads import eagle_config, resolve_head_format

    if fmt == "w8a8" and resolve_head_format("auto", "cpu") != "w8a8":
        pytest.fail("this test needs the vectorized C++ block kernels (AVX2 or AVX512-VNNI)")
    heads = []
    for _ in range(2):
        torch.manual_seed(2)
        head = EagleHead(ModelArchConfig.from_hf_config(eagle_config(tiny.arch)), input_norm=input_norm)
        with torch.no_grad():
            for prm in head.parameters():
                prm.copy_(torch.randn(prm.shape, generator=torch.Generator().manual_seed(prm.numel())) * 0.2)
        assert head.pack_for_serving(fmt) == fmt
        heads.append(head)
    cpp, py = heads
    assert cpp._cpp is not None, "the C++ kernels are built in this environment: drafting must use them"
    py._cpp = None
    g = torch.Generator().manual_seed(9)
    steps = [[(5, 0, 0), (2, 0, 1)], [(1, 5, 0), (3, 2, 1)], [(1, 6, 0), (1, 6, 2)], [(2, 7, 2), (1, 5, 1)]]
    inputs = [[(torch.randn(n, HIDDEN, generator=g), torch.randn(n, HIDDEN, generator=g), list(range(p, p + n)), c)
               for n, p, c in step] for step in steps]
    results = {}
    for name, head in zip(("cpp", "py"), heads):
        caches = [head.new_cache(2), head.new_cache(2)]       # small: the steps grow them
        outs = []
        with torch.inference_mode():
            for i, step in enumerate(inputs):
                if i == 2:
                    caches.append(caches[0].fork())           # a sibling branch from here on
                outs.append(head.forward_many([(e, h, pos, caches[c]) for e, h, pos, c in step]))
        results[name] = (outs, caches)
    for step_cpp, step_py in zip(results["cpp"][0], results["py"][0]):
        for a, b in zip(step_cpp, step_py):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for ca, cb in zip(results["cpp"][1], results["py"][1]):
        assert ca.positions == cb.positions
        torch.testing.assert_close(ca.k[:len(ca)], cb.k[:len(cb)], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ca.v[:len(ca)], cb.v[:len(cb)], rtol=1e-4, atol=1e-4)


def test_a_bfloat16_head_drafts_through_the_python_layer(tiny):
    """The C++ EagleLayer reads float32 caches and activations: a head in another dtype (a
    bfloat16 target's) keeps the Python layer, over its w8a8 drafting copies too."""
    from sluice.engine.spec_decode.heads import eagle_config

    head = EagleHead(ModelArchConfig.from_hf_config(eagle_config(tiny.arch))).to(torch.bfloat16)
    assert head.pack_for_serving("w8a8") == "w8a8" and head._cpp is None
    cache = head.new_cache(4)
    with torch.inference_mode():
        out = head.forward_many([(torch.randn(3, HIDDEN, dtype=torch.bfloat16), torch.randn(3, HIDDEN, dtype=torch.bfloat16),
                                  [0, 1, 2], cache)])
    assert out[0].shape == (3, HIDDEN) and out[0].dtype == torch.bfloat16 and cache.positions == [0, 1, 2]


def test_training_second_drafts_are_what_serving_drafts_second(tiny):
    """train-heads' second-draft pass (all positions at once) gives, at each position p, what
    serving computes for a second draft there: the cache filled with pairs 0..p-1, the head's
    output at p-1 fed back as the hidden state of the pair at p."""
    from sluice.engine.spec_decode.heads import eagle_config
    from sluice.engine.training.train import _second_drafts

    torch.manual_seed(1)
    head = EagleHead(ModelArchConfig.from_hf_config(eagle_config(tiny.arch)))
    with torch.no_grad():
        for prm in head.parameters():
            prm.copy_(torch.randn(prm.shape) * 0.2)
    t = 7
    embeds, inputs = torch.randn(t, HIDDEN), torch.randn(t, HIDDEN)
    with torch.inference_mode():
        pred = head(embeds, inputs, list(range(t)))
        second = _second_drafts(head, embeds, inputs, pred)                 # [t - 1, H]: positions 1..t-1
        assert second.shape == (t - 1, HIDDEN)
        for p in range(1, t):
            cache = head.new_cache()
            first = head(embeds[:p], inputs[:p], list(range(p)), cache)[-1]   # the head's h_p
            want = head(embeds[p:p + 1], first[None], [p], cache)[0]
            torch.testing.assert_close(second[p - 1], want, rtol=1e-4, atol=1e-4)


# ---- the drafting format (spec_head_format) -------------------------------------------------------
def test_head_format_auto_is_w8a8_only_where_the_block_kernels_are_vectorized(monkeypatch):
    from sluice.engine.spec_decode.heads import resolve_head_format
    from sluice.kernels import cpu_blockq

    assert resolve_head_format("float32", "cpu") == "float32"
    assert resolve_head_format("auto", "cuda") == "float32"
    with pytest.raises(ValueError, match="spec_head_format: w8a8 is not available: w8a8 drafting runs on CPU only"):
        resolve_head_format("w8a8", "cuda")
    with pytest.raises(ValueError, match="spec_head_format: must be one of auto, float32, w8a8, got 'int4'"):
        resolve_head_format("int4", "cpu")
    for isa, want in (("avx2", "w8a8"), ("avx512vnni", "w8a8"), ("portable", "float32")):
        monkeypatch.setattr(cpu_blockq, "isa", lambda isa=isa: isa)
        assert resolve_head_format("auto", "cpu") == want
    with pytest.raises(ValueError, match="neither AVX2 nor AVX512-VNNI"):
        resolve_head_format("w8a8", "cpu")


def test_a_bad_head_format_is_refused_before_anything_loads():
    from sluice.engine.spec_decode.config import SpeculativeConfig

    with pytest.raises(ValueError, match="spec_head_format: must be one of auto, float32, w8a8, got 'fp8'"):
        SpeculativeConfig(speculative_mode="eagle", additional_models="x", spec_head_format="fp8")


def test_w8a8_drafting_copies_stay_close_to_the_float_weights(tiny):
    """The 8-bit block copies (8-bit weights and int8 inputs per block of 32) move EAGLE's
    predicted hidden states by a few percent (3.4% here, through all eight projections of random
    weights) and the draft LM head's logits by under a percent of their range; the greedy draft
    token rarely. A wrong scale or layout would move them by their whole size."""
    from sluice.engine.spec_decode.heads import DraftLMHead, eagle_config, resolve_head_format

    if resolve_head_format("auto", "cpu") != "w8a8":
        pytest.fail("this test needs the vectorized C++ block kernels (AVX2 or AVX512-VNNI)")
    g = torch.Generator().manual_seed(4)
    outs = {}
    for fmt in ("float32", "w8a8"):
        torch.manual_seed(1)
        head = EagleHead(ModelArchConfig.from_hf_config(eagle_config(tiny.arch)))
        with torch.no_grad():
            for prm in head.parameters():
                prm.copy_(torch.randn(prm.shape, generator=torch.Generator().manual_seed(prm.numel())) * 0.2)
        assert head.pack_for_serving(fmt) == fmt
        embeds, hidden = torch.randn(6, HIDDEN, generator=g.manual_seed(5)), torch.randn(6, HIDDEN, generator=g)
        with torch.inference_mode():
            outs[fmt] = head(embeds, hidden, list(range(6)), head.new_cache(8))
    rel = (outs["w8a8"] - outs["float32"]).norm() / outs["float32"].norm()
    assert 0 < rel < 0.06, rel
    vocab = torch.arange(0, VOCAB, 2)
    h = torch.randn(64, HIDDEN, generator=g.manual_seed(6))
    with torch.inference_mode():
        ref = DraftLMHead(tiny.model, vocab, VOCAB, torch.float32, "cpu", "float32")(h)
        got = DraftLMHead(tiny.model, vocab, VOCAB, torch.float32, "cpu", "w8a8")(h)
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.isinf(got[:, 1::2]).all()
    assert (got[:, vocab] - ref[:, vocab]).abs().max() < 0.05 * ref[:, vocab].abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize(("mode", "width"), [("eagle", 1), ("eagle", 3), ("medusa", 1), ("medusa", 3), ("ngram", 1)])
def test_the_runner_returns_the_hidden_states_its_proposer_reads(tiny, heads_folders, mode, width):
    """The runner contract (spec_decode.runner_hooks): the target's hidden states come back in
    RunnerOutput.hidden_states as the proposer's capture asks: EAGLE every row computed for a
    request from its first new position (a tree: the known rows, then the accepted path's),
    Medusa the row behind each sampled request's last token (position N - 2 once its N tokens
    are known), n-gram nothing. Proposers get them through observe, never from the runner."""
    if mode == "ngram":
        llm = LLM(loaded=tiny, speculative_mode="ngram", **(OPTS | dict(spec_max_batch_size=8)))
    else:
        llm = _spec(tiny, mode, heads_folders, spec_tree_width=width)
    core = llm.engine
    execute, seen = core.runner.execute, []

    def recording(out):
        before = {}    # request id -> (computed, new, drafts, whether they are a tree)
        for s in out.scheduled:
            drafts = s.num_computed_tokens + s.num_new_tokens - s.request.num_tokens
            before[s.request.request_id] = (s.num_computed_tokens, s.num_new_tokens, max(0, drafts),
                                            drafts > 0 and s.request.spec_parents is not None)
        res = execute(out)
        seen.append((before, res))
        return res

    core.runner.execute = recording
    for i, p in enumerate([prompt(10) + " w3 w4 w3 w4", "w1 w2 " * 6]):
        core.add_request(f"h{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    hidden_size = tiny.arch.hidden_size
    verified = 0
    while core.has_unfinished_requests():
        core.step()
        before, res = seen[-1]
        for rid, (computed, new, drafts, is_tree) in before.items():
            got = res.hidden_states.get(rid)
            rejected = res.num_rejected_tokens.get(rid, 0)
            verified += drafts > 0
            if mode == "ngram":
                assert got is None
            elif mode == "eagle":
                assert got[0] == computed and got[1].shape == (new - (rejected if is_tree else 0), hidden_size)
            elif rid in res.sampled_token_ids:
                n = computed + new - rejected + 1   # known tokens after the update
                assert got[0] == n - 2 and got[1].shape == (hidden_size,)
    assert not core.runner.spec.draft_probs
    assert verified > 0   # some step verified drafts


def test_the_cpp_eagle_layer_refuses_bad_projections_and_shapes_by_name():
    """EagleLayer takes the stacks' named structs and holds them to the stacks' checks."""
    from sluice.kernels import cpu_ext

    if not cpu_ext.available():
        pytest.fail(f"this test needs sluice's C++ CPU kernels: {cpu_ext.unavailable_reason()}")
    ops, none = cpu_ext.module(), torch.empty(0)
    w = torch.zeros(8, 8)

    def proj(kind=32, bias=none):
        return ops.StackProjection(parts=[ops.StackPart(packed=w, d=none, m=none, kind=kind, n=8)], bias=bias)

    def layer(spec=None, **bad):
        spec = spec or ops.StackSpec(heads=2, kv_heads=1, head_dim=4, eps=1e-6, scale=0.5, qk_norm=False)
        p = {**dict(fc=proj(), qkv=proj(), o=proj(), gate_up=proj(), down=proj()), **bad}
        return ops.EagleLayer(spec=spec, input_norm=none, post_norm=torch.ones(8), **p)

    layer()                                                        # well formed
    with pytest.raises(RuntimeError, match="EagleLayer: kind must be"):
        layer(o=proj(kind=5))
    with pytest.raises(RuntimeError, match="EagleLayer: a bias must be"):
        layer(down=proj(bias=torch.zeros(3)))
    with pytest.raises(RuntimeError, match="EagleLayer: heads must be a multiple of kv_heads"):
        layer(ops.StackSpec(heads=3, kv_heads=2, head_dim=4, eps=1e-6, scale=0.5, qk_norm=False))
