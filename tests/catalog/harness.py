"""Run catalog cases under one strategy on two gloo CPU ranks, all inside one spawned process pair.

Each worker sets the torchrun-style environment (MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK,
NODE_RANK) and creates the gloo process group itself; Lightning's LightningEnvironment then sees
externally created processes (``LOCAL_RANK`` is set) and ``Trainer(devices=2)`` runs in-process,
reusing the existing group. The worker loops over the cases: seed, build the module, run the
case's ``run(ctx)`` with Trainers from ``ctx.trainer()``, and save a small result per case and
rank (losses per step, logged metrics, final weights, buffers, extras).

Failures stay local to their case:
- an exception is recorded (traceback text) and the next case runs;
- the ranks agree on success through a TCPStore hosted by the parent (not the process group,
  which a failure may leave mid-collective); a rank stuck in a collective the other rank never
  joins raises after the process group timeout (60 s). After any failure both ranks re-create
  the process group, so a half-finished collective cannot pair with the next case's;
- a crash or a hang (no case finished for ``CASE_TIMEOUT_S``) kills the pair; the case in
  progress is reported with the tail of the workers' logs and a fresh pair runs the rest.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback

WORLD_SIZE = int(os.environ.get("CATALOG_WORLD_SIZE", 2))
"""Ranks every case runs on: 2 (the default), or ``CATALOG_WORLD_SIZE`` to run the catalog at another world
size (3 or 4 find what an even split hides: padding, a sum of more than two parts)."""
STRATEGIES = ("ddp", "elixir", "elixir-tight", "zero3-1pp", "zero3-shared")
PG_TIMEOUT_S = 60
CASE_TIMEOUT_S = float(os.environ.get("CATALOG_CASE_TIMEOUT", 180))
"""The parent kills a pair that finished no case for this long (a hang the process group timeout missed)."""
AGREE_TIMEOUT_S = 4 * PG_TIMEOUT_S
"""How long a rank waits for the other at a status exchange (it may be waiting out a collective's timeout)."""

BASE_TRAINER: dict[str, Any] = dict(
    accelerator="cpu", devices=WORLD_SIZE, num_nodes=1, max_epochs=1, logger=False, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=False, limit_val_batches=2, num_sanity_val_steps=1)


# ---------------------------------------------------------------------------------------------------------------------
# strategies


def _complete_module(case: Any) -> Any:
    """The case's module with the layers it builds in setup or configure_model (meta init): shapes only."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_elixir.runtime.deferred import record_init

    model = case.module()
    with record_init(torch.device("cpu")):  # meta tensors whose values a build may still read (.item())
        if is_overridden("setup", model):
            model.setup("fit")
        if is_overridden("configure_model", model):
            model.configure_model()
    return model


def one_param_per_chunk_plan(case: Any) -> Any:
    """"zero3-1pp": one chunk per parameter (private where a parameter is held by several modules), ZeRO-3 cache."""
    from lightning_elixir import ChunkSpec, ElixirPlan
    from lightning_elixir.plan import round_up
    from lightning_elixir.runtime.layout import shared_param_names

    model = _complete_module(case)
    shared = shared_param_names(model)
    private = set(shared) | set(case.private)
    chunks = tuple(ChunkSpec((name,), numel=max(round_up(p.numel(), WORLD_SIZE), WORLD_SIZE), private=name in private)
                   for name, p in model.named_parameters())
    return ElixirPlan(chunks=chunks, world_size=WORLD_SIZE, cache_blocks="min", name="zero3-1pp")


def shared_chunks_plan(case: Any) -> Any:
    """"zero3-shared": the default packing into small chunks that several modules share (1088 elements,
    or the largest parameter), the fewest cache blocks, prefetch 2; explicit-plan private parameters; and
    every block recomputed in backward ([Note: searched recomputation]), over the model's own
    checkpointing where it has some."""
    from lightning_elixir import ElixirPlan
    from lightning_elixir.plan import round_up
    from lightning_elixir.recompute import recompute_candidates

    model = _complete_module(case)
    largest = max((p.numel() for p in model.parameters()), default=1)
    return ElixirPlan(chunk_numel=max(1088, round_up(largest, WORLD_SIZE)), cache_blocks="min", prefetch_depth=2,
                      name="zero3-shared", recompute=recompute_candidates(model))


def make_strategy(name: str, case: Any, plan: Any) -> Any:
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(**case.ddp)
    from lightning_elixir import ElixirStrategy

    if name == "elixir":
        return ElixirStrategy(plan="auto")
    if name == "elixir-tight":  # the budget is set by plan_within_a_tight_budget; a switch would search the whole one
        return ElixirStrategy(plan="auto", replan=False, updates_in_backward=True)  # on a CPU too: its offloading plans
    if name == "zero3-1pp":
        return ElixirStrategy(plan=plan)
    if name == "zero3-shared":
        return ElixirStrategy(plan=plan, private_params=case.private)
    raise ValueError(f"unknown strategy {name!r}")


def plan_within_a_tight_budget() -> None:
    """"elixir-tight": plan="auto", with every search given the budget halfway between what the most
    frugal plan needs and the peak of the plan the whole budget would get (the planner's own numbers,
    for each case's model and batch), so that the plan evicts gathered chunks or offloads state.
    For these small models it offloads: the search's chunk sizes do not go below a small model's
    size, so a plan of one or two chunks saves memory by offloading, not by evicting (the explicit
    ZeRO-3 plans, "zero3-1pp" and "zero3-shared", evict).

    The budget is set here rather than as ``device_memory_limit`` because it depends on each model
    and batch, and the search keeps a fixed workspace margin (256 MiB) far larger than these models."""
    from lightning_elixir.search import search, variants
    from lightning_elixir.search.errors import frugal_plan

    def tight_search(model: Any, hardware: Any, budget: int, options: Any) -> Any:
        _, whole = search(model, hardware, budget, options)
        least = frugal_plan(model, hardware, options).memory.peak_bytes
        return search(model, hardware, max(least, (least + whole.winner.peak_bytes) // 2), options)

    variants.search = tight_search  # every search of the planning goes through search/variants.py


# ---------------------------------------------------------------------------------------------------------------------
# inside a worker


def _num(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().cpu()) if value.numel() == 1 else value.detach().cpu().clone()
    return value


def _cpu(obj: Any) -> Any:
    """A picklable, detached CPU copy of a result (tensors, containers, numbers, strings)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, Mapping):
        return {str(k): _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_cpu(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


class Recorder(Callback):
    """Losses, logged values and learning rates after every training batch; goes last among the callbacks."""

    def __init__(self, ctx: "Ctx", index: int) -> None:
        self.ctx, self.index = ctx, index

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self.ctx.steps.append((self.index, trainer.global_step, batch_idx, None if loss is None else _num(loss)))
        self.ctx.step_metrics.append({k: _num(v) for k, v in trainer.callback_metrics.items()})
        self.ctx.lrs.append([[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers])


class Ctx:
    """What a case's ``run`` gets: the module, its data, a Trainer factory and a place for extras."""

    def __init__(self, case: Any, strategy: str, rank: int, root: Path, plan: Any) -> None:
        self.case, self.strategy, self.rank, self.root, self.plan = case, strategy, rank, root, plan
        self.model: Any = None
        self.data: dict[str, Any] = {}
        self.trainers: list[Any] = []
        self.steps: list[tuple] = []
        self.step_metrics: list[dict] = []
        self.lrs: list[list] = []
        self.extras: dict[str, Any] = {}

    def trainer(self, callbacks: tuple = (), **overrides: Any) -> Any:
        import lightning as L

        os.environ["WORLD_SIZE"] = str(WORLD_SIZE)  # LightningEnvironment.teardown() deletes it
        kwargs = {**BASE_TRAINER, **self.case.trainer, **overrides}
        index = len(self.trainers)
        trainer = L.Trainer(strategy=make_strategy(self.strategy, self.case, self.plan),
                            callbacks=[*callbacks, Recorder(self, index)],
                            default_root_dir=str(self.root / f"trainer{index}"), **kwargs)
        self.trainers.append(trainer)
        return trainer


def _run_case(case: Any, strategy: str, rank: int, root: Path, agree: Any) -> tuple[dict, bool]:
    import lightning as L

    result: dict[str, Any] = dict(errors=[], seconds=None, steps=[], step_metrics=[], lrs=[], metrics={},
                                  weights=None, init=None, buffers={}, extras={})
    ok = True
    start = time.perf_counter()
    ctx: Optional[Ctx] = None
    try:
        plan = {"zero3-1pp": one_param_per_chunk_plan, "zero3-shared": shared_chunks_plan}.get(strategy)
        plan = plan(case) if plan is not None else None
        L.seed_everything(case.seed, verbose=False)
        model = case.module()
        ctx = Ctx(case, strategy, rank, root, plan)
        ctx.model, ctx.data = model, case.data()
        if rank == 0:
            result["init"] = _cpu(model.state_dict())
        L.seed_everything(case.seed, verbose=False)
        case.run(ctx)
    except Exception:
        ok = False
        result["errors"].append(f"rank {rank} run: {traceback.format_exc()}")
    all_ok = agree("run", ok)
    if ctx is not None and ctx.trainers and all_ok:
        try:  # final weights the way a user gets them: a checkpoint written by the Trainer
            path = root / "final.ckpt"
            ctx.trainers[-1].save_checkpoint(path, weights_only=True)
            if rank == 0:
                result["weights"] = _cpu(torch.load(path, weights_only=False, map_location="cpu")["state_dict"])
        except Exception:
            ok = False
            result["errors"].append(f"rank {rank} trainer.save_checkpoint after the run: {traceback.format_exc()}")
        all_ok = agree("checkpoint", ok)
    if ctx is not None:
        try:
            result.update(steps=ctx.steps, step_metrics=_cpu(ctx.step_metrics), lrs=ctx.lrs, extras=_cpu(ctx.extras),
                          buffers=_cpu(dict(ctx.model.named_buffers())))
            if ctx.trainers:
                result["metrics"] = {k: _num(v) for k, v in ctx.trainers[-1].callback_metrics.items()}
                result["plans"] = [_plan_of(t.strategy) for t in ctx.trainers]
        except Exception:
            ok = False
            result["errors"].append(f"rank {rank} collecting results: {traceback.format_exc()}")
    result["seconds"] = time.perf_counter() - start
    return result, all_ok and ok


def _plan_of(strategy: Any) -> str:
    """The plan an Elixir strategy ran ("fallback" when planning could not trace the step); "" otherwise."""
    planning = getattr(strategy, "planning", None)
    if planning is not None and getattr(planning, "fallback_reason", None):
        return "fallback"
    if planning is not None and planning.report is not None:  # a searched plan: how tight it runs
        w = planning.report.winner
        blocks = "all" if w.all_gathered else str(w.cache_blocks)
        recompute = f", {len(planning.plan.recompute)} blocks recomputed" if planning.plan.recompute else ""
        return f"auto (blocks {blocks}, {w.offloaded} of {w.chunks} chunks offloaded{recompute})"
    plan = getattr(strategy, "plan", None)
    return getattr(planning.plan if planning is not None else plan, "name", "") if plan is not None else ""


def _redirect_output(path: Path) -> None:
    log = open(path, "a", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log


def _worker(rank: int, store_port: int, cases: list[str], strategy: str, out_dir: str) -> None:
    out = Path(out_dir)
    _redirect_output(out / f"rank{rank}.log")
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port), WORLD_SIZE=str(WORLD_SIZE),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=AGREE_TIMEOUT_S))
    generation = 0

    def init_group() -> None:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"pg{generation}", store), rank=rank,
                                world_size=WORLD_SIZE, timeout=timedelta(seconds=PG_TIMEOUT_S))

    init_group()
    import lightning_elixir  # noqa: F401  (registers the strategies, as a user's import would)

    if strategy == "elixir-tight":
        plan_within_a_tight_budget()
    from tests.catalog.models import BY_NAME

    for i, name in enumerate(cases):
        case = BY_NAME[name]
        root = out / "runs" / name / f"rank{rank}"
        root.mkdir(parents=True, exist_ok=True)
        (out / f"current.rank{rank}").write_text(name)

        def agree(phase: str, ok: bool) -> bool:
            key = f"{i}/{name}/{phase}"
            store.set(f"{key}/{rank}", "1" if ok else "0")
            keys = [f"{key}/{r}" for r in range(WORLD_SIZE)]
            store.wait(keys, timedelta(seconds=AGREE_TIMEOUT_S))
            return all(store.get(k) == b"1" for k in keys)

        print(f"=== {name} ({strategy})", flush=True)
        result, ok = _run_case(case, strategy, rank, root, agree)
        torch.save(result, out / f"{name}.rank{rank}.pt")
        if not ok:  # a failed case may leave a collective half done: start the next one on a fresh group
            try:
                dist.destroy_process_group()
            except Exception:
                pass
            generation += 1
            init_group()
        gc.collect()
        gc.freeze()  # what is still alive stays: later collections, per case and automatic, skip it
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# in the parent


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _failed(message: str) -> dict:
    return dict(errors=[message], seconds=None, steps=[], step_metrics=[], lrs=[], metrics={}, weights=None,
                init=None, buffers={}, extras={})


def _result_path(out: Path, name: str, rank: int) -> Path:
    return out / f"{name}.rank{rank}.pt"


def run_cases(cases: list[str], strategy: str, out_dir: Path) -> dict[str, list[dict]]:
    """Run ``cases`` under ``strategy``: one spawned pair for all of them (a new pair only after a crash or hang)."""
    results: dict[str, list[dict]] = {}
    remaining = list(cases)
    attempt = 0
    ctx = mp.get_context("spawn")
    while remaining:
        out = out_dir / f"{strategy}-{attempt}"
        out.mkdir(parents=True, exist_ok=True)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=AGREE_TIMEOUT_S))
        procs = [ctx.Process(target=_worker, args=(rank, store.port, remaining, strategy, str(out)), daemon=True)
                 for rank in range(WORLD_SIZE)]
        for p in procs:
            p.start()
        last_progress, finished, dead_since = time.monotonic(), 0, None
        why = ""
        while True:
            time.sleep(0.2)
            done = sum(all(_result_path(out, n, r).exists() for r in range(WORLD_SIZE)) for n in remaining)
            now = time.monotonic()
            if done != finished:
                finished, last_progress = done, now
            if all(p.exitcode is not None for p in procs):
                why = f"exit codes {[p.exitcode for p in procs]}"
                break
            if any(p.exitcode not in (None, 0) for p in procs):
                dead_since = dead_since or now
                if now - dead_since > 15:
                    why = f"a worker died, exit codes {[p.exitcode for p in procs]}"
                    break
            if now - last_progress > CASE_TIMEOUT_S:
                why = f"no case finished for {CASE_TIMEOUT_S:.0f} s (hang)"
                break
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(10)
        del store
        left = []
        for n in remaining:
            paths = [_result_path(out, n, r) for r in range(WORLD_SIZE)]
            if all(path.exists() for path in paths):
                results[n] = [torch.load(path, weights_only=False) for path in paths]
            else:
                left.append(n)
        if left and not any((out / f"current.rank{r}").exists() for r in range(WORLD_SIZE)):
            logs = "\n".join(f"--- rank {r} log tail ---\n{_tail(out / f'rank{r}.log')}" for r in range(WORLD_SIZE))
            raise RuntimeError(f"the worker pair failed before its first case ({why})\n{logs}")
        if left:  # the first unfinished case crashed or hung; the rest get a fresh pair
            culprit = left.pop(0)
            logs = "\n".join(f"--- rank {r} log tail ---\n{_tail(out / f'rank{r}.log')}" for r in range(WORLD_SIZE))
            results[culprit] = [
                torch.load(path, weights_only=False) if path.exists()
                else _failed(f"rank {r}: the worker pair stopped during this case ({why})\n{logs}")
                for r, path in enumerate(_result_path(out, culprit, r) for r in range(WORLD_SIZE))]
        remaining = left
        attempt += 1
    return results

