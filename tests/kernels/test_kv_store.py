"""kv_store writes each token's K/V at its slot (skipping slot < 0) exactly as its torch reference does."""
from __future__ import annotations

import pytest
import torch

from sluice.kernels.kv_store import kv_store, kv_store_ref


def _inputs(block_size, num_kv_heads, head_dim, num_tokens, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 5
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1] = -1                                                  # a padding token
    return [t.to(device) for t in (key, value, cache, cache.clone() + 1, slots)]


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 80)])
def test_kv_store_matches_reference(device, block_size, num_kv_heads, head_dim):
    key, value, kc, vc, slots = _inputs(block_size, num_kv_heads, head_dim, min(5, 5 * block_size), torch.float32, device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_store(key, value, kc, vc, slots)
    kv_store_ref(key, value, kc_ref, vc_ref, slots)
    torch.testing.assert_close(kc, kc_ref, rtol=0, atol=0)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)
    # The written slots hold the new rows; the padding token wrote nothing.
    s = int(slots[0])
    torch.testing.assert_close(kc[s // block_size, s % block_size], key[0], rtol=0, atol=0)
    untouched = torch.ones(kc.shape[0] * block_size, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    orig_v = _inputs(block_size, num_kv_heads, head_dim, min(5, 5 * block_size), torch.float32, device)[3]
    torch.testing.assert_close(vc.flatten(0, 1)[untouched], orig_v.flatten(0, 1)[untouched], rtol=0, atol=0)


def test_kv_store_int32_slots_and_strided_key(device):
    key, value, kc, vc, slots = _inputs(16, 2, 64, 4, torch.float32, device)
    wide = torch.randn(4, 4, 64, device=device)
    key = wide[:, :2]                                              # a view with a head stride of 64
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_store(key, value, kc, vc, slots.to(torch.int32))
    kv_store_ref(key, value, kc_ref, vc_ref, slots)
    torch.testing.assert_close(kc, kc_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_store_half_precision(device, dtype):
    key, value, kc, vc, slots = _inputs(16, 2, 80, 7, dtype, device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_store(key, value, kc, vc, slots)
    kv_store_ref(key, value, kc_ref, vc_ref, slots)
    torch.testing.assert_close(kc, kc_ref, rtol=0, atol=0)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)


@pytest.mark.parametrize("change,message", [
    (lambda a: {**a, "key": a["key"].half()}, "key: dtype float16 differs from key_cache"),
    (lambda a: {**a, "value": a["value"][:, :1]}, "value: expected shape"),
    (lambda a: {**a, "slot_mapping": a["slot_mapping"].float()}, "slot_mapping: dtype must be one of"),
    (lambda a: {**a, "slot_mapping": a["slot_mapping"][:2]}, "slot_mapping: expected shape"),
    (lambda a: {**a, "key_cache": a["key_cache"][0]}, "key_cache: must have 4 dims"),
    (lambda a: {**a, "key": a["key"].transpose(1, 2).contiguous().transpose(1, 2)}, "key: last dimension must be contiguous"),
])
def test_kv_store_rejects_bad_arguments(change, message):
    key, value, kc, vc, slots = _inputs(16, 2, 64, 4, torch.float32, "cpu")
    args = change({"key": key, "value": value, "key_cache": kc, "value_cache": vc, "slot_mapping": slots})
    with pytest.raises(ValueError, match=message):
        kv_store(**args)
