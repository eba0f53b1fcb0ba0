"""A spawned tensor-parallel rank's process: it joins rank 0's group, builds its core over its shard and
serves rank 0's steps until rank 0 closes (group.start spawns it; torchrun's ranks serve from the core's
constructor instead). What it builds comes pickled with its arguments, so this module imports no engine."""
from __future__ import annotations

import contextlib
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from quanta.engine.config import EngineConfig
from quanta.engine.parallel.group import HOST, TIMEOUT, join, rank_config


def worker_entry() -> None:
    """A spawned rank's process: its arguments come pickled on stdin (see start). It ends with os._exit
    once it has left the group: nothing it holds needs the interpreter's teardown, which could wait on
    the communicator's threads."""
    worker_main(*pickle.loads(sys.stdin.buffer.read()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_main(cfg: EngineConfig, rank: int, world: int, port: int, errors: str,
                build: Callable[..., Any]) -> None:
    """A spawned rank: join the group through rank 0's store at `port`, build the core over this rank's shard
    (`build(config, tp=...)`), serve rank 0 until it closes. A start-up error is left pickled in the folder
    `errors` for rank 0 to raise."""
    if torch.device(cfg.device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=TIMEOUT)
    tp = join(cfg, rank, world, store=store)
    tp.errors = errors
    try:
        core = build(rank_config(cfg, rank, world), tp=tp)
    except BaseException as e:                    # noqa: BLE001 -- handed to rank 0, which raises it
        if not tp.agreed:
            with contextlib.suppress(BaseException):
                tp.fail(e)
        tp.close()
        return
    core.serve()
