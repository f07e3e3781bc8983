"""Tensor parallelism over ``torch.distributed``: one model split across N ranks (processes).

Split, on the Llama decoder's own modules:
  * attention: each rank holds a contiguous range of key/value heads and the query heads of
    their groups (``q_proj``/``k_proj``/``v_proj`` rows and their biases), and its own KV cache
    for those heads only; when the heads do not divide evenly the first ranks take one more
    (SmolLM2's 3 KV heads on 2 ranks: 2 and 1);
  * MLP: each rank holds an equal slice of the intermediate features (``gate``/``up`` rows);
  * mixture of experts: each rank holds the same slice of every expert's features (gate/up
    rows, and down's input columns or output rows as a dense MLP's), the shared expert's
    likewise; the router and the shared expert's gate are whole, so every rank routes every
    token alike. Row-parallel: the MoE MLP's partial output is all-reduced (it is linear in the
    experts' down products). Exact: the C++ stack gathers the chosen experts' activations in
    one call, stacked by expert, and each down runs over its expert's whole activation;
  * OLMoE's q/k RMSNorm over the whole projection: its weights are cut with the heads, its
    statistics taken over the ranks' gathered whole row (both splits);
  * Gemma 2 / 3: as Llama's (GeGLU's gate/up as SwiGLU's); their extra norms are whole on every
    rank and read the whole (gathered or all-reduced) outputs, attention soft-capping and the
    query scale act per head, the logits' soft-cap on rank 0's whole logits. The exact split
    gathers gate and up and runs GeGLU on the whole of them (ATen's gelu rounds a narrower row
    differently in its last bit);
  * a checkpoint that stores them fused (Phi-3's ``qkv_proj`` [q | k | v] and ``gate_up_proj``
    [gate | up]; llama.cpp's ``attn_qkv`` / ``ffn_up``): the rank's rows of each part, side by
    side in the same order (whole rows, so a block format's cut falls between blocks);
  * ``o_proj`` and ``down_proj``, in one of two ways:
    - exact (on CPU, where the C++ layer stack runs): each rank holds a range of their output
      rows, whole along the input. The stack gathers the ranks' attention outputs (and MLP
      activations) side by side, runs its rows over the whole input, and gathers the outputs:
      four all-gathers per layer and step (five with GeGLU, whose gate and up travel apart; a
      mixture of experts: attention's two, the chosen experts' activations, the shared expert's
      and the output; OLMoE adds q's and k's), and every number is the one a single rank computes
      (each output sums over its whole input in the same order; concatenation reorders
      nothing), so greedy outputs equal the unsplit model's in every format;
    - row-parallel (Megatron's; elsewhere): each rank holds their input columns of its heads and
      features; the partial outputs are all-reduced (summed) before the residual add: two
      all-reduces per layer and step, in the Python layers. Sums in another order: near the
      unsplit model's, not equal to it;
  * the embedding, the norms (but OLMoE's whole-projection q/k norms, above) and the LM head
    are whole on every rank (only rank 0 computes logits).
Weights are sliced as they are read (``ShardedWeights`` over the loader's lazy mapping: one full
tensor at a time is ever resident), block formats (Q4_0, Q4_1, Q8_0, ...) included, cut between
whole blocks (a cut inside a block is refused with the tensor's name).

Processes: rank 0 is the engine (scheduler, KV manager, sampler, speculative decoding, grammars:
all unchanged); it starts ranks 1..N-1 (``python -m sluice.engine.parallel.worker``) unless the
standard rendezvous variables (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``) say a
launcher started them, on this host or others. Every forward call on rank 0 first broadcasts the
step's inputs (token ids, positions, attention metadata) to the workers, which run the same
forward on their shard and cache; a draft tree's accepted K/V moves are broadcast the same way.
So everything above the model (paged KV, continuous batching, prefix caching, speculation) is the
single-rank engine's. Backend: gloo on CPU. A worker that dies ends the engine at once with a
message naming it (``watch_workers``), never a hang.

A sharded CPU step is slower than an unsharded one on the same cores (the gathers cross
processes, and each rank has half the cores): tensor parallelism is for models that do not fit
one device, or for spreading one model over several hosts.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sluice.engine.errors import ModelLoadError
from sluice.engine.models.config import ARCHITECTURES, ModelArchConfig

log = logging.getLogger("sluice.parallel")

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
# The command channel waits between steps for as long as the engine is idle: no collective
# timeout (a dead peer is found by the process watch, or by gloo's closed connection).
_IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    kv_start: int
    kv_heads: int
    q_start: int
    q_heads: int
    inter_start: int
    inter: int
    out_start: int = 0        # the exact split: the o_proj / down_proj output rows held
    out_rows: int = 0         # (0: row-parallel)
    expert_start: int = 0     # mixture of experts: each routed expert's features held
    expert_inter: int = 0
    shared_start: int = 0     # and the shared expert's (Qwen2-MoE)
    shared_inter: int = 0


def _even(features: int, world: int, what: str) -> int:
    if features % world:
        raise ValueError(f"tensor_parallel_shards: {what}'s {features} features do not split evenly over "
                         f"{world} ranks")
    return features // world


def plan_shard(arch: ModelArchConfig, rank: int, world: int, exact: bool = False) -> Shard:
    """Which heads and intermediate features (of the MLP, or of every expert and the shared
    expert) ``rank`` of ``world`` holds, and with ``exact`` which output rows of o_proj and
    down_proj; ValueError naming ``tensor_parallel_shards`` when the model cannot be split that way."""
    kv = arch.num_key_value_heads
    if world > kv:
        raise ValueError(f"tensor_parallel_shards: {world} ranks need at least {world} key/value heads; "
                         f"the model has {kv}")
    inter = _even(arch.intermediate_size, world, "the MLP") if not arch.num_experts else 0
    expert = _even(arch.moe_intermediate_size, world, "each expert") if arch.num_experts else 0
    shared = _even(arch.shared_expert_intermediate_size, world, "the shared expert")
    group = arch.num_attention_heads // kv
    base, extra = divmod(kv, world)
    kv_heads = base + (rank < extra)
    kv_start = rank * base + min(rank, extra)
    out_start = out_rows = 0
    if exact:
        base, extra = divmod(arch.hidden_size, world)
        out_rows = base + (rank < extra)
        out_start = rank * base + min(rank, extra)
    return Shard(rank, world, kv_start, kv_heads, kv_start * group, kv_heads * group, rank * inter, inter,
                 out_start, out_rows, rank * expert, expert, rank * shared, shared)


def shard_arch(arch: ModelArchConfig, shard: Shard) -> ModelArchConfig:
    """The rank's model: its heads and features; under the exact split, o_proj and down_proj
    (every expert's and the shared expert's too) read the whole model's inputs."""
    out = None
    if shard.out_rows:
        mlp_in = arch.moe_intermediate_size if arch.num_experts else arch.intermediate_size
        out = (shard.out_rows, arch.q_size, mlp_in, arch.shared_expert_intermediate_size)
    return dataclasses.replace(arch, num_attention_heads=shard.q_heads, num_key_value_heads=shard.kv_heads,
                               intermediate_size=shard.inter if not arch.num_experts else arch.intermediate_size,
                               moe_intermediate_size=shard.expert_inter,
                               shared_expert_intermediate_size=shard.shared_inter, output_shard=out)


class ShardedWeights(Mapping):
    """One rank's view of a loader's HF-named weights: projections sliced, the rest whole."""

    def __init__(self, weights: Mapping, arch: ModelArchConfig, shard: Shard) -> None:
        self._w, self._arch, self._s = weights, arch, shard
        if hasattr(weights, "blocks"):
            self.blocks = self._blocks
        if hasattr(weights, "tensor_type"):
            self.tensor_type = weights.tensor_type

    def _cut(self, name: str) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, [(start, stop), ...]) of this rank's slice of ``name`` (several ranges of a fused
        tensor, concatenated in order), None for a whole tensor."""
        s, a = self._s, self._arch
        d = a.head_dim
        kind = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        q = [(s.q_start * d, (s.q_start + s.q_heads) * d)]
        kv = [(s.kv_start * d, (s.kv_start + s.kv_heads) * d)]
        if s.out_rows and kind in ("o_proj", "down_proj", "w2"):     # the exact split: output rows (bias too)
            return 0, [(s.out_start, s.out_start + s.out_rows)]
        if ".self_attn." in name:
            if kind == "q_proj":
                return 0, q
            if kind in ("k_proj", "v_proj"):
                return 0, kv
            if kind == "qkv_proj":            # Phi-3's fused [q | k | v] rows: this rank's heads of each
                return 0, q + [(a.q_size + i, a.q_size + j) for i, j in kv] + \
                    [(a.q_size + a.kv_size + i, a.q_size + a.kv_size + j) for i, j in kv]
            if kind in ("q_norm", "k_norm") and ARCHITECTURES[a.architecture].qk_norm_full:
                return 0, q if kind == "q_norm" else kv    # OLMoE's norm over the whole projection
            if kind == "o_proj" and name.endswith(".weight"):
                return 1, q
        inter = self._inter(name)
        if inter is not None:
            start, n, full = inter
            if kind in ("gate_proj", "up_proj", "w1", "w3"):
                return 0, [(start, start + n)]
            if kind == "gate_up_proj":        # Phi-3's fused [gate | up] rows
                return 0, [(start, start + n), (full + start, full + start + n)]
            if kind in ("down_proj", "w2"):
                return 1, [(start, start + n)]
        return None

    def _inter(self, name: str) -> tuple[int, int, int] | None:
        """(start, features, whole features) of this rank's slice of the MLP ``name`` belongs to:
        a dense MLP's, a routed expert's or the shared expert's; None outside the MLP."""
        s, a = self._s, self._arch
        if ".experts." in name:
            return s.expert_start, s.expert_inter, a.moe_intermediate_size
        if ".shared_expert." in name:
            return s.shared_start, s.shared_inter, a.shared_expert_intermediate_size
        if ".mlp." in name:
            return s.inter_start, s.inter, a.intermediate_size
        return None

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._w[name]
        cut = self._cut(name)
        if cut is None:
            return t
        dim, ranges = cut
        return torch.cat([t.narrow(dim, i, j - i) for i, j in ranges], dim).contiguous()

    def shape(self, name: str) -> tuple[int, ...]:
        full = list(self._w.shape(name))
        cut = self._cut(name)
        if cut is not None:
            full[cut[0]] = sum(j - i for i, j in cut[1])
        return tuple(full)

    def _blocks(self, name: str):
        got = self._w.blocks(name)
        cut = self._cut(name)
        if got is None or cut is None:
            return got
        kind, raw = got                                   # raw [rows, bytes per row] uint8
        dim, ranges = cut
        if dim == 0:                                      # whole rows: any cut falls between blocks
            return kind, torch.cat([raw[i:j] for i, j in ranges]).contiguous()
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        (start, stop), = ranges
        if start % per_block or stop % per_block:
            raise ModelLoadError(f"tensor_parallel_shards: tensor {name!r} ({kind}, blocks of {per_block}) "
                                 f"cannot be split at column {start if start % per_block else stop}")
        return kind, raw[:, start // per_block * nbytes:stop // per_block * nbytes].contiguous()

    def __contains__(self, name: object) -> bool:
        return name in self._w

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)


class _Gather:
    """The C++ stack's gather under the exact split: the ranks' [rows, width] pieces side by side.
    ``widths[what][rank]``: each rank's width of what is gathered (``DecoderStack.set_gather``'s
    kinds: 0 attention output / queries, 1 MLP activation, 2 hidden rows, 3 keys, 4 routed
    experts' activations, 5 the shared expert's); uneven pieces travel padded. The Python
    layers' whole-projection norms (``_WholeNorm``) gather with it too."""

    def __init__(self, widths: list[list[int]]) -> None:
        self.widths = widths

    def offsets(self, rank: int) -> list[int]:
        """Where ``rank``'s piece starts in each kind's gathered row."""
        return [sum(w[:rank]) for w in self.widths]

    def __call__(self, x: torch.Tensor, what: int) -> torch.Tensor:
        widths = self.widths[what]
        pad = max(widths)
        if x.shape[1] < pad:
            x = torch.nn.functional.pad(x, (0, pad - x.shape[1]))
        pieces = [torch.empty(x.shape[0], pad, dtype=x.dtype) for _ in widths]
        dist.all_gather(pieces, x.contiguous())
        if all(w == pad for w in widths):
            return torch.cat(pieces, 1)
        return torch.cat([p[:, :w] for p, w in zip(pieces, widths)], 1)


class _AllReduce(torch.nn.Module):
    """A row-parallel projection (or a mixture-of-experts MLP, whose output is linear in its
    experts' row-parallel down projections): this rank's partial output, summed over the ranks."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        dist.all_reduce(y)
        return y


class _WholeNorm(torch.nn.Module):
    """OLMoE's RMSNorm over a whole q or k projection of which this rank holds some heads (and
    their weights): the statistics over the ranks' gathered row, then this rank's columns."""

    def __init__(self, norm: torch.nn.Module, gather: _Gather, what: int, rank: int) -> None:
        super().__init__()
        self.norm, self.gather, self.what, self.start = norm, gather, what, gather.offsets(rank)[what]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, this rank's q or kv columns]
        whole = self.gather(x.float(), self.what)                                   # [T, whole]
        unit = torch.ones(whole.shape[1], dtype=torch.float32)
        normed = torch.nn.functional.rms_norm(whole, unit.shape, unit, self.norm.eps)
        return (normed.narrow(1, self.start, x.shape[1]) * self.norm.weight).to(x.dtype)


def _gather_for(model: torch.nn.Module) -> _Gather:
    """Every rank's widths of what the split gathers (every rank calls this at the same point)."""
    spec = model.spec
    moe = spec.moe
    mine = torch.tensor([spec.attention.q_size, spec.intermediate_size, spec.shard.rows if spec.shard else 0,
                         spec.attention.kv_size, moe.intermediate_size if moe else 0,
                         moe.shared_intermediate_size if moe else 0], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return _Gather([[int(w[i]) for w in every] for i in range(len(mine))])


def install(model: torch.nn.Module) -> None:
    """Join a shard's model to the other ranks. The exact split: the C++ stack gathers (every
    rank calls this at the same point: the widths are exchanged here). Row-parallel: the Python
    layers sum their row-parallel outputs (o_proj, down_proj, a mixture-of-experts MLP's output)
    across ranks, and OLMoE's whole-projection q/k norms gather their statistics' rows."""
    shard = model.spec.shard
    gather = _gather_for(model)
    if shard is None:
        rank = dist.get_rank()
        for layer in model.layers:
            attn = layer.self_attn
            attn.o_proj = _AllReduce(attn.o_proj)
            if layer.spec.mlp == "moe":
                layer.mlp = _AllReduce(layer.mlp)
            else:
                layer.mlp.down_proj = _AllReduce(layer.mlp.down_proj)
            if attn.qk_norm_full and attn.q_norm is not None:
                attn.q_norm = _WholeNorm(attn.q_norm, gather, 0, rank)
                attn.k_norm = _WholeNorm(attn.k_norm, gather, 3, rank)
        model.use_python_layers()
        return
    stack = model.layer_stack()
    if not stack.runs_in_cpp:
        raise ModelLoadError("tensor_parallel_shards: this rank's layers did not get the C++ layer stack that the "
                             "exact split runs in (a weight format it does not take?); use a block format or "
                             "float32 with the C++ kernels built")
    stack.stack.set_gather(gather, gather.offsets(dist.get_rank()))


def exact_split(device, quantization: str) -> bool:
    """Whether the shards split exactly (``install``): on CPU, where the C++ layer stack runs the
    format (the block formats, or float32 packed for oneDNN unless SLUICE_CPU_CPP_LAYERS=0)."""
    from sluice.engine import envs
    from sluice.kernels import cpu_ext

    if torch.device(device).type != "cpu" or quantization in ("int8", "int4", "bf16"):
        return False
    return cpu_ext.available() and (quantization != "none" or (envs.cpu_cpp_layers() and envs.cpu_packed_weights()))


def sharder(rank: int, world: int, exact: bool = False):
    """The loader's ``transform`` for ``rank``: (arch, weights) -> that rank's (arch, weights)."""
    def transform(arch: ModelArchConfig, weights: Mapping):
        shard = plan_shard(arch, rank, world, exact)
        return shard_arch(arch, shard), ShardedWeights(weights, arch, shard)
    return transform


def start_tensor_parallel(config, dtype: torch.dtype, device: torch.device, quantization: str, progress=None):
    """Rank 0 of ``config.device.tensor_parallel_shards``: the group started and joined, and this
    rank's shard loaded and wrapped (``TensorParallel.wrap``). Returns ``(TensorParallel, LoadedModel)``."""
    world = config.device.tensor_parallel_shards
    if not (config.device.num_threads or os.environ.get("OMP_NUM_THREADS")):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))   # the ranks share this host's cores
    tp = TensorParallel.launch(world, config.model, str(dtype).removeprefix("torch."), str(device), quantization)
    try:
        loaded = load_shard(config.model, 0, world, dtype, device, quantization)
        tp.wrap(loaded.model)
    except BaseException:
        tp.close()
        raise
    return tp, loaded


def load_shard(model: str, rank: int, world: int, dtype, device, quantization: str, progress=None):
    """This rank's ``LoadedModel``: the loader reads only its slices (``ShardedWeights``)."""
    from sluice.engine.loaders import load_model

    return load_model(model, dtype=dtype, device=device, quantization=quantization, progress=progress,
                      transform=sharder(rank, world, exact_split(device, quantization)))


# ---- rank 0: the engine's side -------------------------------------------------------------------
class TensorParallel:
    """Rank 0's handle: the process group, the workers it started, the step broadcasts."""

    def __init__(self, world: int, workers: list[subprocess.Popen]) -> None:
        self.world = world
        self.workers = workers
        self._closed = False

    @classmethod
    def launch(cls, world: int, model: str, dtype: str, device: str, quantization: str) -> TensorParallel:
        """Start ranks 1..world-1 here (unless a launcher set RANK / WORLD_SIZE) and join the group."""
        if device.startswith("cuda"):
            raise ValueError("tensor_parallel_shards: not available on CUDA yet (the CPU path over gloo is the "
                             "tested one)")
        env = {k: os.environ[k] for k in RENDEZVOUS if k in os.environ}
        workers: list[subprocess.Popen] = []
        if "RANK" in env:
            if int(env["RANK"]) != 0 or int(env.get("WORLD_SIZE", "0")) != world:
                raise ValueError(f"tensor_parallel_shards: {world} does not match WORLD_SIZE={env.get('WORLD_SIZE')} "
                                 f"/ RANK={env['RANK']} of the launcher (rank 0 is the engine)")
            addr = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        else:
            addr = f"127.0.0.1:{_free_port()}"
            host, port = addr.split(":")
            threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))
            for rank in range(1, world):
                cmd = (sys.executable, "-m", "sluice.engine.parallel.worker", model, "--dtype", dtype,
                       "--device", device, "--quantization", quantization)
                rendezvous = {"MASTER_ADDR": host, "MASTER_PORT": port, "WORLD_SIZE": str(world),
                              "RANK": str(rank), "OMP_NUM_THREADS": threads, _PARENT: str(os.getpid())}
                # No preexec_fn: this process has gRPC's and gloo's threads, and Python code run
                # between fork and exec in a threaded parent can die on a lock a thread held (a
                # worker aborted at start under load); the worker ties itself to us instead.
                workers.append(subprocess.Popen(cmd, env={**os.environ, **rendezvous}))
        _join(addr, world, workers)
        tp = cls(world, workers)
        tp.watch_workers()
        return tp

    def wrap(self, model: torch.nn.Module) -> None:
        """Rank 0's shard: every forward is broadcast to the workers first."""
        install(model)
        local = model.forward

        def forward(input_ids, positions, kv_caches, meta, attn):
            self.send("forward", (input_ids, positions, meta))
            return local(input_ids, positions, kv_caches, meta, attn)

        model.forward = forward
        model.tp = self

    def init_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype, warm: tuple[int, int]) -> None:
        self.send("kv", (num_blocks, block_size, dtype, warm))

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.send("move", (src, dst))

    def send(self, op: str, payload) -> None:
        dist.broadcast_object_list([(op, payload)], src=0)

    def watch_workers(self) -> None:
        """Threads that end this process, naming the worker and its exit code, when one dies."""
        for rank, proc in enumerate(self.workers, start=1):
            threading.Thread(target=_wait_for, args=(rank, proc, self), daemon=True,
                             name=f"sluice-tp-watch-{rank}").start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.send("stop", None)
        except Exception:  # noqa: BLE001 - a worker already gone: nothing to tell
            pass
        for proc in self.workers:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(addr: str, world: int, workers: list[subprocess.Popen]) -> None:
    """Rank 0 joins the group; a worker that exits first (a model it cannot load) is an error
    naming it, not a wait for ever."""
    failure: list[BaseException] = []

    def init() -> None:
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=0, world_size=world,
                                    timeout=_IDLE_TIMEOUT)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failure.append(exc)

    joiner = threading.Thread(target=init, daemon=True, name="sluice-tp-join")
    joiner.start()
    while joiner.is_alive():
        joiner.join(0.1)
        for rank, proc in enumerate(workers, start=1):
            if proc.poll() is not None:
                for other in workers:
                    other.kill()
                raise RuntimeError(f"tensor_parallel_shards: rank {rank} exited with code {proc.returncode} "
                                   "while starting (its output says why)")
    if failure:
        raise failure[0]


def _wait_for(rank: int, proc: subprocess.Popen, tp: TensorParallel) -> None:
    rc = proc.wait()
    if tp._closed:
        return
    msg = (f"sluice engine: tensor-parallel rank {rank} (pid {proc.pid}) exited with code {rc}; "
           "the engine cannot go on without it and stops")
    log.error(msg)
    print(msg, file=sys.stderr, flush=True)
    os._exit(3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PARENT = "SLUICE_TP_PARENT"     # the pid of the rank 0 that started a worker


def die_with_parent() -> None:
    """In a worker rank 0 started: SIGTERM when rank 0 dies (Linux), and exit now if it already
    did (its pid, in the environment, is no longer our parent)."""
    parent = os.environ.get(_PARENT)
    if parent is None:           # started by a launcher: its own supervision applies
        return
    _prctl_pdeathsig()
    if os.getppid() != int(parent):
        sys.exit("sluice tensor-parallel worker: the engine that started it has exited")


def _prctl_pdeathsig() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
