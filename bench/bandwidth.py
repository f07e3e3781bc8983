"""Memory bandwidth and the decode ceiling it implies, measured in the calling process.

Single-stream decode reads every weight once per token, so on a memory-bound machine

    ceiling tokens/s = measured read bandwidth / weight bytes read per token.

The bandwidth is the best of several ``sum`` passes over a tensor much larger than the last-level
cache (a pure streaming read with the same torch threads the engine uses); a ``copy_`` pass is
reported beside it (read + write traffic).

    python bench/bandwidth.py            # prints the machine and both bandwidths
"""
from __future__ import annotations

import platform
import subprocess
import time

import torch

_GB = 1e9


def _best_seconds(fn, repeats: int) -> float:
    fn()   # touch the pages first, so page faults are not timed
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(size_mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """Read (``sum``) and copy (``copy_``) bandwidth in GB/s over a ``size_mib`` float32 tensor."""
    if size_mib < 1 or repeats < 1:
        raise ValueError(f"size_mib and repeats must be positive, got {size_mib}, {repeats}")
    n = size_mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)          # [n]
    dst = torch.empty_like(src)                        # [n]
    nbytes = src.numel() * src.element_size()
    with torch.inference_mode():
        t_read = _best_seconds(lambda: src.sum(), repeats)
        t_copy = _best_seconds(lambda: dst.copy_(src), repeats)
    return {"read_gb_s": nbytes / t_read / _GB, "copy_gb_s": 2 * nbytes / t_copy / _GB,
            "tensor_mib": size_mib, "threads": torch.get_num_threads()}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step streams: every projection and the LM head in full, plus the norms.
    Counted from shapes, so oneDNN-packed weights (opaque tensors) count like dense ones; the
    embedding table only counts as the LM head (a lookup reads one row per token)."""
    elem = model.embed_tokens.weight.element_size()
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.in_features * module.out_features * elem
            if module.bias is not None:
                total += module.bias.numel() * elem
    if getattr(model, "lm_head", None) is None:       # tied: the embedding matrix is the LM head
        total += model.embed_tokens.weight.numel() * elem
    total += sum(p.numel() * elem for n, p in model.named_parameters() if "norm" in n)
    return total


def decode_ceiling(weights: int, bandwidth_gb_s: float) -> float:
    """Upper bound on single-stream decode tokens/s when each token streams ``weights`` bytes."""
    if weights <= 0 or bandwidth_gb_s <= 0:
        raise ValueError(f"weights and bandwidth must be positive, got {weights}, {bandwidth_gb_s}")
    return bandwidth_gb_s * _GB / weights


def machine() -> dict[str, object]:
    """The CPU model and core count as ``lscpu`` reports them (falls back to ``platform``)."""
    info: dict[str, object] = {"processor": platform.processor() or platform.machine()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "CPU(s)", "Core(s) per socket", "Socket(s)", "L3"):
            info[key.strip()] = value.strip()
    info["torch_threads"] = torch.get_num_threads()
    return info


def main() -> int:
    print(machine())
    bw = measure_bandwidth()
    print(f"read {bw['read_gb_s']:.1f} GB/s   copy {bw['copy_gb_s']:.1f} GB/s   "
          f"({bw['tensor_mib']} MiB float32, {bw['threads']} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
