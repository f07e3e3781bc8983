"""KV store: write one step's K and V rows into the paged cache at their flat slots.

Cache layout (see ``engine/attention/base.py``): ``[num_blocks, block_size, num_kv_heads,
head_dim]``; slot ``s`` is block ``s // block_size``, offset ``s % block_size``. A negative
slot marks a padding token and is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_last_dim_contiguous, check_same_dtype
from sluice.kernels._checks import FP_FUSION, check_shape, check_tensor, next_pow2

# Tuning: one program per token moves num_kv_heads * head_dim elements; 4 warps cover up to
# 8 KiB per program, beyond that 8 warps keep enough loads in flight.
_NUM_WARPS_SMALL, _NUM_WARPS_LARGE, _LARGE_TILE_ELEMS = 4, 8, 4096


@triton.jit
def _kv_store_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    block_size, num_kv_heads, head_dim,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)[:, None]          # [HEADS_PAD, 1]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]        # [1, HEAD_DIM_PAD]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(key_ptr + tok * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + tok * stride_value_tok + heads * stride_value_head + dims, mask=mask)
    kc = key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_head + dims
    vc = value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_head + dims
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def _check(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES)
    dev = key_cache.device
    check_tensor("value_cache", value_cache, 4, FLOAT_DTYPES, dev)
    check_shape("value_cache", value_cache, key_cache.shape)
    _, _, num_kv_heads, head_dim = key_cache.shape
    check_tensor("key", key, 3, FLOAT_DTYPES, dev)
    check_tensor("value", value, 3, FLOAT_DTYPES, dev)
    check_shape("key", key, (key.shape[0], num_kv_heads, head_dim))
    check_shape("value", value, key.shape)
    for name, t in (("key", key), ("value", value), ("value_cache", value_cache)):
        check_same_dtype(name, t, "key_cache", key_cache)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, dev)
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, t)


def kv_store(
    key: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,   # [num_tokens] int32/int64; < 0 skips the token
) -> None:
    """Write ``key``/``value`` into the caches in place. Slots must be < num_blocks * block_size."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    heads_pad, dim_pad = next_pow2(num_kv_heads), next_pow2(head_dim)
    warps = _NUM_WARPS_LARGE if heads_pad * dim_pad > _LARGE_TILE_ELEMS else _NUM_WARPS_SMALL
    _kv_store_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_size, num_kv_heads, head_dim,
        HEADS_PAD=heads_pad, HEAD_DIM_PAD=dim_pad, num_warps=warps, **FP_FUSION,
    )


def kv_store_ref(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Plain-torch ``kv_store``: same arguments, same in-place effect."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]
