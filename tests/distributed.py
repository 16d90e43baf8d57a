"""Run a function on N CPU processes with gloo, and collect what each rank returns.

The ranks are forked from multiprocessing's fork server, which imports torch, Lightning and this
package once for the whole test session: a spawned rank imports them again (about 4 s of CPU), and
on a machine with fewer cores than ranks that was most of a short test's time. A forked rank starts
from the fork server's state, so each call hands it the caller's environment variables, as a spawned
rank would have inherited them."""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ("torch", "lightning.pytorch", "lightning_elixir", __name__)
"""What the fork server imports before it forks its first process, besides the modules of the first call."""


def fork_server(*modules: str) -> Any:
    """multiprocessing's fork server context, importing ``PRELOAD`` and ``modules`` before its first fork.

    The server starts once per session: only the first call's ``modules`` are imported there, and a
    later caller's module is imported by each process it forks (after torch and Lightning, which is cheap)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, *modules])
    return context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str,
            environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result."""
    fork_server(fn.__module__)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir, dict(os.environ)),
                           nprocs=world_size, join=True, start_method="forkserver")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
