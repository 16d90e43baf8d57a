"""Recovering from running out of device memory: every rank gives up the step, the plan shrinks, the step is redone.

[Note: recovering from out of memory]
A plan is searched to fit its budget, and calibrated from the first steps; an out-of-memory error
can still slip through (a longer batch, another process taking memory, an allocator that
fragments). Under plan="auto" with ``oom_recovery`` on (the default), a ``torch.OutOfMemoryError``
in a training step's forward or backward (the user's code, the runtime's gathers and reductions)
does not end the run:

1. Agreement. The rank that ran out writes it to the process group's store; the other ranks learn
   of it in their next wait for a collective (the runtime's group watches the store between the
   slices of every host wait, [Note: bounded waits] in runtime/collectives.py), give up their step
   too (``StepAbandoned``) and write how far they got. Each rank waits until every rank has
   written: all decide on the same facts, the worst overshoot among them.
2. The partial step is dropped. The collectives some ranks issued and others never will stay on
   the old process group, which is abandoned (its waits return at once); the runtime moves to a new
   group of the same ranks, made when the runtime was built so that nothing is created in the
   middle of a failure, and re-chunks under the new plan (runtime/replan.py): masters,
   optimizer state and companions are copied; the gradients of earlier micro-batches of the same
   optimizer step are carried; the failed micro-batch's are thrown away.
3. The new plan is the search's best for a budget below the running plan's predicted peak by the
   measured overshoot (the bytes the failing allocation needed beyond what the device had; the
   worst rank's) and 2%: the prediction missed at least that much, so the next plan must be
   predicted that much lower. On the calibrated profiles when the self-correction ran; rank 0
   searches and the others read its plan from the store. A redo that runs out again lowers again,
   from the new plan's prediction.
4. What the failed attempt changed is put back (``StepSnapshot``, taken as each micro-batch starts):
   the random generators (so dropout draws the same masks), the module's buffers (BatchNorm's
   running statistics), torchmetrics states and Lightning's logged values of the step, so that no
   sample, metric or random draw is counted twice. The same micro-batch is then run again.

Bounded: a step that runs out of memory ``max_attempts`` times ends the run with
``ElixirOutOfMemoryError`` (a ``torch.OutOfMemoryError``) naming each attempt's plan and needed
bytes, and what to do. Not recovered, with the same error and the reason: an error in the
optimizer's update (the update may have been partly applied), in a backward of a later micro-batch
of an accumulating step after some of its gradients were reduced (the sums cannot be taken apart),
under manual optimization once an optimizer has stepped in the attempt, and plans that were not
searched (a plan given by the user, or the untraced fallback): those out-of-memory errors propagate
unchanged, as with ``oom_recovery=False``.

The runtime's group and the spare live as long as the stage's runtime: the strategy destroys them
when it lets the runtime go at the end of the stage (each gloo group keeps threads of its own that
wake up without work). A group given up by a recovery is left as it is: it may still hold
collectives that some ranks never issued, and destroying it would wait for them.
"""

from __future__ import annotations

import gc
import json
import logging
import pickle
import re
import time
import traceback
import warnings
from datetime import timedelta
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_elixir.plan import ElixirPlan
from lightning_elixir.profile.preserved import rng_states, set_rng_states
from lightning_elixir.runtime.collectives import Group, StepAbandoned
from lightning_elixir.runtime.emulated import EmulatedOutOfMemoryError
from lightning_elixir.search.errors import NoPlanFitsError
from lightning_elixir.search.evaluate import evaluate_plan
from lightning_elixir.search.report import SearchReport, format_bytes
from lightning_elixir.search.variants import search_variants

log = logging.getLogger(__name__)

MARGIN = 0.02
"""Besides the overshoot, the budget is lowered by this fraction of it at each recovery."""
_KEY = "elixir/oom"
_NOT_SEARCHED = "the plan was not searched (given by the user, or the untraced fallback), so there is none to shrink"
"""Why not, when the running plan is the untraced fallback: its error propagates unchanged."""


class ElixirOutOfMemoryError(torch.OutOfMemoryError):
    """A step ran out of device memory and could not be recovered ([Note: recovering from out of memory])."""


def recoverable_error(err: BaseException) -> bool:
    """Whether ``err`` ends a step that recovery may redo: out of memory here, or on another rank."""
    return isinstance(err, (torch.OutOfMemoryError, StepAbandoned)) and not isinstance(err, ElixirOutOfMemoryError)


@dataclass
class Attempt:
    """One recovery: what ran out, on which ranks, the plan that ran and the one chosen."""

    step: int
    where: str
    ranks: tuple[int, ...]
    overshoot_bytes: int
    budget_bytes: int
    plan: str
    message: str


@dataclass
class StepSnapshot:
    """What a micro-batch may change that a redo must find as before ([Note: recovering from out of memory], 4)."""

    rng: dict[str, Any]
    buffers: list[tuple[nn.Module, str, torch.Tensor]]
    metrics: list[tuple[nn.Module, dict[str, Any], dict[str, torch.Tensor]]]
    results: Optional[tuple[Any, dict[str, Any]]]
    flags: list[tuple[nn.Parameter, bool]]
    """Each parameter's ``requires_grad``: a ``toggle_optimizer`` the failed attempt did not undo froze some."""
    toggled: Optional[tuple[nn.Module, dict[Any, bool]]]
    """The module and the flags ``untoggle_optimizer`` restores (Lightning keeps them on the module between
    the two calls)."""

    @classmethod
    def take(cls, module: nn.Module, results: Any, cuda: bool,
             where: Optional[tuple[list[tuple[nn.Module, str]], list[nn.Module]]] = None) -> "StepSnapshot":
        """``where``: ``state_slots(module)``, when the caller keeps it between micro-batches."""
        slots, metric_modules = where if where is not None else state_slots(module)
        buffers = [(m, name, m._buffers[name].detach().clone()) for m, name in slots if m._buffers.get(name) is not None]
        metrics = [_metric_state(m) for m in metric_modules]
        kept = None
        if results is not None:
            kept = (results, {key: (value, [_metric_state(m) for m in _result_metrics(value)])
                              for key, value in results.items()})
        with torch._C.DisableTorchFunctionSubclass():  # attribute reads: no ChunkedParameter dispatch
            flags = [(p, p.requires_grad) for p in module.parameters()]
        toggled = getattr(module, "_param_requires_grad_state", None)
        return cls(rng_states(cuda, every_device=False), buffers, metrics, kept, flags,
                   (module, dict(toggled)) if toggled is not None else None)

    def restore(self) -> None:
        set_rng_states(self.rng)
        with torch._C.DisableTorchFunctionSubclass():
            for param, flag in self.flags:
                if param.requires_grad != flag:
                    param.requires_grad_(flag)
        if self.toggled is not None:
            owner, flags = self.toggled
            owner._param_requires_grad_state = dict(flags)
        with torch.no_grad():
            for holder, name, value in self.buffers:
                current = holder._buffers.get(name)
                if current is not None and current.shape == value.shape:
                    current.copy_(value)
                else:
                    holder._buffers[name] = value.clone()
        for state in self.metrics:
            _put_metric_state(state)
        if self.results is not None:
            results, kept = self.results
            for key in [k for k in results if k not in kept]:
                del results[key]
            for key, (value, states) in kept.items():
                results[key] = value
                for state in states:
                    _put_metric_state(state)


def state_slots(module: nn.Module) -> tuple[list[tuple[nn.Module, str]], list[nn.Module]]:
    """Where a micro-batch may change state in place: the persistent buffers (as module and name, so that a
    tensor assigned later is found) and the torchmetrics metrics."""
    modules = list(module.modules())
    slots = [(m, name) for m in modules for name in m._buffers if name not in m._non_persistent_buffers_set]
    return slots, [m for m in modules if _is_metric(m)]


def _is_metric(module: nn.Module) -> bool:
    return hasattr(module, "_defaults") and hasattr(module, "_update_count")  # a torchmetrics Metric


def _result_metrics(value: Any) -> list[nn.Module]:
    """The metrics of one entry of Lightning's logged results (one metric, or a collection of them)."""
    if _is_metric(value):
        return [value]
    if isinstance(value, dict):
        return [m for v in value.values() for m in _result_metrics(v)]
    return []


def _metric_state(metric: nn.Module) -> tuple[nn.Module, dict[str, Any], dict[str, torch.Tensor]]:
    """A metric's attributes (its counters) and copies of its tensor states (updated in place)."""
    tensors = {name: getattr(metric, name).clone() for name in metric._defaults
               if isinstance(getattr(metric, name, None), torch.Tensor)}
    lists = {name: list(getattr(metric, name)) for name in metric._defaults
             if isinstance(getattr(metric, name, None), list)}
    return metric, {**metric.__dict__, **lists}, tensors


def _put_metric_state(state: tuple[nn.Module, dict[str, Any], dict[str, torch.Tensor]]) -> None:
    metric, attributes, tensors = state
    for name, value in attributes.items():
        metric.__dict__[name] = list(value) if isinstance(value, list) else value
    for name, value in tensors.items():
        setattr(metric, name, value.clone())


class OutOfMemoryRecovery:
    """Recovery for one strategy ([Note: recovering from out of memory])."""

    def __init__(self, max_attempts: int = 3) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be a positive int, got {max_attempts!r}")
        self.max_attempts = max_attempts
        self.attempts: list[Attempt] = []
        """Every recovery of the run, in order."""
        self.snapshot: Optional[StepSnapshot] = None
        self.carries_grads = False
        """Whether the micro-batch under way follows others of the same optimizer step (their gradients are kept)."""
        self._scope = ""
        self._spare: Optional[Group] = None
        self._failed_in_step = 0
        self._step = -1
        self._retired_at_begin = self._retired_at_step = 0
        self._stepped = -1
        self._reductions: Any = None
        self._slots: Optional[tuple[Any, Any]] = None
        self._carried = False

    # ---- the group and its watch ---------------------------------------------------------------

    @staticmethod
    def works_over(group: Group) -> bool:
        """Whether recovery can run over ``group``; says why not, once, where it cannot.

        [Note: no recovery across GPUs yet]
        The recovery learns of another rank's failure in its host waits for collectives, and then
        gives up the old process group. On NCCL a wait makes the device's stream wait, not the host:
        the ranks that did not run out of memory go on queueing work behind a collective the failing
        rank never joins, their devices stall, and a given-up group's kernels would still write into
        memory the next plan reuses. Calling them off takes aborting the communicator on every rank,
        which is not built yet, so with NCCL and several ranks the strategy runs without recovery and
        an out-of-memory error ends the run, as with ``oom_recovery=False``. One GPU, and gloo, recover.
        """
        if group.world_size == 1 or "nccl" not in str(dist.get_backend(group.pg)):
            return True
        if group.rank == 0:
            warnings.warn("Elixir: out-of-memory recovery is off with NCCL across several processes (it recovers "
                          "on one GPU and on gloo): a rank that runs out of memory cannot yet call off the "
                          "collectives the other ranks queued on their GPUs, so such an error ends the run, as with "
                          "oom_recovery=False. If it happens, lower the budget "
                          "(ElixirStrategy(device_memory_limit=...)).", stacklevel=2)
        return False

    def prepare(self, group: Group) -> Group:
        """Watch ``group`` for another rank's failure, and make the group a recovery will move to."""
        if group.world_size == 1:
            return group
        group.watch[0] = self._check_peers
        # Keys named after the group (the same name on every rank, new with every group): another run in
        # the same processes, or the step after a recovery, never reads these.
        self._scope = dist.distributed_c10d._get_process_group_name(group.pg)
        self._spare = new_group(group)
        return group

    def release(self) -> None:
        """Destroy the spare group (the strategy destroys the runtime's own when the stage ends)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            dist.destroy_process_group(spare.pg)

    def _check_peers(self) -> None:
        if _store().check([self._key("failed")]):
            raise StepAbandoned("another rank ran out of memory in this step")

    def _key(self, name: str) -> str:
        return f"{_KEY}/{self._scope}/{name}"

    # ---- each micro-batch ---------------------------------------------------------------------

    def begin(self, runtime: Any, results: Any) -> None:
        """A micro-batch starts: keep what a redo must find as before."""
        runtime.finish_unreported()  # an earlier micro-batch's gradients count as landed before this one
        if self._slots is None or self._slots[0] is not runtime:  # found once per runtime
            self._slots = (runtime, state_slots(runtime.module))
        self.snapshot = StepSnapshot.take(runtime.module, results, runtime.device.type == "cuda", self._slots[1])
        reductions, stepped = runtime.grads.reductions, runtime.steps + runtime.skipped_steps
        if reductions is not self._reductions:  # a new runtime: it holds the gradients carried into it, or none
            self._reductions, self._stepped = reductions, stepped
            self._retired_at_step = -1 if self._carried else 0
            self._carried = False
        elif stepped != self._stepped:  # the first micro-batch since an optimizer step
            self._stepped, self._retired_at_step = stepped, reductions.retired
        self.carries_grads = reductions.retired != self._retired_at_step
        self._retired_at_begin = reductions.retired

    # ---- recovering ----------------------------------------------------------------------------

    def recover(self, err: BaseException, strategy: Any, step: int, where: str, *, redoable: Optional[str]) -> None:
        """Agree with the other ranks, lower the budget, switch the plan and put the micro-batch's state back.

        ``redoable``: None when the step can be redone, else why not (the error is then raised, on every rank).
        Raises ``ElixirOutOfMemoryError`` when it cannot recover, chained to ``err``."""
        runtime = strategy.runtime
        group: Group = runtime.group
        overshoot = _overshoot(err, strategy)
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)  # the failed attempt's activations go now
        gc.collect()  # and what cycles still held of them
        if runtime.device.type == "cuda":  # the allocator's cached blocks back, unfragmented, for the switch and redo
            torch.cuda.empty_cache()
        landed = runtime.grads.reductions.retired != self._retired_at_begin
        if redoable is None and self.carries_grads and landed:
            redoable = ("some of this micro-batch's gradients were already added to those of the earlier "
                        "micro-batches of the optimizer step, and the sums cannot be taken apart")
        if redoable is None and strategy.planning_for_recovery() is None:
            redoable = _NOT_SEARCHED
        own = {"rank": group.rank, "ran_out": not isinstance(err, StepAbandoned), "overshoot": overshoot,
               "why_not": redoable, "message": message}
        facts = self._agree(own, group)
        if step != self._step:
            self._step, self._failed_in_step = step, 0
        self._failed_in_step += 1
        ran_out = [f for f in facts if f["ran_out"]]
        worst = max((f["overshoot"] for f in ran_out), default=0)
        why_not = next((f["why_not"] for f in facts if f["why_not"]), None)
        if why_not is not None:
            if isinstance(err, torch.OutOfMemoryError) and why_not == _NOT_SEARCHED:
                raise err  # unchanged, as without recovery
            raise ElixirOutOfMemoryError(self._explain(ran_out, why_not, strategy)) from err
        planning = strategy.planning_for_recovery()
        # The running plan needed its predicted peak plus what the prediction missed (at least the overshoot):
        # the next must be predicted that much lower.
        predicted = evaluate_plan(runtime.plan, planning.model_profile, planning.hardware_profile,
                                  planning.options).memory.peak_bytes
        budget = min(planning.budget_bytes, predicted)
        budget = int(budget - worst - MARGIN * budget)  # below the most frugal plan's need: that plan, if lower
        self.attempts.append(Attempt(step, where, tuple(f["rank"] for f in ran_out), worst, budget,
                                     strategy.describe_running(), "; ".join(f["message"] for f in ran_out)))
        if self._failed_in_step > self.max_attempts:
            raise ElixirOutOfMemoryError(self._explain(ran_out, f"it ran out {self._failed_in_step} times in a row",
                                                       strategy)) from err
        plan, report = self._shared_plan(planning, budget, predicted, group, err)
        group.abandoned[0] = True
        fresh, self._spare = self._spare, None
        assert fresh is not None or group.world_size == 1
        if fresh is not None:
            runtime.regroup(fresh)
            self.prepare(fresh)
        strategy.switch_plan(plan, grads=self.carries_grads, budget_bytes=report.budget_bytes, report=report)
        self._carried = self.carries_grads
        assert self.snapshot is not None
        self.snapshot.restore()
        strategy.runtime.follow_requires_grad()  # the flags the failed attempt toggled are back

    def _agree(self, own: dict[str, Any], group: Group) -> list[dict[str, Any]]:
        """Every rank's facts about the failure, the same list on every rank."""
        if group.world_size == 1:
            return [own]
        store = _store()
        store.set(self._key("failed"), str(group.rank))
        store.set(self._key(f"rank{group.rank}"), json.dumps(own))
        keys = [self._key(f"rank{r}") for r in range(group.world_size)]
        timeout = group.timeout_s or 600.0
        deadline = time.monotonic() + timeout
        while not store.check(keys):
            if time.monotonic() > deadline:
                raise ElixirOutOfMemoryError(
                    f"rank {group.rank} ran out of memory (or learned that another did), and not every rank reached "
                    f"the recovery within {timeout:g} s: a rank is blocked in a collective of its own (a "
                    "self.log(..., sync_dist=True) in training_step, say). Lower the memory the step needs "
                    "(device_memory_limit, the batch size) or run with oom_recovery=False.")
            time.sleep(0.01)
        return [json.loads(store.get(k)) for k in keys]

    def _shared_plan(self, planning: Any, budget: int, running_peak: int, group: Group,
                     err: BaseException) -> tuple[ElixirPlan, SearchReport]:
        """Rank 0's search for ``budget`` (or, below the most frugal plan, that plan while it is predicted
        below the running plan's ``running_peak``) and its report, on every rank (through the store: the old
        group is in an unknown state)."""
        if group.rank == 0:
            # every traced recomputation variant: recomputing more may be the cheapest way down ([Note:
            # recomputation variants] in search/variants.py)
            variants, hardware, options = planning.searchable, planning.hardware_profile, planning.options
            try:
                found = search_variants(variants, hardware, max(budget, 1), options)
                payload: tuple[str, Any] = (found.plan.to_json(), found.report)
            except NoPlanFitsError as no_fit:
                if no_fit.min_device_bytes >= running_peak:  # the most frugal plan is no lower than the running one
                    payload = ("!" + str(no_fit).splitlines()[0], None)
                else:
                    found = search_variants(variants, hardware, no_fit.min_device_bytes, options)
                    payload = (found.plan.to_json(), found.report)
            if group.world_size > 1:
                _store().set(self._key("plan"), pickle.dumps(payload))
        else:
            payload = pickle.loads(_store().get(self._key("plan")))  # written by rank 0 of this job
        text, report = payload
        if text.startswith("!"):
            raise ElixirOutOfMemoryError(
                f"the step ran out of memory, and no plan fits the budget lowered to {format_bytes(max(budget, 0))} "
                f"({text[1:]}). " + _advice(planning)) from err
        return ElixirPlan.from_json(text), report

    def _explain(self, ran_out: list[dict[str, Any]], why: str, strategy: Any) -> str:
        attempts = "; ".join(f"step {a.step} ({a.where}): {a.plan}, short by {format_bytes(a.overshoot_bytes)}"
                             for a in self.attempts[-self.max_attempts:]) or "none before"
        ranks = ", ".join(str(f["rank"]) for f in ran_out) or "another rank"
        first = ran_out[0]["message"] if ran_out else "out of memory"
        return (f"the training step ran out of device memory on rank(s) {ranks} ({first}) under "
                f"{strategy.describe_running()}, and it cannot be redone: {why}. Recoveries so far: {attempts}. "
                + _advice(strategy.planning_for_recovery()))


def _advice(planning: Any) -> str:
    """What would help, less what the search already weighed (recomputation, when it traced the variants)."""
    weighed = planning is not None and len(planning.searchable) > 1
    return ("To fit: lower device_memory_limit so that plan='auto' keeps more headroom"
            + (" or lower the batch size (the search already weighed recomputing blocks)." if weighed else
               ", lower the batch size, or checkpoint activations in the model (torch.utils.checkpoint)."))


def _overshoot(err: BaseException, strategy: Any) -> int:
    """Bytes the failing allocation needed beyond what the device had (0: another rank's failure)."""
    if isinstance(err, EmulatedOutOfMemoryError):
        return max(err.needed_bytes - err.limit_bytes, 0)
    if isinstance(err, StepAbandoned):
        return 0
    match = re.search(r"[Tt]ried to allocate ([\d.]+) (GiB|MiB|KiB|B)", str(err))
    asked = int(float(match.group(1)) * {"GiB": 2 ** 30, "MiB": 2 ** 20, "KiB": 2 ** 10, "B": 1}[match.group(2)]) \
        if match else 0
    device = strategy.root_device
    if device.type == "cuda":  # what the allocator holds beyond what it hands out is lost to any plan
        asked += max(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), 0)
    return asked


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def new_group(group: Group) -> Group:
    """A new process group of the same ranks, on the default group's backend."""
    kwargs = {} if group.timeout_s is None else {"timeout": timedelta(seconds=group.timeout_s)}
    pg = dist.new_group(ranks=list(range(group.world_size)), backend=dist.get_backend(), **kwargs)
    return Group(pg, group.rank, group.world_size, group.timeout_s)
