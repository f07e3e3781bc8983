"""A tensor-parallel worker (rank 1..N-1): ``python -m sluice.engine.parallel.worker MODEL``.

Started by the engine (rank 0) on its host, or by a launcher on any host with the standard
rendezvous variables (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``). It loads its
shard, then runs what rank 0 broadcasts: ``kv`` (allocate its KV cache: the same blocks, its own
heads), ``forward`` (a step's inputs), ``move`` (a draft tree's accepted K/V), ``stop``. When rank 0
is gone its next receive fails and the worker exits non-zero.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

from sluice.engine.attention.selector import get_attention_backend
from sluice.engine.model_runner import zeroed_pool
from sluice.engine.parallel.tensor import _IDLE_TIMEOUT, die_with_parent, install, load_shard

log = logging.getLogger("sluice.parallel.worker")


def _move(caches, src: torch.Tensor, dst: torch.Tensor) -> None:
    for cache in caches:
        for c in cache:
            flat = c.view(-1, *c.shape[2:])
            flat[dst] = flat[src]


def serve(model: torch.nn.Module, device: torch.device) -> None:
    attn = get_attention_backend("torch", device)
    arch = model.arch
    caches = []
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op, payload = box[0]
        if op == "stop":
            return
        if op == "kv":
            num_blocks, block_size, dtype, (max_rows, logit_rows) = payload
            shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
            caches = [(zeroed_pool(shape, dtype, device), zeroed_pool(shape, dtype, device))
                      for _ in range(arch.num_hidden_layers)]
            model.warm_up(max_rows, 0)
        elif op == "forward":
            input_ids, positions, meta = payload
            with torch.inference_mode():
                model(input_ids, positions, caches, meta, attn)
        elif op == "move":
            _move(caches, *payload)
        else:
            raise RuntimeError(f"tensor-parallel worker: unknown command {op!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.engine.parallel.worker")
    p.add_argument("model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quantization", default="auto")
    args = p.parse_args(argv)
    die_with_parent()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if k not in os.environ]
    if missing:
        print(f"sluice tensor-parallel worker: error: set {', '.join(missing)} (the rendezvous)", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=_IDLE_TIMEOUT)
    device = torch.device(args.device if args.device != "auto" else "cpu")
    loaded = load_shard(args.model, rank, world, args.dtype, device, args.quantization)
    install(loaded.model)
    arch = loaded.arch
    features = (f"{arch.moe_intermediate_size} features of each of {arch.num_experts} experts" if arch.num_experts
                else f"{arch.intermediate_size} MLP features")
    log.info("rank %d of %d: %d query / %d key-value heads, %s", rank, world, arch.num_attention_heads,
             arch.num_key_value_heads, features)
    try:
        serve(loaded.model, device)
    except RuntimeError as exc:      # rank 0 went away (gloo: connection closed)
        print(f"sluice tensor-parallel worker {rank}: {exc}", file=sys.stderr)
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
