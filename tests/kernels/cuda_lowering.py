"""Compile every Triton kernel all the way to a CUDA cubin on a machine without a GPU.

    TRITON_INTERPRET=0 python -m tests.kernels.cuda_lowering

The interpreter runs kernels as numpy and so misses what only the compiler rejects (type
changes of loop-carried values, unsupported constructs, layouts). ``triton.compile`` with an
explicit target needs no driver: it lowers to TTIR, TTGIR, LLVM, PTX and runs ptxas.
"""
from __future__ import annotations

import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from importlib import import_module

# The modules themselves: ``kernels`` re-exports functions under some of the same names.
kv_store, paged_decode, paged_prefill, penalties, rejection, sampling = (
    import_module(f"kernels.{m}") for m in ("kv_store", "paged_decode", "paged_prefill", "penalties", "rejection", "sampling"))


def compile_for_cuda(fn, types: dict[str, str], constexprs: dict[str, object], arch: int = 90,
                     num_warps: int = 4, num_stages: int = 2):
    """Arguments absent from ``types`` and ``constexprs`` are taken as ``i32``; returns the kernel's asm dict."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = types.get(name, "i32")
    src = ASTSource(fn, signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return kernel.asm


ATTN = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale_log2": "fp32"}


def _attn_types(dt: str) -> dict[str, str]:
    return {**ATTN, **{n: dt for n in ("query_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr")}}


def attention_kernels(arch, dt, decode_splits=(1, 4)):
    prec = "ieee" if dt == "*fp32" else "tf32"
    types = _attn_types(dt)
    for splits in decode_splits:
        compile_for_cuda(paged_decode._paged_decode_kernel, types, dict(
            GROUP=8, GROUP_PAD=16, HEAD_DIM_PAD=128, BLOCK_N=64, NUM_SPLITS=splits, DOT_PRECISION=prec), arch)
    compile_for_cuda(paged_decode._paged_decode_reduce_kernel, types,
                     dict(NUM_SPLITS=4, SPLITS_PAD=4, HEAD_DIM_PAD=128), arch)
    compile_for_cuda(paged_prefill._paged_prefill_kernel, types,
                     dict(GROUP=3, HEAD_DIM_PAD=128, BLOCK_M=64, BLOCK_N=64, DOT_PRECISION=prec), arch)
    kv = {n: dt for n in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}
    compile_for_cuda(kv_store._kv_store_kernel, {**kv, "slot_mapping_ptr": "*i64"},
                     dict(HEADS_PAD=8, HEAD_DIM_PAD=128), arch)


def sampling_kernels(dt, rejection_only=False):
    rj = {"draft_ids_ptr": "*i64", "draft_probs_ptr": dt, "target_probs_ptr": dt, "seeds_ptr": "*i64",
          "offsets_ptr": "*i64", "out_ptr": "*i64", "num_emitted_ptr": "*i32"}
    # A launch with one draft token specialises num_draft to the constant 1.
    compile_for_cuda(rejection._rejection_sample_kernel, rj, dict(BLOCK_V=2048, num_draft=1))
    if rejection_only:
        return
    compile_for_cuda(sampling._sample_kernel, {
        "logits_ptr": dt, "temperature_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32",
        "min_p_ptr": "*fp32", "seeds_ptr": "*i64", "offsets_ptr": "*i64", "out_ptr": "*i64"},
        dict(BLOCK_V=4096), num_warps=8)
    compile_for_cuda(penalties._apply_penalties_kernel, {
        "logits_ptr": dt, "output_counts_ptr": "*i32", "prompt_mask_ptr": "*u8", "presence_ptr": "*fp32",
        "frequency_ptr": "*fp32", "repetition_ptr": "*fp32", "bias_ids_ptr": "*i32", "bias_values_ptr": "*fp32"},
        dict(BLOCK_V=2048, BIAS_PAD=4))
    compile_for_cuda(rejection._rejection_sample_kernel, rj, dict(BLOCK_V=2048))


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("cuda_lowering: run with TRITON_INTERPRET unset; the interpreter replaces the compiler")
    # Every kernel in bf16 on sm_90; the fp32 (ieee dot) and sm_80 fp16 variants of the attention
    # kernels, whose dot lowering differs. (Each compile costs seconds: keep the matrix small.)
    attention_kernels(90, "*bf16")
    sampling_kernels("*bf16")
    sampling_kernels("*fp32", rejection_only=True)
    attention_kernels(90, "*fp32", decode_splits=(1,))
    attention_kernels(80, "*fp16", decode_splits=(4,))
    print("all kernels lowered to cubin (sm_90 bf16/fp32, sm_80 fp16)")


if __name__ == "__main__":
    main()
