"""Backend selection (auto by device, forced backends that cannot run say why) and the Triton
backend giving the torch backend's outputs and cache contents on a mixed varlen step and on a
pure-decode step."""
from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.selector import get_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend


def test_auto_picks_torch_on_cpu_and_triton_runs_under_the_interpreter():
    assert isinstance(get_attention_backend("auto", torch.device("cpu")), TorchAttentionBackend)
    assert isinstance(get_attention_backend("triton", torch.device("cpu")), TritonAttentionBackend)


def test_forced_backends_that_cannot_run_say_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend=triton needs a CUDA device or TRITON_INTERPRET=1"):
        get_attention_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend=flash_attn needs a CUDA device"):
        get_attention_backend("flash_attn", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend: must be one of"):
        get_attention_backend("xformers", torch.device("cpu"))


def test_a_triton_older_than_the_verified_floor_is_refused_and_auto_falls_back(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.2.0" if name == "triton" else real(name))
    with pytest.raises(ValueError, match=r"attention_backend=triton needs triton>=3\.4, found triton 3\.2\.0"):
        get_attention_backend("triton", torch.device("cpu"))
    # On CUDA, "auto" would pick triton; with a Triton too old it serves with torch instead.
    assert isinstance(get_attention_backend("auto", torch.device("cuda")), TorchAttentionBackend)


def _meta(seq_lens, query_lens, block_size, tables, device):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = []
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        slots += [int(tables[i][t // block_size]) * block_size + t % block_size for t in range(s - q, s)]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), query_start_loc=i32(starts),
        seq_lens=i32(seq_lens), context_lens=i32([s - q for s, q in zip(seq_lens, query_lens)]),
        block_tables=i32(tables), block_size=block_size, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens))


@pytest.mark.parametrize("seq_lens,query_lens", [([12, 20, 5], [12, 3, 1]), ([12, 20, 5], [1, 1, 1])])
def test_triton_backend_equals_torch_backend(device, seq_lens, query_lens):
    g = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, dim = 4, 2, 6, 80
    tables = [[0, 1, 2, 9, 9], [3, 4, 5, 6, 7], [8, 9, 9, 9, 9]]
    cache = torch.randn(10, block_size, kv_heads, dim, generator=g).to(device)
    n = sum(query_lens)
    q = torch.randn(n, heads, dim, generator=g).to(device)
    k = torch.randn(n, kv_heads, dim, generator=g).to(device)
    v = torch.randn(n, kv_heads, dim, generator=g).to(device)
    meta = _meta(seq_lens, query_lens, block_size, tables, device)
    kv_torch, kv_triton = (cache.clone(), -cache.clone()), (cache.clone(), -cache.clone())
    want = TorchAttentionBackend().forward(q, k, v, kv_torch, meta, dim ** -0.5)
    got = TritonAttentionBackend().forward(q, k, v, kv_triton, meta, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(kv_triton[0], kv_torch[0], rtol=0, atol=0)
    torch.testing.assert_close(kv_triton[1], kv_torch[1], rtol=0, atol=0)


def test_the_triton_floor_matches_pyproject():
    import tomllib
    from pathlib import Path

    from engine.devices import MIN_TRITON

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    floor = "triton>=" + ".".join(map(str, MIN_TRITON))
    extras = project["optional-dependencies"]
    assert [d for d in extras["triton"] + extras["gpu"] + extras["dev"] if d.startswith("triton")] == [floor] * 3
