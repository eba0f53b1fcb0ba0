"""The tensor-parallel process group: one process per rank over torch.distributed (NCCL on GPUs, rank r on
cuda:r; gloo on the CPU), started by quanta itself (LLM(..., tensor_parallel_size=N) spawns ranks 1..N-1) or
by torchrun (WORLD_SIZE / RANK / LOCAL_RANK in the environment), and the collectives the engine runs over it
(TensorParallel: reduce_norm, gather_vocab, agree, min_int).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from quanta.engine.config import EngineConfig
from quanta.quant.errors import ConfigError

TIMEOUT = datetime.timedelta(minutes=10)
LEAVE_TIMEOUT_S = 60
HOST = "127.0.0.1"
log = logging.getLogger(__name__)


@dataclass(eq=False)
class TensorParallel:
    """This process's rank in a group of `world`, with the group's collectives."""
    rank: int
    world: int
    device: torch.device
    torchrun: bool = False
    cpu_group: object = None                      # gloo: the step headers and start-up agreement
    procs: list = field(default_factory=list)     # ranks 1.. that this process spawned (rank 0 only)
    errors: str | None = None                     # folder where workers leave their start-up errors
    closed: bool = False
    agreed: bool = False
    one_shot: object = None                       # a OneShotAllReduceNorm once start_one_shot found it works

    def start_one_shot(self, dtype: torch.dtype, hidden: int) -> bool:
        """Every rank together, once the model is loaded: small all-reduces of [rows, hidden] `dtype` blocks go
        through the one-shot kernel from now on where it runs here (each rank gets the same answer). Whether
        it does."""
        from quanta.engine.parallel import one_shot as one_shot_all_reduce
        self.one_shot = one_shot_all_reduce.start(dist.group.WORLD, self.device, dtype, hidden)
        return self.one_shot is not None

    @property
    def is_worker(self) -> bool:
        return self.rank != 0

    # --- collectives in the model --------------------------------------------------------------
    def reduce_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this rank's partial sum of a row-parallel layer's output -> (norm(total + residual), total +
        residual), `norm` an engine.layers.RMSNorm; without residual the total is the new residual stream.
        One kernel where the one-shot path takes x, else x summed in place by NCCL (gloo on the CPU) and the
        norm. Both are capturable in a CUDA graph."""
        if self.one_shot is not None and norm.triton and self.one_shot.usable(x):
            return self.one_shot(x, residual, norm.weight, norm.eps, norm.order)
        dist.all_reduce(x)
        return norm.add_norm(x, residual)

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[R, piece] logits of this rank's vocabulary rows -> [R, vocab_size], every rank's piece in order
        (each piece padded to cdiv(vocab, world) columns, the padding cut off again)."""
        per = -(-vocab_size // self.world)
        if local.shape[-1] < per:
            local = torch.nn.functional.pad(local, (0, per - local.shape[-1]))
        pieces = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(pieces, local.contiguous())
        return torch.cat(pieces, dim=-1)[..., :vocab_size]

    # --- start-up --------------------------------------------------------------------------------
    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def agree(self, error: BaseException | None) -> None:
        """Every rank reports whether it started; if any failed, every rank raises. Rank 0 raises the
        failing worker's own error (a QuantaError keeps its type), a worker a short RuntimeError."""
        self.agreed = True
        t = torch.tensor([0 if error is None else 1 + self.rank], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        failed = int(t) - 1
        if failed < 0:
            return
        if error is not None:
            raise error
        path = os.path.join(self.errors or "", f"rank{failed}")
        if self.rank == 0 and os.path.exists(path):
            with open(path, "rb") as f:
                raise pickle.load(f)
        raise RuntimeError(f"tensor-parallel rank {failed} failed to start")

    def fail(self, error: BaseException) -> None:
        """This rank could not start: tell the others (a worker hands rank 0 its error), leave, raise."""
        if self.is_worker and self.errors is not None:
            with contextlib.suppress(Exception), open(os.path.join(self.errors, f"rank{self.rank}"), "wb") as f:
                pickle.dump(error, f)
        try:
            self.agree(error)
        finally:
            self.close()

    # --- shut-down -------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the process group, then (rank 0) wait for the ranks it spawned to exit. Idempotent.
        NCCL tears a communicator down collectively: every live rank must destroy the group together, so
        rank 0 leaves before it waits for its workers (which leave as their loop ends), never after, and
        skips the teardown where a worker has died (it could not take part)."""
        if self.closed:
            return
        self.closed = True
        dead = [p for p in self.procs if p.poll() not in (None, 0)]
        if dist.is_initialized() and not dead:
            leave = threading.Thread(target=dist.destroy_process_group, name="quanta-tp-leave", daemon=True)
            leave.start()
            leave.join(LEAVE_TIMEOUT_S)
            if leave.is_alive():              # a peer that never leaves must not hang this process's close
                log.warning("tensor-parallel rank %d: the process group did not tear down in %d s; left as is",
                            self.rank, LEAVE_TIMEOUT_S)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.rank == 0 and self.errors is not None:
            shutil.rmtree(self.errors, ignore_errors=True)


def check_world(cfg: EngineConfig) -> int:
    """The tensor-parallel size: the config's, or torchrun's WORLD_SIZE (they must agree)."""
    env = int(os.environ.get("WORLD_SIZE", "1"))
    world = cfg.tensor_parallel_size
    if env > 1 and world not in (1, env):
        raise ConfigError(f"tensor_parallel_size={world} but torchrun started {env} processes")
    world = max(world, env)
    if torch.device(cfg.device).type == "cuda" and world > torch.cuda.device_count():
        raise ConfigError(f"tensor_parallel_size={world} needs {world} GPUs, {torch.cuda.device_count()} "
                          "are visible")
    return world


def rank_config(cfg: EngineConfig, rank: int, world: int) -> EngineConfig:
    """The config rank `rank` runs: its own GPU (cuda:rank, torchrun's LOCAL_RANK). Async scheduling
    stays as configured: a step launched ahead takes its input ids from the previous step's tokens on
    the device, and the inputs' broadcast is ordered after them on the device, so the workers need no
    host round trip either."""
    device = cfg.device
    if torch.device(device).type == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    return replace(cfg, device=device, tensor_parallel_size=world)


def start(cfg: EngineConfig, build: Callable[..., Any]) -> TensorParallel | None:
    """Join (torchrun) or create (spawning ranks 1..N-1) the process group for `cfg`; None at size 1.
    Called by rank 0's EngineCore (every rank's, under torchrun) after the configuration is checked;
    `build(config, tp=...)` is what a spawned rank runs to make its core (EngineCore itself).

    Spawned ranks meet at a TCP store that rank 0 opens; each marks itself ready there just before it joins
    the group, and rank 0 joins only once every worker is ready, watching their processes meanwhile: a
    worker that dies before it joins (a failed import, a GPU that cannot be opened, a kill) is reported at
    once with its exit status instead of leaving rank 0 waiting out the group's timeout."""
    world = check_world(cfg)
    if world == 1:
        return None
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        rank = int(os.environ["RANK"])
        return join(cfg, rank, world, "env://", torchrun=True)
    store = dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    errors = tempfile.mkdtemp(prefix="quanta-tp-")
    # Plain interpreters, not multiprocessing's spawn: that would re-run the user's main module in each.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = []
    try:
        for r in range(1, world):
            p = subprocess.Popen([sys.executable, "-c",
                                  "from quanta.engine.parallel.rank import worker_entry; worker_entry()"],
                                 stdin=subprocess.PIPE, env=env)
            procs.append(p)
            with contextlib.suppress(BrokenPipeError):       # one that died at once: wait_until_ready says so
                p.stdin.write(pickle.dumps((cfg, r, world, store.port, errors, build)))
                p.stdin.close()
        wait_until_ready(store, procs)
    except BaseException:
        for p in procs:
            p.kill()
        shutil.rmtree(errors, ignore_errors=True)
        raise
    tp = join(cfg, 0, world, store=store)
    tp.procs, tp.errors = procs, errors
    return tp


def _ready_key(rank: int) -> str:
    return f"quanta/ready/{rank}"


def wait_until_ready(store: dist.Store, procs: list[subprocess.Popen]) -> None:
    """Return once every spawned rank (procs[r - 1] is rank r) has marked itself ready in `store`; raise
    RuntimeError, naming the rank and its exit status, as soon as one has exited instead, or TimeoutError after
    TIMEOUT."""
    keys = [_ready_key(r) for r in range(1, len(procs) + 1)]
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while not store.check(keys):
        for r, p in enumerate(procs, 1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {r} exited with status {p.returncode} before joining "
                                   "the process group (its output above says why)")
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys, 1) if not store.check([key])]
            raise TimeoutError(f"tensor-parallel ranks {missing} did not join within {TIMEOUT}")
        time.sleep(0.05)


def join(cfg: EngineConfig, rank: int, world: int, init: str | None = None, store: dist.Store | None = None,
          torchrun: bool = False) -> TensorParallel:
    """This process's place in the group: at `init` (torchrun's env://) or through `store` (spawned ranks and
    rank 0, which opened it); a spawned rank marks itself ready there once its device is set, just before it
    joins."""
    device = torch.device(rank_config(cfg, rank, world).device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if store is not None and rank > 0:
        store.set(_ready_key(rank), "1")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, store=store, rank=rank,
                            world_size=world, timeout=TIMEOUT, **({"device_id": device} if cuda else {}))
    cpu_group = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    return TensorParallel(rank, world, device, torchrun, cpu_group)


def kv_head_range(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of the KV heads rank `rank` holds: an equal share, or one replicated head when
    there are fewer heads than ranks (ranks r * world / heads ... share head r)."""
    if num_kv_heads >= world:
        per = num_kv_heads // world
        return rank * per, (rank + 1) * per
    head = rank // (world // num_kv_heads)
    return head, head + 1


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of the vocabulary rows rank `rank` holds: pieces of cdiv(vocab, world) rows."""
    per = -(-vocab_size // world)
    return min(vocab_size, rank * per), min(vocab_size, (rank + 1) * per)
