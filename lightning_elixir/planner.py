"""plan="auto": profile the model and the machine, then search, before the model is chunked.

``AutoPlanner`` (autoplan.py) calls ``plan_for_trainer`` when the strategy's ``setup`` asks for a plan;
the monitor logs the report and the memory timelines. Every rank profiles (the hardware benchmarks are
collective) and searches; rank 0's plan is broadcast so that all ranks run the same one even if
their measurements differ in the last digit.

Planning follows the stage the trainer runs ([Note: planning per stage] in stage.py) and changes nothing
the run sees: the module's state and the global random generators are put back afterwards. When the
step cannot be traced on fake tensors, planning falls back to ``FALLBACK_PLAN`` with one warning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_elixir.plan import CACHE_ALL, ElixirPlan
from lightning_elixir.profile import profile_hardware, profile_model
from lightning_elixir.profile.fake import StepFn
from lightning_elixir.profile.preserved import preserved_rng
from lightning_elixir.profile.types import HardwareProfile, ModelProfile
from lightning_elixir.runtime import collectives, emulated
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.optim import StateFootprint, state_footprint
from lightning_elixir.runtime.policy import own_dtype_params
from lightning_elixir.recompute import recompute_candidates, recomputing, skipped_calls
from lightning_elixir.search import SearchOptions, SearchReport, parse_memory_limit
from lightning_elixir.search.errors import NoPlanFitsError
from lightning_elixir.search.report import format_bytes, format_ms, format_names
from lightning_elixir.search.variants import Searched, Variant, fastest, least_needing, search_each, variant_for
from lightning_elixir.stage import stage_batch, stage_of

log = logging.getLogger(__name__)

MemoryLimit = Union[int, float, str, None]

FALLBACK_PLAN = ElixirPlan(cache_blocks=CACHE_ALL, name="auto-fallback")
"""The plan used when the step cannot be traced: the runtime's default packing in
``named_parameters()`` order, every chunk kept gathered within a step (ZeRO-2). It needs no model
profile; it needs the most parameter memory of the sharded plans, so a model that does not fit it
needs ``plan="zero3"`` or an explicit plan."""


@dataclass(frozen=True)
class OffloadSettings:
    """Where plan="auto" may place sharded state besides the device."""

    allow_cpu: bool = True
    """Host memory (pinned on GPU machines)."""
    nvme_path: Optional[str] = None
    """A directory on an NVMe drive; None: no NVMe placement."""
    host_memory_limit: MemoryLimit = None
    """Host memory offloaded state may use: bytes, "64GiB" or a fraction of the host's memory
    (shared by the ranks of a machine). Default: 80% of what is available when planning."""
    updates_in_backward: bool = False
    """Whether the runtime will start offloaded updates in backward (``SearchOptions.updates_in_backward``)."""


@dataclass(frozen=True)
class PlanningResult:
    """What planning produced, kept on the strategy for logging and inspection."""

    plan: ElixirPlan
    """The plan every rank runs (rank 0's)."""
    report: Optional[SearchReport]
    """Rank 0's search report: top candidates, cost breakdown, lower bound. None after a fallback."""
    model_profile: Optional[ModelProfile]
    """The profile the search planned from. None after a fallback."""
    hardware_profile: HardwareProfile
    """The measured (or cached, or user-given) machine."""
    budget_bytes: int
    """Device memory per rank the search planned for."""
    fallback_reason: Optional[str] = None
    """Why the step could not be traced (on the first rank that failed) so that every rank runs
    ``FALLBACK_PLAN``; None when planning searched."""
    options: Optional[SearchOptions] = None
    """What the search assumed about the run (world size, micro-batches, dtypes, offload). None after a fallback."""
    seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Wall seconds of each part of planning on this rank: "hardware" (measured, or read from the
    cache or the user's profile), "profile" (the step traced on fake tensors), "search"."""
    notes: tuple[str, ...] = ()
    """What the user should know about the inputs (assumptions, mismatches); the plan CLI prints them."""
    variants: tuple[Variant, ...] = ()
    """The step as traced with each set of blocks recomputing that the search weighed, the running plan's
    (``model_profile``) among them; later searches weigh them again ([Note: recomputation variants])."""

    @property
    def searchable(self) -> tuple[Variant, ...]:
        """What a later search weighs: the traced variants, or the running plan's profile alone."""
        if self.variants or self.model_profile is None:
            return self.variants
        return (Variant(tuple(self.plan.recompute), self.model_profile),)

    def switched_to(self, plan: ElixirPlan, **changes: Any) -> "PlanningResult":
        """This planning with ``plan`` running and ``changes`` (a budget, calibrated variants) applied; its
        ``model_profile`` is the variant traced with ``plan``'s recomputation, unless ``changes`` name one."""
        variant = variant_for(changes.get("variants", self.variants), plan.recompute)
        if variant is not None and "model_profile" not in changes:
            changes["model_profile"] = variant.profile
        return dataclasses.replace(self, plan=plan, **changes)


def device_total_bytes(device: torch.device, local_world_size: int) -> int:
    """Memory of one device, or this process's share of host memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(local_world_size, 1)


def budget_bytes(device: torch.device, limit: MemoryLimit, local_world_size: int) -> int:
    """The device memory budget: the device's memory, or ``device_memory_limit`` of it, and on a GPU no
    more than this process can have of it ([Note: what a process can have of a GPU])."""
    total = device_total_bytes(device, local_world_size)
    budget = total if limit is None else parse_memory_limit(limit, total)
    if device.type != "cuda":
        return budget
    usable = cuda_usable_bytes(device)
    if usable < budget:
        log.info("device memory budget %s lowered to %s: what this process can have of %s now", format_bytes(budget),
                 format_bytes(usable), torch.cuda.get_device_name(device))
    return min(budget, usable)


def cuda_usable_bytes(device: torch.device) -> int:
    """Device memory this process's caching allocator can hold: what it holds now plus what is free,
    at most its per-process fraction of the device.

    [Note: what a process can have of a GPU]
    The device's total memory is not all the allocator's: the CUDA context, NCCL's communicator
    buffers and, where the GPU is shared, other processes hold memory outside it, and a per-process
    memory fraction (``torch.cuda.set_per_process_memory_fraction``) caps what it may reserve. A plan
    searched for the total would run out of memory at its first step (and be recovered, one step
    lost). So on a GPU the budget is at most the memory free now plus what this process's allocator
    already reserved, and at most the fraction; the planner takes the smallest over ranks, since
    every rank runs rank 0's plan. Measured once, at planning, after the hardware profile ran its
    collectives (so NCCL's buffers exist). Memory another process takes later is not foreseen: that
    is what recovery is for ([Note: recovering from out of memory] in recovery.py).
    """
    free, total = torch.cuda.mem_get_info(device)
    usable = free + torch.cuda.memory_reserved(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.9
    if fraction is not None:
        usable = min(usable, int(fraction(device) * total))
    return usable


def host_memory_bytes(limit: MemoryLimit, local_world_size: int) -> int:
    """Host memory one rank may fill with offloaded state: ``host_memory_limit`` of the host's memory,
    or by default 80% of what is available now, shared by the ranks of this machine."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if limit is not None:
        return parse_memory_limit(limit, total, "host_memory_limit") // max(local_world_size, 1)
    return int(0.8 * _available_host_bytes()) // max(local_world_size, 1)


def _available_host_bytes() -> int:
    """Host memory available now: Linux's MemAvailable (free plus reclaimable cache), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def measure_hardware(device: torch.device, group: Group, compute_dtype: torch.dtype,
                     hardware: Optional[Union[HardwareProfile, str]],
                     nvme_path: Optional[str] = None, local_world_size: Optional[int] = None) -> HardwareProfile:
    """The user's HardwareProfile (object or JSON path), or one measured on this process group
    (with the NVMe drive at ``nvme_path``, when given; ``local_world_size`` ranks per machine)."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware is not None:
        return HardwareProfile.from_json(hardware)
    return profile_hardware(
        device, world_size=group.world_size, compute_dtype=compute_dtype, nvme_path=nvme_path,
        nodes=-(-group.world_size // max(local_world_size or group.world_size, 1)),
        all_gather=lambda out, inp: collectives.all_gather(out, inp, group),
        reduce_scatter=lambda out, inp: collectives.reduce_scatter(out, inp, group))


def plan_automatically(module: torch.nn.Module, batch: Any, *, device: torch.device, group: Group,
                       compute_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype], micro_batches: int,
                       memory_limit: MemoryLimit = None, local_world_size: int = 1,
                       hardware: Optional[Union[HardwareProfile, str]] = None, step_fn: Optional[StepFn] = None,
                       backward: bool = True, private_params: Iterable[str] = (),
                       offload: Optional[OffloadSettings] = None,
                       optimizer_states: Optional[StateFootprint] = None) -> PlanningResult:
    """Profile one step of ``module`` on ``batch``, search and agree on a plan. Call on every rank.

    Args:
        module: The model (a LightningModule or plain module); left unchanged.
        batch: One batch as the step takes it.
        device: The device the run uses.
        group: The process group the plan is for (its world size) and agreed on.
        compute_dtype: The dtype the runtime's chunks hold.
        autocast_dtype: The autocast dtype of ``*-mixed`` precision, else None.
        micro_batches: Steps per optimizer step (gradient accumulation).
        memory_limit: The device memory budget: bytes, "40GiB", or a fraction. Default: all of it.
        local_world_size: Processes on this machine (they share host memory on the CPU).
        hardware: A HardwareProfile or its JSON path; default: measured on ``group``.
        step_fn: ``step_fn(module, batch)``; default: ``profile_model``'s.
        backward: False for a forward-only step.
        private_params: Names that get a private chunk besides those the profile finds shared.
        offload: Where sharded state may go besides the device (default: host memory, no NVMe).
        optimizer_states: The optimizer's state and step buffers per trained element
            (``optim.state_footprint``); None: Adam's two moments.

    Returns:
        The plan and how it was found. When the step cannot be traced, ``FALLBACK_PLAN`` with a
        warning (``fallback_reason`` says why); searching itself may raise ``NoPlanFitsError``.
    """
    def trace(**settings: Any) -> ModelProfile:
        return profile_model(module, batch, step_fn, backward=backward, **settings)

    return _plan(trace, "the step", module=module, device=device, group=group, compute_dtype=compute_dtype,
                 autocast_dtype=autocast_dtype, micro_batches=micro_batches, memory_limit=memory_limit,
                 local_world_size=local_world_size, hardware=hardware, private_params=private_params,
                 offload=offload, optimizer_states=optimizer_states)


def plan_for_trainer(module: torch.nn.Module, trainer: Any, *, device: torch.device, group: Group,
                     compute_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype],
                     memory_limit: MemoryLimit = None, local_world_size: int = 1,
                     hardware: Optional[Union[HardwareProfile, str]] = None,
                     private_params: Iterable[str] = (), offload: Optional[OffloadSettings] = None,
                     configured: Optional[tuple[list[Any], list[Any]]] = None) -> PlanningResult:
    """``plan_automatically`` for the stage ``trainer`` runs, on a batch of that stage's data.

    See [Note: planning per stage] in stage.py. Taking the batch is part of the trace: a stage without data
    falls back like a step that cannot be traced. Arguments as for ``plan_automatically``; the
    micro-batches are the trainer's ``accumulate_grad_batches`` when fitting, else 1. ``configured``:
    the optimizers and LR schedulers of the fit, when made before planning ([Note: planning for the
    optimizer] in autoplan.py): their state is priced, and a manually optimizing step is traced with them.
    """
    step = stage_of(trainer)
    optimizer_states = None if configured is None else state_footprint(configured[0])

    def trace(**settings: Any) -> ModelProfile:
        data = stage_batch(trainer, step)
        return profile_model(module, data.batch, data.step_fn, backward=step.backward, configured=configured,
                             **settings)

    micro_batches = trainer.accumulate_grad_batches if step.backward else 1
    return _plan(trace, step.hook, module=module, device=device, group=group, compute_dtype=compute_dtype,
                 autocast_dtype=autocast_dtype, micro_batches=micro_batches, memory_limit=memory_limit,
                 local_world_size=local_world_size, hardware=hardware, private_params=private_params,
                 offload=offload, optimizer_states=optimizer_states)


def value_dependent_params(module: torch.nn.Module, trainer: Any, *, device: torch.device, group: Group,
                           compute_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype]) -> tuple[str, ...]:
    """The parameters of the modules whose calls in the stage's step depend on tensor values (a
    mixture of experts skipping experts no token chose: [Note: value-dependent module calls] in
    profile/model.py), rank 0's answer on every rank. For a plan given by the user, which the profile
    does not otherwise see; none when the step cannot be traced (as before: the plan runs as given)."""
    step = stage_of(trainer)
    names: tuple[str, ...] = ()
    with preserved_rng(cuda=device.type == "cuda"):
        try:
            data = stage_batch(trainer, step)
            profile = profile_model(module, data.batch, data.step_fn, backward=step.backward,
                                    compute_dtype=autocast_dtype or compute_dtype, device=device,
                                    param_dtype=compute_dtype)
            names = tuple(profile.conditional_params)
        except Exception as err:  # noqa: BLE001 (the real run shows real errors)
            log.debug("could not trace %s to find value-dependent module calls", step.hook, exc_info=err)
    if group.world_size > 1:
        box = [names]
        dist.broadcast_object_list(box, src=0, group=group.pg)
        names = tuple(box[0])
    return names


def _plan(trace: Callable[..., ModelProfile], what: str, *, module: torch.nn.Module, device: torch.device,
          group: Group,
          compute_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype], micro_batches: int,
          memory_limit: MemoryLimit, local_world_size: int,
          hardware: Optional[Union[HardwareProfile, str]], private_params: Iterable[str] = (),
          offload: Optional[OffloadSettings] = None, optimizer_states: Optional[StateFootprint] = None
          ) -> PlanningResult:
    """Measure, trace (or fall back), search, agree; with the random generators put back after."""
    offload = offload or OffloadSettings()
    private_params = (*private_params, *own_dtype_params(module, (compute_dtype,)))  # chunks of their own dtype
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    with preserved_rng(cuda=device.type == "cuda"):
        # collective: before anything may fail
        hw = measure_hardware(device, group, compute_dtype, hardware, offload.nvme_path, local_world_size)
        budget = _least(budget_bytes(device, memory_limit, local_world_size), device, group)
        seconds["hardware"], clock = time.perf_counter() - clock, time.perf_counter()
        try:
            profile = trace(compute_dtype=autocast_dtype or compute_dtype, hardware=hw, device=device,
                            param_dtype=compute_dtype)
            reason = None
        except Exception as err:  # noqa: BLE001 (any failure on fake tensors: the real run will show real ones)
            log.debug("plan='auto' could not trace %s", what, exc_info=err)
            profile, reason = None, f"{type(err).__name__}: {err}"
        seconds["profile"], clock = time.perf_counter() - clock, time.perf_counter()
        reason = _first_failure(reason, group)  # every rank falls back, or none: they must run one plan
        if reason is not None:
            _warn_fallback(what, reason)
            return PlanningResult(FALLBACK_PLAN, None, None, hw, budget, reason, seconds=seconds)
        profile = with_private_params(profile, private_params)
        options = _options(group.world_size, micro_batches, compute_dtype, autocast_dtype, offload, local_world_size,
                           optimizer_states)
        if options.host_memory_bytes is not None:  # every rank runs rank 0's plan: it must fit the tightest machine
            options = dataclasses.replace(options, host_memory_bytes=_least(options.host_memory_bytes, device, group))

        def traced(names: tuple[str, ...]) -> ModelProfile:
            with recomputing(module, names):  # the same module calls: the same value-dependent ones
                return with_private_params(trace(compute_dtype=autocast_dtype or compute_dtype, hardware=hw,
                                                 device=device, param_dtype=compute_dtype,
                                                 conditional_params=profile.conditional_params), private_params)

        best, variants, notes = search_with_recomputation(module, profile, traced, hw, budget, options)
        seconds["search"] = time.perf_counter() - clock
        plan = _agree(best.plan, group)
        # every rank runs rank 0's plan, and describes it with the profile of its recomputation
        ran = variant_for(variants, plan.recompute) or best.variant
        return PlanningResult(plan, best.report, ran.profile, hw, budget, options=options, seconds=seconds,
                              notes=notes, variants=variants)


NEAR_BUDGET = 0.9
"""A plan predicted above this fraction of its budget is near enough to run out (the first GPU runs
measured the prediction 17% low before the margin planning keeps): planning traces the recomputation
variants for it too, so that a recovery can recompute rather than offload ([Note: recomputation variants])."""


def search_with_recomputation(module: torch.nn.Module, profile: ModelProfile, traced: Callable[[tuple[str, ...]], ModelProfile],
                              hw: HardwareProfile, budget: int, options: SearchOptions
                              ) -> tuple[Searched, tuple[Variant, ...], tuple[str, ...]]:
    """The search's best plan, weighing recomputation against offloading ([Note: searched recomputation]),
    with every variant traced ([Note: recomputation variants]) and the notes for the user.

    Without memory pressure (the plan without recomputation keeps all state on the device, predicted
    below ``NEAR_BUDGET`` of the budget) that plan is taken as it is. Otherwise every other block, then
    every block, recomputing are traced and searched too, and the fastest predicted plan that fits wins
    (a plan that fits without offloading is kept, and the variants are there for a recovery). When no
    variant fits, raises the ``NoPlanFitsError`` of the variant whose most frugal plan needs the least
    memory."""
    variants = [Variant((), profile)]
    found, failures = search_each(variants, hw, budget, options)
    pressed = not found or found[0].plan.offloads
    if not pressed and found[0].report.winner.peak_bytes <= NEAR_BUDGET * budget:
        return found[0], tuple(variants), ()
    blocks = () if profile.recomputes else recompute_candidates(module)  # the model's own checkpointing stays
    skipped: dict[str, tuple[str, ...]] = {}
    for names in dict.fromkeys(n for n in (blocks[1::2], blocks) if n):  # one block: the same variant twice
        try:
            with skipped_calls() as skips:
                variant = Variant(names, traced(names))
            skipped.update(skips)
        except Exception as err:  # noqa: BLE001 (a variant that cannot be traced is not chosen)
            log.debug("could not trace the step with %d blocks recomputing", len(names), exc_info=err)
            continue
        variants.append(variant)
    more, failed = search_each(variants[1:], hw, budget, options)
    found, failures = found + more, failures + failed
    kept = _kept_activations(skipped, len(blocks)) if pressed else ""  # unasked advice where nothing is short
    if not found:
        least = least_needing(failures)
        if not kept:
            raise least
        raise NoPlanFitsError(f"{least} Also: {kept}.", least.min_device_bytes, least.budget_bytes,
                              (*least.levers, kept))
    best = fastest(found, failures) if pressed else found[0]
    names = best.variant.recompute
    if not names:
        return best, tuple(variants), (kept,) if kept else ()
    without = next((f for f in found if not f.variant.recompute), None)
    instead = (f"without it the best plan is predicted at {format_ms(without.report.winner.step_s)} "
               f"({without.report.placement_summary()})" if without else "without it no plan fits the budget")
    note = (f"recomputing {len(names)} of {len(blocks)} blocks ({format_names(names)}):"
            f" predicted {format_ms(best.report.winner.step_s)}; {instead}")
    return best, tuple(variants), (note,) + ((kept,) if kept else ())


def _kept_activations(skipped: Mapping[str, tuple[str, ...]], candidates: int) -> str:
    """Why blocks the search would recompute keep their activations, and what to change; "" when none do.

    A block called with an object among its arguments (Hugging Face models pass their key-value
    cache to every layer, also in training, unless ``use_cache=False``) runs without recomputation
    ([Note: searched recomputation] in recompute.py), so its variant saves nothing: without being
    told, a user would see no plan recompute and not know why."""
    if not skipped:
        return ""
    names = list(skipped)
    kinds = ", ".join(dict.fromkeys(kind for found in skipped.values() for kind in found))
    return (f"recomputing: {len(names)} of {candidates} "
            f"blocks ({format_names(names)}) cannot be recomputed and keep "
            f"their activations, as they are called with {kinds} among their arguments, which the call may change; "
            "call the model without it in training (Hugging Face models: use_cache=False) so that plan='auto' can "
            "recompute them")


def with_private_params(profile: ModelProfile, private_params: Iterable[str]) -> ModelProfile:
    """The profile with the user's private parameters listed as shared: the search gives them private chunks."""
    return profile.with_private(private_params)


def _first_failure(reason: Optional[str], group: Group) -> Optional[str]:
    """The first rank's reason for not tracing, on every rank; None when every rank traced."""
    if group.world_size == 1:
        return reason
    reasons: list[Optional[str]] = [None] * group.world_size
    dist.all_gather_object(reasons, reason, group=group.pg)
    return next((f"rank {rank}: {r}" for rank, r in enumerate(reasons) if r is not None), None)


def _warn_fallback(what: str, reason: str) -> None:
    """Warn once (rank 0) that the step could not be traced and which plan runs instead."""
    rank_zero_warn(
        f"plan='auto' could not profile {what} on fake tensors ({reason}). Running the fallback plan instead: "
        f"default chunks, every chunk gathered for the whole step (cache_blocks='all', like plan='zero2'), no "
        f"search. If memory is tight pass plan='zero3'; to plan this model, pass an ElixirPlan or profile it "
        f"yourself with lightning_elixir.profile.profile_model(module, batch, step_fn=...)."
    )


def _options(world_size: int, micro_batches: int, compute_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype],
             offload: OffloadSettings, local_world_size: int, optimizer_states: Optional[StateFootprint]
             ) -> SearchOptions:
    """Search options for this precision and offload settings, with this machine's host memory.

    Under an emulated device budget ([Note: emulated device memory]) the device has no allocator,
    kernel workspaces or communicator buffers, which the search's margin is for: it has none."""
    options = search_options(world_size, micro_batches, compute_dtype, autocast_dtype, allow_cpu=offload.allow_cpu,
                             nvme_available=offload.nvme_path is not None,
                             host_memory_bytes=host_memory_bytes(offload.host_memory_limit, local_world_size),
                             updates_in_backward=offload.updates_in_backward, optimizer_states=optimizer_states)
    if emulated.active() is not None:
        options = dataclasses.replace(options, margin_fraction=0.0, margin_bytes=0)
    return options


def search_options(world_size: int, micro_batches: int, compute_dtype: torch.dtype,
                   autocast_dtype: Optional[torch.dtype], *, allow_cpu: bool = True, nvme_available: bool = False,
                   host_memory_bytes: Optional[int] = None, updates_in_backward: bool = False,
                   optimizer_states: Optional[StateFootprint] = None) -> SearchOptions:
    """Search options that describe what the runtime will do with this precision and offload settings.

    Pure: the host memory is an argument, so a plan can be searched for another machine.
    ``optimizer_states``: the optimizer's state and step buffers per trained element
    (``optim.state_footprint``); None: Adam's two moments.
    """
    true_precision = autocast_dtype is None and compute_dtype != torch.float32  # bf16-true, 16-true, 64-true
    size = compute_dtype.itemsize if true_precision else 4  # of gradients, masters and optimizer states
    states = StateFootprint(2.0) if optimizer_states is None else optimizer_states
    return SearchOptions(
        world_size=world_size, micro_batches=micro_batches,
        master_bytes_per_numel=0 if true_precision else None,  # bf16-true: the master is the shard
        grad_bytes_per_numel=size,
        optimizer_bytes_per_numel=math.ceil(states.sharded * size),
        whole_state_bytes_per_numel=round(states.whole * size),  # the probe's rows and columns: ~0 on a real matrix
        step_gather_bytes_per_numel=math.ceil(states.gathered * size),
        reduce_in_fp32=not true_precision,
        allow_cpu=allow_cpu, nvme_available=nvme_available, host_memory_bytes=host_memory_bytes,
        updates_in_backward=updates_in_backward)


def _least(budget: int, device: torch.device, group: Group) -> int:
    """The smallest ``budget`` over ranks: what each process can have differs on a GPU, and between machines
    everywhere (the ranks of another node see its own host memory, and what is available now differs)."""
    if group.world_size == 1:
        return budget
    values = torch.tensor([-float(budget)], dtype=torch.float64, device=device)
    return int(-collectives.all_reduce_max(values, group).item())


def _agree(plan: ElixirPlan, group: Group) -> ElixirPlan:
    """Rank 0's plan, on every rank."""
    if group.world_size == 1:
        return plan
    box = [plan.to_json()]
    dist.broadcast_object_list(box, src=0, group=group.pg)
    return ElixirPlan.from_json(box[0])
