"""Which parameters train: ``requires_grad`` as the module says now, and parameters no rank used.

[Note: trainable parameters can change]
Users freeze and unfreeze parameters during training (a backbone unfrozen after some steps, a
layer frozen once it has converged) by setting ``requires_grad``. The chunks, the module hooks
and the reductions all track which parameters get gradients, so at the start of every training
iteration ``Trainable.refresh`` compares the flags with those it last saw (one pass over the
parameters) and, when any changed, re-derives that tracking: each chunk's expected gradients and
zero-filled gaps, each module's backward waits, the reduction order, the post-accumulate-grad
hooks of newly trainable parameters and the ``requires_grad`` of the optimizer's shard views.
The layout and the plan stay: a frozen parameter already has its gradient and master shards
(zero gaps until it trains), but a plan searched for a partly frozen model counted no optimizer
state for the frozen part, so a warning says that memory use may now exceed the plan's estimate.
As in a single process, a parameter unfrozen mid-training is updated only by an optimizer that
holds it (built over all parameters, or given it with ``add_param_group``).

[Note: unused parameters]
In a single process, or under DDP, a parameter that no forward used has ``.grad`` None after
backward, and optimizers skip it: Adam's moments and step count do not move, weight decay does
not apply. The reductions treat a missing gradient as zero (every rank must join every chunk's
reduce-scatter), so before each optimizer step ``settle_unused`` exchanges one flag per shard view
(did this rank see its gradient since the shard was last overwritten), takes the maximum over the
ranks, and sets the gradient of the views that no rank saw back to None. A parameter used on some
ranks only keeps its gradient (the others contributed zero), exactly as DDP averages it. The
exchange is one small all-reduce per optimizer step, which also compares what the ranks gathered
([Note: silent divergence] in collectives.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from lightning_elixir.runtime import collectives

if TYPE_CHECKING:
    from lightning_elixir.runtime.runtime import ElixirRuntime

log = logging.getLogger(__name__)


class Trainable:
    """The ``requires_grad`` flags of a runtime's parameters, and the hooks that follow them."""

    def __init__(self, runtime: "ElixirRuntime") -> None:
        self.runtime = runtime
        self.by_id: dict[int, nn.Parameter] = {id(s.param): s.param for c in runtime.chunks for s in c.slots}
        self.flags = self._flags()
        self._initially = self.flags
        self._hooked: set[int] = set()
        self._warned = False
        self.hyperparameters_differ = False
        """Whether an optimizer step found the optimizer's hyperparameters differing between ranks."""
        self.hook_new()

    def _flags(self) -> list[bool]:
        return [p.requires_grad for p in self.by_id.values()]

    def hook_new(self) -> None:
        """A post-accumulate-grad hook on every trainable parameter that has none yet."""
        for pid, p in self.by_id.items():
            if p.requires_grad and pid not in self._hooked:
                self.runtime.handles.append(p.register_post_accumulate_grad_hook(self.runtime.on_param_grad))
                self._hooked.add(pid)

    def trainable_ids(self, param_ids: frozenset[int]) -> frozenset[int]:
        """Those of ``param_ids`` that are trainable now and live in public chunks."""
        return frozenset(pid for pid in param_ids if pid in self.by_id and self.by_id[pid].requires_grad
                         and self.runtime.is_public(self.by_id[pid]))

    def refresh(self) -> bool:
        """Follow ``requires_grad`` changes since the last call; return whether any changed."""
        flags = self._flags()
        if flags == self.flags:
            return False
        self.flags = flags
        runtime = self.runtime
        for chunk in runtime.chunks:
            chunk.track_trainable()
        for state in runtime.states:
            state.trainable = self.trainable_ids(state.param_ids)
        runtime.reductions.reorder()
        self.hook_new()
        for pid, view in runtime.shard_views().items():
            view.requires_grad_(self.by_id[pid].requires_grad)
        if not self._warned and any(now and not before for now, before in zip(flags, self._initially)):
            self._warned = True
            log.warning("parameters that were frozen when the plan was made now train: the plan counted no "
                        "gradients or optimizer state for them, so memory use may exceed its estimate")
        return True


def settle_unused(runtime: "ElixirRuntime", optimizer: Any) -> None:
    """Set to None the gradients of ``optimizer``'s shard views whose parameter no rank used.

    The same all-reduce compares what the ranks gathered ([Note: silent divergence] in
    collectives.py) and the optimizer's hyperparameters: an LR scheduler stepped on a metric each
    rank computed alone (ReduceLROnPlateau on an unsynced loss) gives each rank its own lr, and each
    rank would update its shard with it. Under DDP the replicas drift apart instead; neither is
    what the user meant, so a warning says so, once."""
    stepped = {id(q) for group in optimizer.param_groups for q in group["params"]}
    pairs = [(pid, view) for pid, view in runtime.shard_views().items() if view.requires_grad and id(view) in stepped]
    seen = runtime.reductions.seen
    hyper = _hyperparameter_print(optimizer)
    local = torch.tensor([float(pid in seen) for pid, _ in pairs] + [hyper, -hyper], dtype=torch.float32,
                         device=runtime.device)
    *used, high, neg_low = collectives.agreed_max(local, runtime.group)
    if high != -neg_low and not runtime.trainable.hyperparameters_differ:
        runtime.trainable.hyperparameters_differ = True
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        log.warning("rank %d: the optimizer's hyperparameters differ between ranks (here: %s), so each rank updates "
                    "its shard with its own. An LR scheduler that reads a metric (ReduceLROnPlateau) needs one "
                    "every rank agrees on: log it with self.log(..., sync_dist=True).", runtime.group.rank, groups)
    for (_, view), anywhere in zip(pairs, used):
        if not anywhere:
            view.grad = None


def _hyperparameter_print(optimizer: Any) -> float:
    """A fingerprint of the param groups' scalar hyperparameters (lr, betas, ...)."""
    return collectives.fingerprint([sorted((k, v) for k, v in group.items() if isinstance(v, (bool, int, float, tuple)))
                                    for group in optimizer.param_groups])
