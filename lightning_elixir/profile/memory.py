"""Bytes held by the storages a step creates, tracked from creation to release.

[Note: what counts as activation memory]
A storage counts from the operator that creates it until Python and autograd drop their last
reference to it. Parameters and the tensors that existed before the step (the batch) are never
created by a tracked operator, so they never count. A gradient counts while it is a temporary and
stops counting when it becomes ``param.grad`` (the tracer calls ``release`` from a
post-accumulate-grad hook), because gradients live in the runtime's chunks, not in activation
memory. The same rule works for fake tensors, whose storages are meta storages with real sizes,
and for real ones.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from functools import partial

import torch


class LiveStorages:
    """The storages created while tracking that are still alive, and their total bytes."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def track(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` until it is freed (no-op if it is already counted)."""
        key = storage._cdata
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        self._refs[key] = (weakref.ref(storage, partial(self._on_free, key)), nbytes)
        self.live_bytes += nbytes

    def release(self, storage: torch.UntypedStorage) -> None:
        """Stop counting ``storage`` while it is still alive (it became a gradient)."""
        self._on_free(storage._cdata, None)

    def _on_free(self, key: int, _ref: weakref.ref | None) -> None:
        """Weakref callback: the storage is gone."""
        entry = self._refs.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]


def tensors_in(tree: object) -> list[torch.Tensor]:
    """The tensors in a (nested) argument or output structure."""
    leaves = torch.utils._pytree.tree_leaves(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def storage_keys(tensors: Iterable[torch.Tensor]) -> dict[int, None]:
    """Identity keys of the storages behind ``tensors``, in order, each once."""
    return dict.fromkeys(t.untyped_storage()._cdata for t in tensors if _has_storage(t))


def new_storages(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Storages of ``outputs`` that no input shares: the ones an operator allocated."""
    seen = set(storage_keys(inputs))
    fresh = []
    for t in outputs:
        if not _has_storage(t):
            continue
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            fresh.append(storage)
    return fresh


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``t``'s data: its own, or a sparse COO tensor's values and indices."""
    if _has_storage(t):
        return [t.untyped_storage()]
    if t.layout == torch.sparse_coo:
        return [part.untyped_storage() for part in (t._values(), t._indices())]
    return []


def _has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is backed by a storage we can key (sparse and nested tensors are not)."""
    return t.layout == torch.strided and not t.is_nested
