"""ElixirStrategy: the Lightning glue. Everything with substance lives in runtime/, search/, profile/."""

from __future__ import annotations

import atexit
import dataclasses
import contextlib
import itertools
import logging
import os
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities import imports as fabric_imports
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer, _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_elixir.after_step import AfterStepRegion
from lightning_elixir.averaging import install_averages, remove_averages
from lightning_elixir.checkpointing import (CheckpointSaver, load_model, load_optimizers, optimizer_state_after_fit,
                                            save_full_checkpoint, save_sharded_checkpoint,
                                            sharded_checkpoint_for_hooks)
from lightning_elixir.devices import release_pinned_cache
from lightning_elixir.inputs import (apply_layer_sync, check_flags, check_replan, check_start_method,
                                     check_state_dict_type, check_updates_in_backward, collective_timeout,
                                     planning_limit, read_hardware_profile, refuse_graph_logging,
                                     refuse_unsupported_callbacks)
from lightning_elixir.finetuning import install_finetuning, planned_trainable, remove_finetuning
from lightning_elixir.launcher import ElixirMultiprocessingLauncher
from lightning_elixir.monitor import ElixirMonitor
from lightning_elixir.plan import CACHE_ALL, ElixirPlan, PlanInput, check_private_params, resolve_plan
from lightning_elixir.planner import PlanningResult, value_dependent_params
from lightning_elixir.precision import ElixirPrecision, from_lightning_plugin
from lightning_elixir.autoplan import AutoPlanner
from lightning_elixir.rank_hooks import install_rank_hooks, remove_rank_hooks
from lightning_elixir.recompute import Recomputation
from lightning_elixir.recovery import OutOfMemoryRecovery, new_group
from lightning_elixir.profile.types import HardwareProfile
from lightning_elixir.runtime import state_dict as sd
from lightning_elixir.runtime.collectives import Group, agreed_max
from lightning_elixir.runtime.deferred import InitRecord, record_init
from lightning_elixir.runtime.layout import check_initialized
from lightning_elixir.runtime.nvme_runs import check_nvme_path
from lightning_elixir.runtime.optim import shard_optimizer
from lightning_elixir.runtime.replan import switch_plan
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.search.calibrate import SelfCorrection
from lightning_elixir.search.report import SearchReport, format_names
from lightning_elixir.steps import TrainingSteps
from lightning_elixir.toggling import install_toggling, remove_toggling
from lightning_elixir.uneven import UnevenSteps

log = logging.getLogger(__name__)

def describe_runtime(runtime: ElixirRuntime) -> str:
    """The running plan in the search report's words (``chunk=... blocks=... prefetch=... offload=...``),
    from the chunks the runtime built (a preset's default chunk size included)."""
    chunks, public = runtime.chunks, runtime.public
    blocks = "all" if runtime.resident or runtime.cache.capacity >= len(public) else str(runtime.cache.capacity)
    if runtime.resident and runtime.group.world_size == 1 and runtime.plan.cache_blocks != CACHE_ALL:
        blocks += f" (asked {runtime.plan.cache_blocks}; one rank: each shard is its chunk)"
    cpu = sum(c.placement == "cpu" for c in chunks)
    nvme = sum(c.placement == "nvme" for c in chunks)
    recompute = f" recompute={len(runtime.plan.recompute)} blocks" if runtime.plan.recompute else ""
    return (f"chunk={max((c.numel for c in chunks), default=0):,} blocks={blocks} "
            f"prefetch={runtime.plan.prefetch_depth} offload={cpu}cpu+{nvme}nvme/{len(chunks)}{recompute}")


def _holds_meta(module: Any) -> bool:
    """Whether ``module`` still has meta tensors (setup failed before materialising them): moving it would
    raise over the error that stopped the run."""
    return module is not None and any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


class ElixirStrategy(ParallelStrategy):
    """Chunk-based ZeRO sharding with a cache of gathered chunks, planned from a profile (Elixir).

    Args:
        plan: "auto" (profile and search before fit), "zero2", "zero3", an ElixirPlan, a dict, or
            a path to a plan JSON file.
        private_params: parameter names that get their own always-gathered chunk, besides the
            tied ones found automatically (parameters used outside the module that holds them).
        device_memory_limit: the memory budget per device for plan="auto": bytes, a string such as
            "40GiB", or a fraction of the device's memory. Default: all of it. On a GPU never more
            than the process can have when planning (free memory plus what its allocator holds,
            within its per-process memory fraction; the least over ranks).
        hardware_profile: a HardwareProfile (or a path to its JSON) to plan with instead of
            measuring this machine, e.g. to plan for a GPU cluster from a laptop.
        nvme_path: a directory on an NVMe drive. plan="auto" may then place chunks' sharded state
            (master and optimizer states) there, and plans with "nvme" chunks need it. Checked at
            construction; each rank's files live in a directory of their own under it and are
            removed at teardown (and by the next run, after a crash).
        host_memory_limit: host memory plan="auto" may fill with offloaded state, per machine:
            bytes, "64GiB" or a fraction of the host's memory. Default: 80% of what is available.
        state_dict_type: "full": one checkpoint file with plain parameter names and a plain torch
            optimizer state dict (loads into a plain module). Rank 0 writes each chunk as it is
            gathered, so no rank holds more than one gathered chunk; in ``on_save_checkpoint`` the
            gathered tensors are ``DeferredTensor`` placeholders (a custom checkpoint_io plugin or
            AsyncCheckpointIO gets them filled in, all held by rank 0).
            "sharded": a directory in torch.distributed.checkpoint format, every rank writing its own
            shards in parallel; it resumes at any world size, chunk size, cache and placement, and
            ``lightning-elixir convert`` turns it into a full file. Either format loads either way.
        collective_timeout_s: longest wait, in seconds, for one of Elixir's collectives before every
            rank raises ``RankDivergenceError`` (ranks that issued different collectives, e.g. a branch
            on each rank's data that runs a module on one rank only). Default: 600 s, or ``timeout``
            when it is set. Raise it if a rank can legitimately be late by more (rank-only work in a
            callback). On NCCL the process group's ``timeout`` applies instead.
        replan: with plan="auto", compare the first steps with the prediction and, when they differ,
            calibrate the cost model from them and search again; switch to a plan predicted clearly
            faster, in place, once per run ([Note: self-correction] in search/calibrate.py). True: with
            the defaults of ``SelfCorrection`` (4 calibration steps, 15% threshold, 10% margin); a
            ``SelfCorrection`` to choose them; False: run the first plan throughout. A plan given by
            the user is never changed.
        oom_recovery: with plan="auto", an out-of-memory error in a training step's forward or backward
            makes every rank give up the step, switch to a plan searched for the budget lowered by the
            measured overshoot, and redo the same micro-batch, losing and repeating nothing (at most 3
            times in a row; [Note: recovering from out of memory] in recovery.py). False: the error
            propagates unchanged. With several ranks the runtime then issues its collectives on a
            process group of its own, so that one abandoned step leaves Lightning's group clean.
        updates_in_backward: start an offloaded chunk's optimizer update as soon as its gradient is
            final, overlapping the rest of backward, when nothing between backward and the step can
            change the update: automatic optimization at the end of accumulation, no gradient clipping,
            no fp16 loss scaling, no graph from ``torch.autograd.grad(create_graph=True)`` in the step,
            no ``backward``/``on_after_backward``/``on_before_optimizer_step``/
            ``configure_gradient_clipping``/``optimizer_step`` override (otherwise the update starts at
            the step; [Note: updates started in backward] in runtime/offload.py). Results are the same
            either way. None (default): on an accelerator only; on a CPU-only machine the host is the
            device, and an update started in backward competes with it for the same cores. False:
            always at the step.
        start_method: "popen" (re-run the script per rank; also torchrun/SLURM), "fork" (the one that works in
            a Jupyter notebook, as Lightning's "ddp_notebook"; nothing may initialise CUDA before fit), "spawn"
            or "forkserver" (the module and everything fit is given are pickled to every rank).
        process_group_backend: defaults to NCCL on GPUs and gloo on the CPU.
        timeout: process group timeout.
        broadcast_buffers: as DDP's option of that name (on by default): every rank gets rank 0's
            buffers (BatchNorm running statistics) before a forward that follows a training one.
        unshard_on_teardown: at the end of fit/validate/test/predict, give the module plain
            parameters with the trained values on every rank (gathered one chunk at a time) and
            remove the hooks, so the module behaves as after DDP. Set False for a model too large
            for one rank: the module then keeps its shards and reads outside the strategy raise.

    Reading parameters outside the training step (callbacks, code after a step) goes through
    ``gathered_params()``; inside the step, in ``on_after_backward`` and in
    ``on_before_optimizer_step`` every read is served as is.
    """

    strategy_name = "elixir"

    def __init__(self, plan: PlanInput = "auto", private_params: tuple[str, ...] = (),
                 device_memory_limit: Union[int, float, str, None] = None,
                 hardware_profile: Union[HardwareProfile, str, None] = None,
                 nvme_path: Union[str, os.PathLike, None] = None,
                 host_memory_limit: Union[int, float, str, None] = None,
                 state_dict_type: str = "full", collective_timeout_s: Optional[float] = None,
                 replan: Union[bool, SelfCorrection] = True, oom_recovery: bool = True,
                 updates_in_backward: Optional[bool] = None, accelerator: Any = None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen",
                 broadcast_buffers: bool = True, unshard_on_teardown: bool = True) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        # Every input that can be checked without the model, the devices or the process group is
        # checked here, so that a mistake fails at construction rather than after launch and profiling.
        self._start_method = check_start_method(start_method)
        self.plan = resolve_plan(plan)
        self.private_params = check_private_params(private_params, self.plan)
        # What the planning inputs would be ignored by: None for plan="auto".
        fixed = None if isinstance(self.plan, str) else f"plan={plan!r}" if isinstance(plan, str) else "a fixed plan"
        self.device_memory_limit = planning_limit("device_memory_limit", device_memory_limit, fixed)
        self.hardware_profile = read_hardware_profile(hardware_profile, fixed)
        self.nvme_path = None if nvme_path is None else str(check_nvme_path(nvme_path))
        if self.nvme_path is not None and fixed and not any(c.placement == "nvme" for c in self.plan.chunks):
            rank_zero_warn(f"nvme_path={nvme_path!r} is not used: {fixed} places no chunk on NVMe (plan='auto' may "
                           "place some there)")
        self.host_memory_limit = planning_limit("host_memory_limit", host_memory_limit, fixed)
        self.state_dict_type = check_state_dict_type(state_dict_type)
        self._group_timeout_s = collective_timeout(process_group_backend, timeout, collective_timeout_s)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        check_flags(broadcast_buffers=broadcast_buffers, unshard_on_teardown=unshard_on_teardown,
                    oom_recovery=oom_recovery)
        self.broadcast_buffers = broadcast_buffers
        self.unshard_on_teardown = unshard_on_teardown
        self.updates_in_backward = check_updates_in_backward(updates_in_backward)
        self.replan = check_replan(replan)
        correction = SelfCorrection() if replan is True else replan or None
        self.planner: Optional[AutoPlanner] = AutoPlanner(
            correction, OutOfMemoryRecovery() if oom_recovery else None) if self.plan == "auto" else None
        """plan="auto": planning, self-correction and out-of-memory recovery ([Note: one owner of the plan])."""
        self._failed = False
        self._synced_by: Optional[Any] = None
        """The layer-sync plugin the running module's layers were converted by (its fit's), if any."""
        self._conditional: tuple[str, ...] = ()
        """Parameters of modules that run on some ranks only, found for a plan given by the user."""
        self._averaging: list[Any] = []
        """Weight-averaging callbacks given sharded averages for this fit (averaging.py)."""
        self._deferred: list[InitRecord] = []
        """Recordings of the builds under this strategy's init contexts, until setup replays them."""
        self._configured: Optional[tuple[list[Optimizer], list[Any]]] = None
        """plan="auto" when fitting: what ``configure_optimizers`` returned before planning (the optimizers and
        LR scheduler configs), whose state the plan is priced for; ``setup_optimizers`` takes it."""
        self._runtime_group: Optional[Group] = None
        self._steps = TrainingSteps(self)
        """The training step, backward and optimizer step, with what Elixir adds around them (steps.py)."""
        self._recomputation: Optional[Recomputation] = None
        self._uneven = UnevenSteps(self)
        """Evaluation and predict steps evened out over the ranks (uneven.py)."""
        self.num_nodes = 1
        self.runtime: Optional[ElixirRuntime] = None
        self._finished: Optional[ElixirRuntime] = None
        """After a fit gave the module back: its runtime, whose shards hold the optimizers' state until the
        next stage (``trainer.save_checkpoint`` after fit gathers it, as DDP would save it)."""
        self._saver = CheckpointSaver()  # saves through the Trainer's checkpoint_io, atomically
        self._after_step = AfterStepRegion()  # [Note: code after the step in optimizer_step]

    # ---- precision --------------------------------------------------------------------------

    @property
    @override
    def precision_plugin(self) -> ElixirPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ElixirPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = from_lightning_plugin(precision_plugin) if precision_plugin is not None else None

    # ---- environment ----------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning reads this to shard data with a DistributedSampler."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method != "popen":
            self._launcher = ElixirMultiprocessingLauncher(self, self._start_method)
        else:  # also where the ranks are started for us (torchrun, SLURM, the script's own copies): as DDP, its
            # launch gives each rank its share of the cores (OMP_NUM_THREADS), where a rank would otherwise
            # run as many threads as the machine has cores, beside the other ranks doing the same
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        if fabric_imports._IS_INTERACTIVE and self._launcher is not None and not self._launcher.is_interactive_compatible:
            # before Lightning's own refusal, which names only "ddp_notebook"
            raise ValueError(f"start_method={self._start_method!r} cannot start ranks from an interactive session (a "
                             "Jupyter notebook): use Trainer(strategy='elixir_notebook'), or "
                             "ElixirStrategy(start_method='fork', ...) with your options (their ranks fork; nothing "
                             "may use CUDA before fit), or run the code as a script")

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        if backend == "nccl":
            # [Note: no recordStream for the runtime's collectives]
            # An asynchronous NCCL collective marks its tensors with recordStream by default, and the
            # caching allocator then reuses a freed gradient buffer only once it has seen the NCCL
            # stream's event, at some later allocation: buffers of the reductions in flight outlive
            # their use, memory the plan does not count. The runtime waits for every collective it
            # issues and keeps its tensors until then, which is what this setting needs: the group holds
            # the references until the wait instead (read when a group is made; the user's own setting wins).
            os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
        if not _distributed_is_initialized():
            # NCCL: bound to this rank's device (as Lightning's DDP does), so that no communicator or
            # CUDA context is made on a device guessed from the rank (devices=[2, 3], several nodes)
            bound = {"device_id": self.root_device} if backend == "nccl" and self.root_device.type == "cuda" else {}
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, **bound)
            # Lightning destroys only an NCCL group at exit. A gloo group left to the interpreter's
            # finalization can abort the process (its worker threads still hold tensors), so a run
            # that ended well would exit with SIGABRT now and then: destroy every group we made.
            atexit.register(_destroy_dist_connection)
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        if trainer is not None:
            self.monitor(trainer)  # added before the callbacks' hooks run, so it sees the whole stage

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ---- model --------------------------------------------------------------------------------

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        with (self._deferred_build() if empty_init else nullcontext()), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # configure_model() builds without memory; setup materialises chunk by chunk.
        with self._deferred_build():
            yield

    @contextmanager
    def _deferred_build(self) -> Generator[None, None, None]:
        """Meta tensors whose real values setup replays ([Note: deferred initialisation] in runtime/deferred.py)."""
        try:
            device = self.root_device
        except Exception:  # before the accelerator is known (Trainer.init_module before fit)
            device = torch.device("cpu")
        with record_init(device) as record:
            self._deferred.append(record)
            yield

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        check_initialized(self.model)  # before planning, which reads the shapes too
        self._steps.new_stage()
        refuse_graph_logging(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_unsupported_callbacks(trainer)
            self._unchunk_for_layer_sync()
        if trainer.state.fn == TrainerFn.FITTING:
            self._saver.prepare_dirs(self, trainer)
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type
        self._configured = None
        if self.runtime is None or self.runtime.module is not self.model:  # a new model (e.g. test after fit)
            self._finished = None
            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
                # Trainer(sync_batchnorm=True), as DDP applies it: before chunking, so that the runtime's hooks
                # and the optimizers' parameters are those of the converted layers (the parameters keep their
                # identity); reverted at teardown once the module is plain again.
                self.model = apply_layer_sync(self._layer_sync, self.model, self.root_device)
            self._synced_by = self._layer_sync if trainer.state.fn == TrainerFn.FITTING else None
            self.model = self.precision_plugin.convert_module(self.model)
            if trainer.state.fn == TrainerFn.FITTING and self.planner is not None and not _holds_meta(self.model):
                # [Note: planning for the optimizer]: the parameters keep their identity when chunked
                self._configured = _init_optimizers_and_lr_schedulers(self.lightning_module)
            with planned_trainable(self.model, trainer):  # [Note: finetuning callbacks]
                self.runtime = self._build_runtime(trainer)
            self.precision_plugin.runtime = self.runtime
        else:  # the last stage's runtime (its recomputation was taken off if that stage failed)
            self._recompute(self.runtime.plan)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            install_toggling(self.lightning_module)  # [Note: toggling optimizers]
            install_finetuning(self, trainer)  # [Note: finetuning callbacks]
            self._after_step.install(self.lightning_module)
            self._averaging = install_averages(self, trainer)  # [Note: sharded weight averaging]
        install_rank_hooks(self, trainer)  # [Note: hooks every rank runs]
        self.setup_precision_plugin()

    def _unchunk_for_layer_sync(self) -> None:
        """A fit with a layer-sync plugin, on the module an evaluation stage of this Trainer left chunked
        (``unshard_on_teardown=False``) without converting its layers (DDP converts them for fit only): the
        module is given back plain, to be converted and chunked anew like a new one."""
        kept = self.runtime is not None and self.runtime.module is self.model
        if kept and self._layer_sync is not None and self._synced_by is None:
            self.runtime.restore_module()
            self.runtime = self.precision_plugin.runtime = None

    def _build_runtime(self, trainer: Any) -> ElixirRuntime:
        plan = self._plan_for(trainer)
        self._recompute(plan)
        deferred, self._deferred = self._deferred, []  # replayed into this model's chunks, then not needed
        runtime = ElixirRuntime(self.model, plan, device=self.root_device, policy=self.precision_plugin.policy,
                                group=self._group(), private_params=self.private_params + self._conditional,
                                grow_cache=self.planning is not None, broadcast_buffers=self.broadcast_buffers,
                                nvme_path=self.nvme_path, deferred=deferred)
        if self.planning is None or self.planning.report is None:  # a searched plan was described by the search
            rank_zero_info(f"Elixir: running plan {plan.name!r}: {describe_runtime(runtime)}")
        return runtime

    @property
    def planning(self) -> Optional[PlanningResult]:
        """plan="auto": the search's view of the running plan (its profiles, budget and report); else None."""
        return self.planner.planning if self.planner is not None else None

    @property
    def recovery(self) -> Optional[OutOfMemoryRecovery]:
        """Out-of-memory recovery ([Note: recovering from out of memory]): plan="auto" with ``oom_recovery``."""
        return self.planner.recovery if self.planner is not None else None

    @property
    def may_replan(self) -> bool:
        """Whether the running plan may still be replaced after the first steps: plan="auto" with ``replan``."""
        return self.planner is not None and self.planner.may_replan

    def switch_plan(self, plan: ElixirPlan, grads: bool = False, budget_bytes: Optional[int] = None,
                    report: Optional[SearchReport] = None) -> None:
        """Re-chunk the running model under ``plan``, keeping its values and optimizer state (every rank,
        between optimizer steps, or between micro-batches with ``grads``, which carries the gradients
        accumulated so far; [Note: switching plans] in runtime/replan.py). ``budget_bytes``: the budget
        ``plan`` was searched for, when it is not the first search's (a recovery lowered it); ``report``: the
        search that found it, which the planning then shows instead of the first search's."""
        assert self.runtime is not None
        self.runtime.read_agreement()  # the last step's, before its runtime goes (dropped if its group was given up)
        self._recompute(plan)
        accumulating = self.runtime.protocol.accumulating  # a switch between micro-batches: still inside no_sync
        self.runtime = switch_plan(self.runtime, plan, grads=grads, grow_cache=True)
        self.runtime.protocol.accumulating = accumulating
        self.precision_plugin.runtime = self.runtime
        release_pinned_cache(self.root_device)  # the old plan's slabs ([Note: pinned memory in slabs])
        self._runtime_group = self.runtime.group if self._runtime_group is not None else None
        if self.planner is not None:
            self.planner.switched(plan, budget_bytes, **({"report": report} if report is not None else {}))

    def _recompute(self, plan: ElixirPlan) -> None:
        """Checkpoint the blocks ``plan`` recomputes, and only those ([Note: searched recomputation])."""
        current = self._recomputation.names if self._recomputation is not None else ()
        if tuple(plan.recompute) == current:
            return
        if self._recomputation is not None:
            self._recomputation.remove()
        self._recomputation = Recomputation(self.model, plan.recompute) if plan.recompute else None

    def planning_for_recovery(self) -> Optional[PlanningResult]:
        """The searched planning a recovery may search again from: plan="auto" that traced the step."""
        return self.planning if self.planner is not None and self.planner.searched else None

    def describe_running(self) -> str:
        """The running plan in the search report's words."""
        return describe_runtime(self.runtime) if self.runtime is not None else "no plan"

    def _plan_for(self, trainer: Any) -> ElixirPlan:
        if isinstance(self.plan, ElixirPlan):
            return self._with_conditional_private(self.plan, trainer)
        # plans for the stage being run (fit, validate, test, predict), from that stage's own data
        assert self.planner is not None
        self.monitor(trainer)  # so that the plan is logged and the steps measured
        return self.planner.plan(trainer, self).plan

    def _with_conditional_private(self, plan: ElixirPlan, trainer: Any) -> ElixirPlan:
        """A plan given by the user, with the parameters of modules that run on some ranks only in private
        chunks, as plan="auto" gives them ([Note: value-dependent module calls] in profile/model.py).

        A plan that gathers chunks per hook unit would otherwise issue a gather on the ranks whose data
        called such a module and none on the others. Found by tracing the stage's step on fake tensors,
        only for plans that gather per unit on several ranks; an explicit layout gets the chunks that
        hold them marked private."""
        self._conditional = ()
        if plan.cache_blocks == CACHE_ALL or self._group().world_size == 1:
            return plan
        precision = self.precision_plugin
        names = value_dependent_params(self.model, trainer, device=self.root_device, group=self._group(),
                                       compute_dtype=precision.compute_dtype, autocast_dtype=precision.autocast_dtype)
        names = tuple(n for n in names if n not in self.private_params)
        if not names:
            return plan
        self._conditional = names
        modules = sorted({n.rpartition(".")[0] for n in names})
        rank_zero_info(f"Elixir: {len(modules)} module(s) run on some ranks only ({format_names(modules, 4)}"
                       "): their parameters get private chunks")
        if not plan.chunks:
            return plan
        chosen = set(names)
        chunks = tuple(dataclasses.replace(c, private=True) if not c.private and chosen & set(c.params) else c
                       for c in plan.chunks)
        return dataclasses.replace(plan, chunks=chunks)

    def monitor(self, trainer: Any) -> ElixirMonitor:
        """The trainer's ElixirMonitor: the user's, or one added now ([Note: the planning callback])."""
        found = [cb for cb in trainer.callbacks if isinstance(cb, ElixirMonitor)]
        if found:
            return found[0]
        monitor = ElixirMonitor()
        trainer.callbacks.insert(0, monitor)
        return monitor

    def configured_for_planning(self) -> Optional[tuple[list[Optimizer], list[Any]]]:
        """The optimizers (without Lightning's stand-in for none) and LR schedulers configured for this fit
        before planning, whose state the search prices ([Note: planning for the optimizer]); None where
        they are not known then (a model built on the meta device, a stage that does not fit)."""
        if self._configured is None:
            return None
        optimizers, configs = self._configured
        return [o for o in optimizers if not isinstance(o, _MockOptimizer)], [c.scheduler for c in configs]

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        configured, self._configured = self._configured, None
        if configured is None:
            super().setup_optimizers(trainer)
        else:  # configured before planning: the same objects, configure_optimizers called once
            self.optimizers, self.lr_scheduler_configs = configured
        for optimizer in self.optimizers:
            shard_optimizer(self.runtime, optimizer)

    def _group(self) -> Group:
        """The data-parallel group, with this strategy's bound on collective waits: with out-of-memory
        recovery on several ranks, a process group of the runtime's own, made on first use (in setup,
        on every rank) and watched for other ranks' failures ([Note: recovering from out of memory])."""
        if self._runtime_group is not None:
            return self._runtime_group
        group = Group.default(timeout_s=self._group_timeout_s)
        if self.recovery is None or group.world_size == 1:
            return group
        if not self.recovery.works_over(group):  # [Note: no recovery across GPUs yet] in recovery.py
            self.planner.recovery = None
            return group
        self._runtime_group = self.recovery.prepare(new_group(group))
        return self._runtime_group

    def _release_groups(self) -> None:
        """Destroy the process groups ``_group`` made, once the stage's runtime is let go (on every rank, at the
        same point): a gloo group keeps three threads that wake up on their own, so groups left to every fit of a
        long-lived process (a sweep, a test suite) add up to a core's worth of idle polling. The finished fit's
        runtime, which may still gather its optimizer state for a checkpoint, moves to the default group. A group
        given up after a failure is left alone: destroying it would wait for the collectives it still holds."""
        if self._runtime_group is None:
            return
        if self._finished is not None:
            self._finished.regroup(Group.default(timeout_s=self._group_timeout_s))
        group, self._runtime_group = self._runtime_group, None
        dist.destroy_process_group(group.pg)
        if self.recovery is not None:
            self.recovery.release()

    @override
    def model_to_device(self) -> None:
        pass  # the runtime places chunks and buffers on the root device

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.training_step(super().training_step, args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        return self._steps.backward(super().backward, closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        self._after_step.close()  # what the module's hook wrote after a previous step goes in first
        output = self._steps.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)
        self._after_step.open(self.runtime)  # [Note: code after the step in optimizer_step]
        return output

    def updates_will_start_in_backward(self) -> bool:
        """Whether offloaded updates start in the backward that ends an accumulation (``TrainingSteps``)."""
        return self._steps.updates_will_start_in_backward()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", super().test_step, args, kwargs)

    def _evaluation_step(self, hook: str, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A validation or test step, evened out over the ranks ([Note: uneven evaluation batches])."""
        self._uneven.before_eval_step(hook, args, kwargs)
        with self._steps.region(evaluating=True):
            output = step(*args, **kwargs)
        self._uneven.after_eval_step()
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._uneven.before_predict_step(args, kwargs)
        with self._steps.region(evaluating=True):
            return super().predict_step(*args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        self._uneven.begin_eval()  # [Note: uneven evaluation batches] in uneven.py

    @override
    def on_test_start(self) -> None:
        self._uneven.begin_eval()

    @override
    def on_predict_start(self) -> None:
        self._uneven.begin_predict()  # [Note: uneven predict batches] in uneven.py

    @override
    def on_validation_end(self) -> None:
        self._uneven.catch_up_eval()
        self._check_agreement()

    @override
    def on_test_end(self) -> None:
        self._uneven.catch_up_eval()
        self._check_agreement()

    @override
    def on_predict_end(self) -> None:
        self._uneven.catch_up_predict()
        self._check_agreement()

    def _check_agreement(self) -> None:
        """A forward-only loop has no optimizer step that compares what the ranks gathered: compare it
        now ([Note: silent divergence] in runtime/collectives.py)."""
        if self.runtime is not None:
            self.runtime.read_agreement()
            agreed_max(torch.zeros(0, device=self.root_device), self.runtime.group)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """A micro-batch that accumulates: like DDP's ``no_sync``, the forward after it broadcasts no
        buffers. Its gradients are reduce-scattered as always (each rank keeps only its shard)."""
        if self.runtime is None:
            yield
            return
        self.runtime.protocol.accumulating = True
        try:
            yield
        finally:  # the runtime's, also after a recovery switched plans inside the block
            if self.runtime is not None:
                self.runtime.protocol.accumulating = False

    @contextmanager
    def gathered_params(self, params: Optional[Iterable[torch.nn.Parameter]] = None,
                        grads: bool = False) -> Generator[None, None, None]:
        """Read (and write) full parameters and gradients outside the training step.

        Enter it on every rank. Inside, reading a parameter gathers its chunk on demand (so every
        rank must read the same ones), except for ``params``, whose chunks (and gradients, with
        ``grads=True``) are gathered on entry and may then be read on some ranks only. Changes to
        parameters or gradients, in place or by assigning ``.data`` or ``.grad``, are kept when the
        block ends. Gathered values live until then: copy what must outlive it. Example (an EMA
        callback)::

            with trainer.strategy.gathered_params():
                for ema, p in zip(self.ema.parameters(), pl_module.parameters()):
                    ema.lerp_(p.detach(), 1 - self.decay)

        Without a runtime (before setup, or after teardown gave the module back) it does nothing.
        """
        if self.runtime is None:
            yield
            return
        with self.runtime.gathered(params, grads):
            yield

    # ---- collectives ------------------------------------------------------------------------------

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl" and self.root_device.type == "cuda":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- checkpoints --------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.runtime is None:  # the module has its plain parameters back
            return super().lightning_module_state_dict()
        if self.state_dict_type == "sharded":
            return {}  # save_checkpoint writes each rank's shards
        return sd.deferred_state_dict(self.runtime)  # save_checkpoint gathers while writing

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.runtime is not None
        load_model(self.runtime, checkpoint, strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if not optimizer.param_groups:  # Lightning's stand-in when configure_optimizers returns None
            return optimizer.state_dict()
        if self.runtime is None:
            return optimizer_state_after_fit(self._finished, optimizer)
        if self.state_dict_type == "sharded":
            return {}  # save_checkpoint writes each rank's shards
        index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
        return sd.deferred_optimizer_state_dict(self.runtime, optimizer, index)  # save_checkpoint gathers while writing

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.runtime is not None
        load_optimizers(self.runtime, self.optimizers, checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.runtime is not None:
            self.runtime.read_agreement()  # a divergence is reported before its weights are saved
        if self.state_dict_type == "sharded" and self.runtime is not None:
            save_sharded_checkpoint(self, checkpoint, filepath)
        else:
            save_full_checkpoint(self, checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self._saver.remove(self.checkpoint_io, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, **kwargs: Any) -> dict[str, Any]:
        path = os.fspath(checkpoint_path)
        if self.runtime is None or not os.path.isdir(path):
            return super().load_checkpoint(checkpoint_path, **kwargs)  # a full file (ours, DDP's, one device's)
        trainer = getattr(self.lightning_module, "_trainer", None)
        return sharded_checkpoint_for_hooks(path, fitting=trainer is not None and trainer.state.fn == TrainerFn.FITTING)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown must not gather: a failed group would raise over the real error

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        remove_averages(self._averaging)
        self._averaging = []
        remove_toggling(self.lightning_module)
        remove_finetuning(getattr(self.lightning_module, "_trainer", None))
        self._after_step.remove(self.lightning_module)
        remove_rank_hooks(self, getattr(self.lightning_module, "_trainer", None))
        if self.runtime is not None and not self._failed:
            self.runtime.read_agreement()  # the last optimizer step's ([Note: reading the agreement later])
        if self.runtime is not None and self._failed:
            with contextlib.suppress(Exception):  # the run's own error is the one to see
                self.runtime.offload.close(keep_files=True)  # the shards stay, on NVMe too, for the next stage
            log.warning("Elixir: the stage failed, so the module keeps its shards (gathering them could wait on "
                        "ranks that failed): the next stage, on this Trainer or another, gathers them back, and "
                        "until then `with trainer.strategy.gathered_params():` reads them (on every rank)")
        elif self.runtime is not None and self.unshard_on_teardown:
            self.runtime.restore_module()
            self._finished = self.runtime if self.runtime.optimizers else None
            self.runtime = self.precision_plugin.runtime = None
            self._release_groups()
            trainer = getattr(self.lightning_module, "_trainer", None)
            if self._layer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                self.model = self._layer_sync.revert(self.model)  # plain BatchNorm layers again, as after DDP
            self._synced_by = None
        if self._recomputation is not None and (self.runtime is None or self._failed):  # the module is the user's
            self._recomputation.remove()  # again, or a new strategy may take it over (a reused runtime re-applies it)
            self._recomputation = None
        if self.runtime is None and not _holds_meta(self.lightning_module):
            super().teardown()  # moves the (plain) module to the CPU, as for DDP; checkpoint_io too
        else:
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
        self._saver.unsplice()  # after checkpoint_io.teardown() waited for asynchronous saves
        self._failed = False  # the next stage starts afresh

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("elixir", cls, description="Elixir: profile, search and run the fastest plan",
                                   plan="auto")
        strategy_registry.register("elixir_spawn", cls, description="Elixir with start_method='spawn'",
                                   plan="auto", start_method="spawn")
        strategy_registry.register("elixir_notebook", cls, description="Elixir with start_method='fork', for "
                                   "Jupyter notebooks", plan="auto", start_method="fork")
        for name in ("zero2", "zero3"):
            strategy_registry.register(f"elixir_{name}", cls, description=f"Elixir with the fixed {name} plan", plan=name)
