"""Sharded checkpoints on a cluster whose nodes do not share a file system.

Every rank writes its own files into the sharded checkpoint directory, and rank 0 completes it. When
the directory is a different disk on each node (the same path, other storage), rank 1's files never
reach the directory rank 0 completes: the checkpoint was marked complete without them, and the loss
showed only at resume ("missing __1_0.distcp"). Emulated here by giving each rank another directory
for "the same" path."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_elixir.checkpointing import unshared_dirs_problem
from lightning_elixir.runtime.sharded import ShardedCheckpointError
from tests.distributed import run_distributed


def _strategy(rank: int, world_size: int) -> SimpleNamespace:
    """The few collectives of a ParallelStrategy that the check uses, on the test's gloo group."""

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(tensor):
        out = [torch.zeros_like(tensor) for _ in range(world_size)]
        dist.all_gather(out, tensor)
        return torch.stack(out)

    return SimpleNamespace(is_global_zero=rank == 0, world_size=world_size, broadcast=broadcast, root_device=torch.device("cpu"),
                           barrier=dist.barrier, all_gather=all_gather)


def _check(rank: int, world_size: int, root: str, shared: bool):
    directory = os.path.join(root, "shared" if shared else f"node{rank}", "ckpt")
    os.makedirs(directory, exist_ok=True)
    problem = unshared_dirs_problem(_strategy(rank, world_size), [directory])
    dist.barrier()
    return problem, sorted(os.listdir(directory))


@pytest.mark.parametrize("shared", [True, False])
def test_setup_refuses_a_sharded_checkpoint_dir_that_some_rank_does_not_see(tmp_path, shared):
    results = run_distributed(_check, 2, str(tmp_path), shared)
    for problem, listed in results:
        assert listed == [], "the probe is removed"
        if shared:
            assert problem is None
        else:
            assert "rank(s) [1] do not see" in problem and "shared file system" in problem


def test_a_sharded_save_whose_rank_files_are_elsewhere_is_never_marked_complete(tmp_path):
    # rank 0 completes the directory it sees; rank 1 wrote __1_0.distcp into its own disk's copy of it
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from lightning_elixir.runtime.sharded import DCP_METADATA, _Writer

    (tmp_path / "__0_0.distcp").write_bytes(b"rank 0")
    results = [[WriteResult(MetadataIndex(f"w{rank}"), 6, _StorageInfo(f"__{rank}_0.distcp", 0, 6))] for rank in (0, 1)]
    writer = _Writer(str(tmp_path), meta={})
    with pytest.raises(ShardedCheckpointError, match=r"__1_0\.distcp.*shared"):
        writer.finish(Metadata(state_dict_metadata={}), results)
    assert not (tmp_path / DCP_METADATA).exists()
