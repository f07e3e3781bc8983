"""Backend selection (auto by device, forced backends that cannot run say why) and the Triton
backend giving the torch backend's outputs and cache contents on a mixed varlen step and on a
pure-decode step."""
from __future__ import annotations

import pytest
import torch

from sluice.engine.attention.base import AttentionMetadata
from sluice.engine.attention.selector import get_attention_backend
from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.attention.triton_backend import TritonAttentionBackend


def test_auto_picks_torch_on_cpu_and_triton_runs_under_the_interpreter(monkeypatch):
    assert isinstance(get_attention_backend("auto", torch.device("cpu")), TorchAttentionBackend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # already so on CPU machines; not on CUDA ones
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


def test_a_triton_without_its_own_distribution_name_is_read_from_the_module(monkeypatch):
    import importlib.metadata

    import triton

    def no_triton_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_triton_dist)   # as with "pytorch-triton"
    monkeypatch.setattr(triton, "__version__", "3.1.0")
    with pytest.raises(ValueError, match=r"needs triton>=3\.4, found triton 3\.1\.0"):
        get_attention_backend("triton", torch.device("cpu"))


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

    from sluice.engine.devices import MIN_TRITON

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    floor = "triton>=" + ".".join(map(str, MIN_TRITON))
    extras = project["optional-dependencies"]
    assert [d for d in extras["triton"] + extras["gpu"] + extras["test"] if d.startswith("triton")] == [floor] * 3


def _fake_flash_attn(monkeypatch, calls: list | None):
    """Install a stand-in ``flash_attn`` module: with ``calls`` a list, its varlen function is a
    torch implementation of flash-attn's causal varlen attention that records each call; with
    None, the module lacks the function, as a broken install would."""
    import importlib.machinery
    import sys
    import types

    import torch.nn.functional as F

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        calls.append(cu_seqlens_q.tolist())
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and causal
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        bounds = cu_seqlens_q.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[s:e].transpose(0, 1).float() for t in (q, k, v))
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=softmax_scale).transpose(0, 1)
        return out

    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    if calls is not None:
        module.flash_attn_varlen_func = varlen
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def test_auto_on_cuda_prefers_an_installed_flash_attn_and_falls_back_when_it_is_broken(monkeypatch, caplog):
    from sluice.engine.attention.flash_attn_backend import FlashAttnBackend

    cuda = torch.device("cuda")   # selection only: nothing runs on it
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", None)   # not installed
    assert type(get_attention_backend("auto", cuda)) is TritonAttentionBackend
    _fake_flash_attn(monkeypatch, [])
    assert type(get_attention_backend("auto", cuda)) is FlashAttnBackend
    _fake_flash_attn(monkeypatch, None)
    assert type(get_attention_backend("auto", cuda)) is TritonAttentionBackend
    assert "flash-attn is installed but cannot be used" in caplog.text
    with pytest.raises(ValueError, match="attention_backend=flash_attn needs the flash-attn package"):
        get_attention_backend("flash_attn", cuda)


@pytest.mark.parametrize("seq_lens,query_lens,uses_flash", [
    ([12, 20, 5], [12, 20, 5], True),     # fresh prefills only: flash-attn's varlen kernel
    ([12, 20, 5], [12, 3, 1], False),     # a cached prefix is read: the Triton extend kernel
    ([12, 20, 5], [1, 1, 1], False),      # pure decode: the Triton decode kernel
])
def test_flash_attn_backend_routes_each_step_and_equals_torch(monkeypatch, device, seq_lens, query_lens, uses_flash):
    from sluice.engine.attention.flash_attn_backend import FlashAttnBackend

    calls: list = []
    _fake_flash_attn(monkeypatch, calls)
    backend = FlashAttnBackend(torch.device("cuda"))   # built for CUDA, run here on fp16 CPU tensors
    g = torch.Generator().manual_seed(1)
    block_size, kv_heads, heads, dim, dt = 4, 2, 6, 64, torch.float16
    tables = [[0, 1, 2, 9, 9], [3, 4, 5, 6, 7], [8, 9, 9, 9, 9]]
    cache = torch.randn(10, block_size, kv_heads, dim, generator=g).to(device, dt)
    n = sum(query_lens)
    q, k, v = (torch.randn(n, h, dim, generator=g).to(device, dt) for h in (heads, kv_heads, kv_heads))
    meta = _meta(seq_lens, query_lens, block_size, tables, device)
    kv_torch, kv_flash = (cache.clone(), -cache.clone()), (cache.clone(), -cache.clone())
    want = TorchAttentionBackend().forward(q, k, v, kv_torch, meta, dim ** -0.5)
    got = backend.forward(q, k, v, kv_flash, meta, dim ** -0.5)
    assert calls == ([[0, 12, 32, 37]] if uses_flash else [])
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kv_flash[0], kv_torch[0], rtol=0, atol=0)   # the cache is written either way
