"""Compile every Triton kernel for CUDA (to a cubin, or to LLVM IR) on a machine without a GPU.

    TRITON_INTERPRET=0 python -m tests.kernels.cuda_lowering [--report]

The interpreter runs kernels as numpy and so misses what only the compiler rejects (type
changes of loop-carried values, unsupported constructs, layouts). ``triton.compile`` with an
explicit target needs no driver: it lowers to TTIR, TTGIR, LLVM, PTX and runs ptxas.

Each kernel is compiled in the configuration its launcher uses and checked against its
architecture's shared memory. The serving configurations (bf16 on sm_90) are also checked for
what would quietly cost bandwidth: register spills (cuobjdump's stack frame) and element-wise
global loads where vector loads or asynchronous copies belong. ``--report`` prints each
kernel's registers, stack, shared memory and load instructions.

The fp32 attention configurations stop at optimised LLVM IR. Their checks are settled there:
the shared memory figure is fixed when TTGIR is lowered to LLVM, and they are not checked for
spills. Their ``ieee`` dot lowers to multiply-adds, and their inline assembly (global loads and
stores, ``cp.async``) uses only instructions that the bf16 compiles of the same architecture
(sm_90, and sm_80 at head_dim 256) take through PTX and ptxas. Yet their unrolled FMA bodies are
where the back end is slowest: ptxas took about 14 of the 16 seconds spent outside the serving
configurations in triton 3.9, and LLVM's PTX emission another ~5 s with an empty Triton cache.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from importlib import import_module
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sluice.kernels._checks import FP_FUSION

# The modules themselves: ``sluice.kernels`` re-exports functions under some of the same names.
bitmask, kv_store, paged_decode, paged_prefill, penalties, rejection, sampling = (
    import_module(f"sluice.kernels.{m}") for m in ("bitmask", "kv_store", "paged_decode", "paged_prefill",
                                                   "penalties", "rejection", "sampling"))

# The most shared memory one block may use (opt-in maximum): A100 163 KB, H100/H200 227 KB. A
# kernel over it compiles, then fails at launch with "out of resources".
MAX_SHARED_BYTES = {80: 163 * 1024, 90: 227 * 1024}
# Loads of one 8- or 16-bit element: a handful are single values (a token's logit or
# probability); a loop over a tile loaded this way is a lost vectorisation.
MAX_NARROW_SCALAR_LOADS = 4
# Stack frame bytes tolerated: ptxas may spill a few words (16 bytes in triton 3.6's fp32 sample
# kernel); a spilled tile is kilobytes.
MAX_STACK_BYTES = 64
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
REPORT = False


def resource_usage(cubin: bytes) -> dict[str, int]:
    """cuobjdump's REG, STACK, SHARED and LOCAL for a one-kernel cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+):(\d+)", line)}


def _stop_at_llvm(backend=None, stages=None, options=None, language=None, capability=None):
    """A ``knobs.runtime.add_stages_inspection_hook`` that ends the pipeline at LLVM IR.

    Triton calls the hook twice: without arguments for a string added to the cache key (so
    these results never stand in for a real cubin), then with the stage table. The ``ptx``
    stage only names the kernel (``CompiledKernel`` reads the name PTX emission would have set)
    and the ``cubin`` stage becomes an empty binary because ``CompiledKernel`` insists on one.
    """
    if stages is None:
        return "llvm-only", "llvm-only"

    def name_only(src: str, metadata: dict) -> str:
        metadata["name"] = re.search(r"define\s[^@]*ptx_kernel[^@]*@([A-Za-z_]\w*)\(", src)[1]
        return ""

    stages["ptx"] = name_only
    stages["cubin"] = lambda src, metadata: b""


def compile_for_cuda(fn, types: dict[str, str], constexprs: dict[str, object], arch: int = 90,
                     num_warps: int = 4, num_stages: int = 2, serving: bool = False, ptxas: bool = True,
                     element_loads_ok: bool = False):
    """Arguments absent from ``types`` and ``constexprs`` are taken as ``i32``.

    Compiles the variant a launch gets. Triton's launcher marks the pointers and integers it
    finds divisible by 16; here pointers, strides, head_dim, block_size and vocab_size are
    marked so (true of torch allocations, head dims 64/80/128/256, block size 16 and
    vocabularies such as 49152 or 128256). Without the marks the compiler can neither vectorise
    nor pipeline the loads. ``serving``: also fail on spills and element-wise loads.
    ``ptxas=False``: stop at LLVM IR (see the module docstring); ignored by ``--report``.
    ``element_loads_ok``: a kernel whose 8/16-bit loads are a gather by design is not failed for them.
    """
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if signature[name].startswith("*") or name.startswith("stride_") or name in (
                "head_dim", "block_size", "vocab_size"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    to_cubin = ptxas or serving or REPORT
    with knobs.runtime.scope():
        knobs.runtime.add_stages_inspection_hook = None if to_cubin else _stop_at_llvm
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": num_warps, "num_stages": num_stages, **FP_FUSION})
    where = f"{fn.__name__} {constexprs} on sm_{arch}"
    shared = kernel.metadata.shared
    if shared > MAX_SHARED_BYTES[arch]:
        raise SystemExit(f"{where} needs {shared} bytes of shared memory; the limit is {MAX_SHARED_BYTES[arch]}")
    if serving or REPORT:
        usage = resource_usage(kernel.asm["cubin"])
        loads = collections.Counter(re.findall(r"\b(ld\.global(?:\.v\d)?\.[a-z]\d+|cp\.async)", kernel.asm["ptx"]))
        narrow = sum(n for op, n in loads.items() if re.fullmatch(r"ld\.global\.[a-z](8|16)", op))
        if REPORT:
            print(f"{fn.__name__:28} sm_{arch} REG {usage['REG']:3} STACK {usage['STACK']:5} "
                  f"SHARED {shared:6} {dict(loads)}")
        if serving and usage["STACK"] > MAX_STACK_BYTES:
            raise SystemExit(f"{where} spills: {usage['STACK']} bytes of stack ({usage['REG']} registers)")
        if serving and narrow > MAX_NARROW_SCALAR_LOADS and not element_loads_ok:
            raise SystemExit(f"{where} loads {narrow} single 8/16-bit elements: vectorisation lost ({dict(loads)})")
    return kernel.asm


ATTN = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale_log2": "fp32",
        "node_start_ptr": "*i32", "visible_ptr": "*i8"}


def _attn_types(dt: str) -> dict[str, str]:
    return {**ATTN, **{n: dt for n in ("query_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr")}}


def attention_kernels(arch, dt, decode_splits=(1, 4), head_dim=128, reduce=True, serving=False, ptxas=True):
    """The decode, prefill and KV-store kernels as their launchers configure them."""
    prec = "ieee" if dt == "*fp32" else "tf32"
    torch_dtype = {"*fp32": torch.float32, "*fp16": torch.float16, "*bf16": torch.bfloat16}[dt]
    types = _attn_types(dt)
    for splits in decode_splits:
        compile_for_cuda(paged_decode._paged_decode_kernel, types, dict(
            GROUP=8, GROUP_PAD=16, HEAD_DIM_PAD=head_dim, BLOCK_N=paged_decode._BLOCK_N, NUM_SPLITS=splits,
            DOT_PRECISION=prec), arch, num_warps=paged_decode._NUM_WARPS, num_stages=3, serving=serving, ptxas=ptxas)
    if reduce:
        compile_for_cuda(paged_decode._paged_decode_reduce_kernel, types,
                         dict(NUM_SPLITS=4, SPLITS_PAD=4, HEAD_DIM_PAD=head_dim), arch, serving=serving,
                         ptxas=ptxas)
    for tree in (False, True):
        # With draft trees the mask is a gather of one byte per (row, key) in the tiles that reach
        # a tree: those loads are element-wise by nature, so the tree variant is held to every
        # check but that one.
        compile_for_cuda(paged_prefill._paged_prefill_kernel, types, dict(
            GROUP=3, HEAD_DIM_PAD=head_dim, BLOCK_M=paged_prefill._TREE_BLOCK_M if tree else paged_prefill._BLOCK_M,
            BLOCK_N=paged_prefill.block_n_for(torch_dtype, head_dim), DOT_PRECISION=prec, TREE=tree,
            NODES_PAD=16), arch,
            num_warps=paged_prefill._NUM_WARPS, num_stages=paged_prefill._NUM_STAGES, serving=serving,
            ptxas=ptxas, element_loads_ok=tree)
    kv = {n: dt for n in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}
    compile_for_cuda(kv_store._kv_store_kernel, {**kv, "slot_mapping_ptr": "*i64"},
                     dict(HEADS_PAD=8, HEAD_DIM_PAD=head_dim), arch, serving=serving, ptxas=ptxas)


def sampling_kernels(dt, rejection_only=False, serving=False):
    rj = {"draft_ids_ptr": "*i64", "draft_probs_ptr": dt, "target_probs_ptr": dt, "seeds_ptr": "*i64",
          "offsets_ptr": "*i64", "out_ptr": "*i64", "num_emitted_ptr": "*i32"}
    rj_opts = dict(num_warps=rejection._NUM_WARPS, serving=serving)
    # A launch with one draft token specialises num_draft to the constant 1.
    compile_for_cuda(rejection._rejection_sample_kernel, rj, dict(BLOCK_V=rejection._BLOCK_V, num_draft=1), **rj_opts)
    if rejection_only:
        return
    compile_for_cuda(sampling._sample_kernel, {
        "logits_ptr": dt, "temperature_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32",
        "min_p_ptr": "*fp32", "seeds_ptr": "*i64", "offsets_ptr": "*i64", "out_ptr": "*i64"},
        dict(BLOCK_V=sampling._BLOCK_V), num_warps=sampling._NUM_WARPS, serving=serving)
    compile_for_cuda(penalties._apply_penalties_kernel, {
        "logits_ptr": dt, "output_counts_ptr": "*i32", "prompt_mask_ptr": "*u8", "presence_ptr": "*fp32",
        "frequency_ptr": "*fp32", "repetition_ptr": "*fp32", "bias_ids_ptr": "*i32", "bias_values_ptr": "*fp32"},
        dict(BLOCK_V=penalties._BLOCK_V, BIAS_PAD=4), num_warps=penalties._NUM_WARPS, serving=serving)
    compile_for_cuda(rejection._rejection_sample_kernel, rj, dict(BLOCK_V=rejection._BLOCK_V), **rj_opts)
    compile_for_cuda(bitmask._apply_bitmask_kernel, {"logits_ptr": dt, "bitmask_ptr": "*i32"},
                     dict(BLOCK_V=bitmask._BLOCK_V), num_warps=bitmask._NUM_WARPS, serving=serving)


def main(argv: list[str]) -> None:
    global REPORT
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("cuda_lowering: run with TRITON_INTERPRET unset; the interpreter replaces the compiler")
    REPORT = "--report" in argv
    # The serving configuration, checked for spills and lost vectorisation: every kernel in bf16
    # on sm_90 (the sampling kernels with fp32 logits too).
    attention_kernels(90, "*bf16", serving=True)
    sampling_kernels("*bf16", serving=True)
    sampling_kernels("*fp32", serving=True)
    # Compile and fit only: fp32 attention (ieee dot) and sm_80 fp16, whose dot lowerings differ,
    # and head_dim 256 (Gemma-style) in A100's smaller shared memory. fp32 stops at LLVM IR (see the
    # module docstring). (Each compile costs seconds: keep the matrix small.)
    attention_kernels(90, "*fp32", decode_splits=(1,), ptxas=False)
    attention_kernels(80, "*fp16", decode_splits=(4,))
    attention_kernels(80, "*fp32", decode_splits=(1,), head_dim=256, reduce=False, ptxas=False)
    attention_kernels(80, "*bf16", decode_splits=(1,), head_dim=256, reduce=False)
    print("all kernels lowered to cubin (sm_90 bf16, sm_80 fp16; bf16 head_dim 256 on sm_80) and fp32 "
          "attention to LLVM IR (sm_90; head_dim 256 on sm_80), each within its shared memory; the sm_90 bf16 "
          "serving kernels without spills or element-wise loads")


if __name__ == "__main__":
    main(sys.argv[1:])
