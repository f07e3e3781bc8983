"""Qwen3 (issue 43): a Llama layer whose queries and keys pass a per-head RMSNorm before RoPE.

A tiny random-weight model written by transformers itself (``Qwen3ForCausalLM`` from a config,
random weights, saved as safetensors), and the same weights written as a GGUF with the ``gguf``
package in llama.cpp's layout (``attn_q_norm`` / ``attn_k_norm``, Q/K unpermuted: NEOX RoPE).

* float32 logits equal transformers' within test_logits' tolerance, from the folder and from
  the GGUF, through the C++ layer stack and through the Python layers;
* greedy continuations equal transformers', each request batched with the others;
* in w8a8 (8-bit blocks, the C++ stack with its q/k norms) the logits stay within the bounds
  test_quantization holds SmolLM2's w8a8 to.

head_dim is 32 with a hidden size of 64 and 4 heads: Qwen3 sets head_dim apart from
hidden / heads, so a loader that derived it would fail here.
"""
from __future__ import annotations

import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders import build_model
from sluice.engine.loaders.gguf_loader import load_gguf
from sluice.engine.loaders.hf_loader import load_hf_folder
from sluice.engine.sampling_params import SamplingParams
from tests.model import gguf_writing
from tests.model.test_logits import _assert_logits_match, _prefill_logits
from tests.model.test_quantization import MAX_LOGIT_CHANGE, MEAN_LOGIT_CHANGE

HEADS, KV_HEADS, HEAD_DIM, LAYERS, THETA = 4, 2, 32, 2, 10000.0
PROMPTS = [[3, 17, 400, 9, 5000, 77], [12, 13], [900, 4, 4, 4, 31, 2000, 8, 1, 65, 101, 7]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm2_tokenizer):
    """(folder, transformers model): SmolLM2's tokenizer beside random Qwen3 weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny_qwen3")
    smollm2_tokenizer.save_folder(folder)
    config = Qwen3Config(vocab_size=smollm2_tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=THETA,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        # O(1..10) logits, so that a mistake shows far above the tolerance; norm weights away
        # from 1 (the q/k norms' included), so that a skipped or misplaced norm shows too.
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.5) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}." + {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight"}[rest]


def _write_gguf(path, hf) -> None:
    """The model's weights and shape in llama.cpp's qwen3 layout (float32 tensors)."""
    config = hf.config
    writer = gguf_writing.start(path, "qwen3", config, rope_base=THETA, head_dim=config.head_dim)
    gguf_writing.finish(writer, {_gguf_name(name): t.numpy() for name, t in hf.state_dict().items()})


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_the_config_and_the_gguf_describe_the_same_qwen3(qwen3, tmp_path):
    folder, hf = qwen3
    arch, _ = load_hf_folder(folder)
    _write_gguf(tmp_path / "q.gguf", hf)
    from_gguf, _, _ = load_gguf(tmp_path / "q.gguf")
    assert arch.architecture == from_gguf.architecture == "qwen3"
    assert arch.head_dim == from_gguf.head_dim == HEAD_DIM and not arch.attention_bias
    model = build_model(arch, load_hf_folder(folder)[1], torch.float32, torch.device("cpu"))
    assert model.spec.attention.qk_norm
    torch.testing.assert_close(model.layers[1].self_attn.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight,
                               rtol=0, atol=0)


@pytest.mark.parametrize("layers", ["cpp", "python"])
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_float32_logits_match_transformers(qwen3, tmp_path, monkeypatch, layers, source):
    folder, hf = qwen3
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    if source == "gguf":
        _write_gguf(tmp_path / "q.gguf", hf)
        arch, weights, _ = load_gguf(tmp_path / "q.gguf")
    else:
        arch, weights = load_hf_folder(folder)
    model = build_model(arch, weights, torch.float32, torch.device("cpu"))
    assert (model._cpu_decoder() is not None) == (layers == "cpp")
    for ids in PROMPTS:
        _assert_logits_match(_prefill_logits(model, ids), _reference(hf, ids))


@pytest.mark.parametrize("layers", ["cpp", "python"])
def test_greedy_batched_matches_transformers(qwen3, monkeypatch, layers):
    folder, hf = qwen3
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    llm = LLM(str(folder), quantization="none", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16)
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]    # one batch, chunked prefill
    finally:
        llm.close()
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
                  for p in PROMPTS]
    assert ours == theirs


def test_w8a8_stays_within_the_block_formats_bounds(qwen3):
    folder, hf = qwen3
    arch, weights = load_hf_folder(folder)
    model = build_model(arch, weights, torch.float32, torch.device("cpu"), quantization="w8a8")
    assert model._cpu_decoder() is not None          # the C++ stack, q/k norms included
    changes = [(_prefill_logits(model, ids) - _reference(hf, ids)).abs() for ids in PROMPTS]
    assert max(c.max() for c in changes) <= MAX_LOGIT_CHANGE["w8a8"]
    assert torch.cat([c.flatten() for c in changes]).mean() <= MEAN_LOGIT_CHANGE["w8a8"]
    # A q/k norm weight of the wrong size is refused by name when the stack is built, not read past.
    from sluice.engine.models.layer_stack import build_decoder_stack
    from sluice.kernels import cpu_ext

    model.layers[1].self_attn.k_norm.weight = torch.nn.Parameter(torch.ones(HEAD_DIM // 2), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"layer 1: q_norm and k_norm must have head_dim \(32\) weights"):
        build_decoder_stack(model, cpu_ext.module())
