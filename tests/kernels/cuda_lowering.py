"""Compile every Triton kernel all the way to a CUDA cubin on a machine without a GPU.

    TRITON_INTERPRET=0 python -m tests.kernels.cuda_lowering

The interpreter runs kernels as numpy and so misses what only the compiler rejects (type
changes of loop-carried values, unsupported constructs, layouts). ``triton.compile`` with an
explicit target needs no driver: it lowers to TTIR, TTGIR, LLVM, PTX and runs ptxas.
"""
from __future__ import annotations

import os
from importlib import import_module

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels._checks import FP_FUSION

# The modules themselves: ``kernels`` re-exports functions under some of the same names.
kv_store, paged_decode, paged_prefill, penalties, rejection, sampling = (
    import_module(f"kernels.{m}") for m in ("kv_store", "paged_decode", "paged_prefill", "penalties", "rejection", "sampling"))


# The most shared memory one block may use (opt-in maximum): A100 163 KB, H100/H200 227 KB. A
# kernel over it compiles, then fails at launch with "out of resources".
MAX_SHARED_BYTES = {80: 163 * 1024, 90: 227 * 1024}


def compile_for_cuda(fn, types: dict[str, str], constexprs: dict[str, object], arch: int = 90,
                     num_warps: int = 4, num_stages: int = 2):
    """Arguments absent from ``types`` and ``constexprs`` are taken as ``i32``. Checks that the
    kernel's shared memory fits the architecture; returns the kernel's asm dict."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = types.get(name, "i32")
    src = ASTSource(fn, signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, **FP_FUSION})
    shared = kernel.metadata.shared
    if shared > MAX_SHARED_BYTES[arch]:
        raise SystemExit(f"{fn.__name__} {constexprs} needs {shared} bytes of shared memory on sm_{arch}; "
                         f"the limit is {MAX_SHARED_BYTES[arch]}")
    return kernel.asm


ATTN = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale_log2": "fp32"}


def _attn_types(dt: str) -> dict[str, str]:
    return {**ATTN, **{n: dt for n in ("query_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr")}}


def attention_kernels(arch, dt, decode_splits=(1, 4), head_dim=128, reduce=True):
    """The decode and prefill kernels as their launchers configure them (decode's default 3 stages)."""
    prec = "ieee" if dt == "*fp32" else "tf32"
    torch_dtype = {"*fp32": torch.float32, "*fp16": torch.float16, "*bf16": torch.bfloat16}[dt]
    types = _attn_types(dt)
    for splits in decode_splits:
        compile_for_cuda(paged_decode._paged_decode_kernel, types, dict(
            GROUP=8, GROUP_PAD=16, HEAD_DIM_PAD=head_dim, BLOCK_N=paged_decode._BLOCK_N, NUM_SPLITS=splits,
            DOT_PRECISION=prec), arch, num_stages=3)
    if reduce:
        compile_for_cuda(paged_decode._paged_decode_reduce_kernel, types,
                         dict(NUM_SPLITS=4, SPLITS_PAD=4, HEAD_DIM_PAD=head_dim), arch)
    compile_for_cuda(paged_prefill._paged_prefill_kernel, types, dict(
        GROUP=3, HEAD_DIM_PAD=head_dim, BLOCK_M=paged_prefill._BLOCK_M,
        BLOCK_N=paged_prefill.block_n_for(torch_dtype, head_dim), DOT_PRECISION=prec), arch,
        num_stages=paged_prefill._NUM_STAGES)
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
    # head_dim 256 (Gemma-style) on the smaller A100 shared memory, in fp32 and bf16.
    for dt in ("*fp32", "*bf16"):
        attention_kernels(80, dt, decode_splits=(1,), head_dim=256, reduce=False)
    print("all kernels lowered to cubin (sm_90 bf16/fp32, sm_80 fp16; head_dim 256 on sm_80), "
          "each within its shared-memory limit")


if __name__ == "__main__":
    main()
