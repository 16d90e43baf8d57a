"""ElixirRuntime: executes a plan on a module (chunks, cache, hooks, gradient reduction)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from torch.autograd import Variable

from lightning_elixir.plan import CACHE_ALL, CACHE_MIN, ElixirPlan, PlanError
from lightning_elixir.runtime import collectives, hooks
from lightning_elixir.runtime.cache import ChunkCache
from lightning_elixir.runtime.chunk import Chunk, Slot
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.layout import broadcast_buffers, build_chunks, materialize_buffers, resolve_specs
from lightning_elixir.runtime.states import ChunkState

log = logging.getLogger(__name__)


class ElixirRuntime:
    """Shards ``module``'s parameters into chunks and runs forward/backward through hooks.

    Args:
        module: the model (a LightningModule or any nn.Module); its parameters become chunk views.
        plan: the plan to execute.
        device: where chunks, gathered blocks and (for "device" placement) sharded state live.
        compute_dtype: dtype of the gathered parameters the model computes with.
        master_dtype: dtype of the master shards the optimizer updates (default: compute dtype).
        group: the data-parallel group (default: the world, or a single process).
        private_params: names that get their own always-gathered chunk, besides the tied ones.
        grow_cache: let an int ``cache_blocks`` grow when more chunks are needed at once than it
            allows (a searched plan's prediction was short) instead of raising.
    """

    def __init__(self, module: nn.Module, plan: Optional[ElixirPlan] = None, *, device: Union[str, torch.device] = "cpu",
                 compute_dtype: torch.dtype = torch.float32, master_dtype: Optional[torch.dtype] = None,
                 group: Optional[Group] = None, private_params: Iterable[str] = (), grow_cache: bool = False) -> None:
        self.module = module
        self.plan = plan or ElixirPlan()
        self.group = group or Group.default()
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.master_dtype = master_dtype or compute_dtype
        reduce_dtype = torch.float32 if self.plan.reduce_in_fp32 and self.master_dtype == torch.float32 else compute_dtype
        specs = resolve_specs(module, self.plan, self.group.world_size, private_params)
        if any(spec.placement != "device" for spec in specs):
            raise PlanError("this version runs every chunk's sharded state on the device; "
                            "set placement='device' for all chunks (CPU/NVMe offload is not available yet)")
        materialize_buffers(module, self.device)
        self.chunks = build_chunks(module, specs, self.group, self.device, compute_dtype, self.master_dtype, reduce_dtype)
        broadcast_buffers(module, self.group)
        self.public = [c for c in self.chunks if not c.private]
        self.private = [c for c in self.chunks if c.private]
        self._where: dict[int, tuple[Chunk, Slot]] = {id(s.param): (c, s) for c in self.chunks for s in c.slots}
        self.handles: list[Any] = []
        grow = grow_cache or self.plan.cache_blocks == CACHE_MIN
        self.cache = ChunkCache(self.public, self._capacity(), grow, self.plan.prefetch_depth)
        self.states = hooks.install(self, module)
        if self.plan.cache_blocks == CACHE_MIN:
            self.cache.capacity = max([len(s.public_ids) for s in self.states] + [1])
        self._state_of = {pid: s for s in self.states for pid in s.trainable}
        self._reduce_order = [c for c in reversed(self.public) if c.grad_requiring] + [c for c in self.private if c.grad_requiring]
        self._next_reduce = 0
        self._callback_queued = False
        self._recompute_pins: list[tuple[int, ...]] = []
        self._views: dict[int, nn.Parameter] = {}
        self._grad_valid = {c.index: False for c in self.chunks}
        self.scaler: Any = None
        self.private_gathers = 0
        self.micro_batches = 0
        self.steps = 0
        self.skipped_steps = 0

    # ---- layout queries ---------------------------------------------------------------------

    def _capacity(self) -> Optional[int]:
        blocks = self.plan.cache_blocks
        if blocks in (CACHE_ALL, CACHE_MIN):
            return None
        return min(int(blocks), max(len(self.public), 1))

    def public_chunk_ids(self, params: Iterable[nn.Parameter]) -> tuple[int, ...]:
        """The public chunks holding ``params``, in chunk order."""
        ids = {self._where[id(p)][0].index for p in params if not self._where[id(p)][0].private}
        return tuple(sorted(ids))

    def is_public(self, param: nn.Parameter) -> bool:
        return not self._where[id(param)][0].private

    def param_ids(self) -> set[int]:
        """ids of every parameter the chunks hold."""
        return set(self._where)

    def view_index(self) -> dict[int, tuple[Chunk, Slot]]:
        """For each optimizer shard view (by id), the chunk and slot of its parameter."""
        return {id(view): self._where[pid] for pid, view in self._views.items()}

    def trainable_params(self) -> list[nn.Parameter]:
        return [s.param for c in self.chunks for s in c.slots if s.param.requires_grad]

    # ---- iteration and module hooks -----------------------------------------------------------

    def begin_iteration(self) -> None:
        """A forward pass starts: replay the recorded order and gather the private chunks."""
        if hooks.in_backward():
            return
        for state in self.states:
            state.calls = 0
        self.cache.begin_iteration(torch.is_grad_enabled())
        for chunk in self.private:
            if chunk.state is ChunkState.FREE:
                chunk.start_gather(async_op=False)
                chunk.finish_gather()
                self.private_gathers += 1

    def before_module(self, state: hooks.ModuleState) -> None:
        if not hooks.in_backward():
            state.calls += 1
            if state.calls > 1 and state.public_ids and torch.is_grad_enabled():
                raise RuntimeError(
                    f"module {state.name!r} ran more than once in one forward pass; its parameters are shared "
                    "across uses and need a private chunk: pass private_params=[...] or use plan='auto'")
        if not state.public_ids:
            return
        self.cache.acquire(state.public_ids)
        if hooks.in_backward():
            self._recompute_pins.append(state.public_ids)

    def after_module(self, state: hooks.ModuleState) -> None:
        if not state.public_ids:
            return
        if hooks.in_backward():
            if state.public_ids not in self._recompute_pins:
                return  # already dropped by _drop_recompute_pins
            self._recompute_pins.remove(state.public_ids)
        self.cache.release_pins(state.public_ids)

    def _drop_recompute_pins(self) -> None:
        """Recomputation under activation checkpointing may stop early, skipping forward hooks.

        Once any backward event arrives, recomputation is over and its pins can go: each
        module's own backward pins its chunks again before it runs.
        """
        while self._recompute_pins:
            self.cache.release_pins(self._recompute_pins.pop())

    def before_module_backward(self, state: hooks.ModuleState) -> None:
        self._drop_recompute_pins()
        self._queue_finish()
        self.cache.acquire(state.public_ids)
        pending = set(state.trainable) | ({hooks.INPUTS} if state.inputs_need_grad else set())
        state.backward_pending = pending or {"end-of-backward"}

    def module_event(self, state: hooks.ModuleState, key: Any) -> None:
        """One thing a module's backward waits for has happened; unpin once nothing is left."""
        self._drop_recompute_pins()
        if state.backward_pending is None:
            return
        state.backward_pending.discard(key)
        if not state.backward_pending:
            state.backward_pending = None
            self.cache.release_pins(state.public_ids)

    # ---- gradients ----------------------------------------------------------------------------

    def on_param_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move the gradient into its chunk and reduce when complete."""
        self._drop_recompute_pins()
        self._queue_finish()
        chunk, slot = self._where[id(param)]
        chunk.add_grad(slot, param.grad)
        param.grad = None
        if chunk.grads_complete:
            self._launch_ready_reduces()
        state = self._state_of.get(id(param))
        if state is not None:
            self.module_event(state, id(param))

    def _launch_ready_reduces(self) -> None:
        """Start reduce-scatters in the fixed order while the next chunk in it is complete."""
        order = self._reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].grads_complete:
            order[self._next_reduce].start_reduce()
            self._next_reduce += 1

    def _queue_finish(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of backward: reduce what is left (missing gradients count as zero), publish shards."""
        self._callback_queued = False
        self._drop_recompute_pins()
        for chunk in self._reduce_order[self._next_reduce:]:
            chunk.start_reduce()
        for chunk in self._reduce_order:
            chunk.finish_reduce(accumulate=self._accumulates(chunk))
            self._grad_valid[chunk.index] = True
            self._publish_grad(chunk)
            chunk.reset_grad_tracking()
        self._next_reduce = 0
        for state in self.states:
            if state.backward_pending is not None:
                state.backward_pending = None
                self.cache.release_pins(state.public_ids)
        self.micro_batches += 1

    def _chunk_views(self, chunk: Chunk) -> list[tuple[Slot, nn.Parameter]]:
        return [(s, self._views[id(s.param)]) for s in chunk.slots if id(s.param) in self._views]

    def _accumulates(self, chunk: Chunk) -> bool:
        """Add to the gradient shard (True) or overwrite it: after zero_grad(set_to_none) it is stale."""
        if not self._grad_valid[chunk.index]:
            return False
        views = [v for _, v in self._chunk_views(chunk) if v.requires_grad]
        return not views or any(v.grad is not None for v in views)

    def _publish_grad(self, chunk: Chunk) -> None:
        for slot, view in self._chunk_views(chunk):
            if view.requires_grad:
                begin, end = chunk.shard_range(slot)
                view.grad = chunk.grad_shard[begin:end]

    def zero_grad(self) -> None:
        """Forget accumulated gradients (the optimizer's own zero_grad does the same through views)."""
        self._grad_valid = {c.index: False for c in self.chunks}
        for view in self._views.values():
            view.grad = None

    # ---- optimizer-facing ---------------------------------------------------------------------

    def view_param(self, param: nn.Parameter) -> nn.Parameter:
        """The flat view of this rank's master shard of ``param`` (possibly empty), made once."""
        view = self._views.get(id(param))
        if view is not None:
            return view
        if id(param) not in self._where:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} given to the optimizer is not a parameter "
                             "of the model this strategy wraps; build optimizers from self.parameters()")
        chunk, slot = self._where[id(param)]
        begin, end = chunk.shard_range(slot)
        view = nn.Parameter(chunk.master[begin:end], requires_grad=param.requires_grad)
        self._views[id(param)] = view
        return view

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's gradient shards, one per chunk that has trainable parameters."""
        return [c.grad_shard for c in self.chunks if c.grad_requiring and self._grad_valid[c.index]]

    def after_step(self, stepped: bool = True) -> None:
        """The optimizer has updated the masters: refresh the shards and mark gathered chunks stale."""
        if not stepped:
            self.skipped_steps += 1
            return
        self.steps += 1
        for chunk in self.chunks:
            chunk.refresh_shard()
        self.cache.invalidate()
        for chunk in self.private:
            if chunk.state is not ChunkState.FREE:
                chunk.release()

    def release_all(self) -> None:
        """Free every gathered block (e.g. before a state-dict load, or at teardown)."""
        self.cache.invalidate()
        for chunk in self.private:
            if chunk.state is not ChunkState.FREE:
                chunk.release()

    # ---- accounting -----------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, int]:
        """Bytes the runtime holds on its device and how many chunks are gathered."""
        shard_bytes = 0
        for c in self.chunks:
            shard_bytes += c.shard.nbytes + c.grad_shard.nbytes + (0 if c.master is c.shard else c.master.nbytes)
        block = self.public[0].full_bytes if self.public else 0
        gathered_private = [c for c in self.private if c.state is not ChunkState.FREE]
        return {
            "shard_bytes": shard_bytes,
            "cache_bytes": len(self.cache.gathered) * block,
            "private_bytes": sum(c.full_bytes for c in gathered_private),
            "cache_blocks": self.cache.capacity,
            "gathered_public_chunks": len(self.cache.gathered),
            "peak_gathered_public_chunks": self.cache.peak_gathered,
            "gathers": self.cache.gathers,
            "private_gathers": self.private_gathers,
        }

    def remove_hooks(self) -> None:
        for state in self.states:
            for handle in state.handles:
                handle.remove()
        for handle in self.handles:
            handle.remove()
