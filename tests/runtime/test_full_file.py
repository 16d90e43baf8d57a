"""Full checkpoint files written while their tensors are gathered: what torch.save writes, read by torch.load."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_elixir.runtime.full_file import DeferredTensor, Gathered, deferred_in, fill_deferred, write_torch_file


def _checkpoint():
    """A checkpoint-like dict: deferred tensors (one tied, one bf16), real tensors, views and plain values."""
    weight, bias = DeferredTensor("w", (3, 4), torch.float32), DeferredTensor("b", (4,), torch.bfloat16)
    base = torch.arange(10.0)
    obj = {"state_dict": {"w": weight, "tied": weight, "b": bias, "buffer": torch.ones(2, dtype=torch.int64)},
           "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": weight}}}],
           "views": (base[2:5], base[::2]), "epoch": 1, "name": "run"}
    values = {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16)}
    return obj, values


def _records(obj, values):
    """Each deferred tensor once, with a value that is dropped by the producer after the next item."""
    for deferred in deferred_in(obj):
        value = values[deferred.source].clone()
        yield Gathered(value.view(-1), [(deferred, value)])


def _same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_streamed_file_loads_as_the_torch_save_of_the_filled_dict(weights_only):
    obj, values = _checkpoint()
    streamed = io.BytesIO()
    write_torch_file(obj, _records(obj, values), streamed)
    saved = io.BytesIO()
    torch.save(fill_deferred(obj, {id(d): values[d.source] for d in deferred_in(obj)}), saved)
    loaded = torch.load(io.BytesIO(streamed.getvalue()), weights_only=weights_only)
    _same(loaded, torch.load(io.BytesIO(saved.getvalue()), weights_only=weights_only))
    _same(loaded["state_dict"]["w"], values["w"])
    _same(loaded["views"][1], torch.arange(10.0)[::2])
    assert loaded["state_dict"]["w"] is loaded["state_dict"]["tied"] is loaded["optimizer_states"][0]["state"][0]["exp_avg"]
    assert loaded["state_dict"]["b"].dtype == torch.bfloat16


def test_views_of_one_gathered_buffer_are_written_once_and_load_as_views():
    """As the strategy's records come: views of a gathered chunk, which is freed after its last view."""
    deferred = [DeferredTensor(("param", i), (2, 3), torch.float32) for i in range(4)]
    obj = {"state_dict": {f"p{i}": d for i, d in enumerate(deferred)}}

    def records():
        for first in (0, 2):  # two chunks of two parameters each, and padding
            chunk = torch.cat([torch.arange(12.0) + 100 * first, torch.zeros(1000)])
            yield Gathered(chunk[:12], [(deferred[first], chunk[:6].view(2, 3)),
                                        (deferred[first + 1], chunk[6:12].view(2, 3))])

    file = io.BytesIO()
    write_torch_file(obj, records(), file)
    loaded = torch.load(io.BytesIO(file.getvalue()), weights_only=True)["state_dict"]
    assert torch.equal(loaded["p3"], torch.arange(6.0, 12.0).view(2, 3) + 200)
    assert loaded["p0"].untyped_storage().data_ptr() == loaded["p1"].untyped_storage().data_ptr()
    assert loaded["p1"].storage_offset() == 6 and loaded["p2"].untyped_storage().nbytes() == 48  # no padding


def test_a_deferred_tensor_without_a_record_fails_before_the_file_looks_complete():
    obj, values = _checkpoint()
    records = [Gathered(values[d.source].view(-1), [(d, values[d.source])]) for d in deferred_in(obj) if d.source != "b"]
    with pytest.raises(RuntimeError, match="was not gathered"):
        write_torch_file(obj, records, io.BytesIO())


def test_a_write_that_fails_part_way_raises_its_error_and_leaves_the_process_running(tmp_path):
    """A gather that fails (another rank's error) while rank 0 writes: the error reaches the caller, who closes
    the file, and the process goes on. The unfinished archive writer once finished itself into the closed
    file when it was freed, and its error in C++ aborted the process ("terminate called ...")."""
    script = f"""
import torch
from lightning_elixir.runtime.full_file import DeferredTensor, Gathered, write_torch_file

def records():
    yield Gathered(torch.zeros(4), [(first, torch.zeros(4))])
    raise RuntimeError("a gather failed")

first, second = DeferredTensor("a", (4,), torch.float32), DeferredTensor("b", (4,), torch.float32)
try:
    with open({str(tmp_path / "part.ckpt")!r}, "wb") as file:
        write_torch_file({{"a": first, "b": second}}, records(), file)
except RuntimeError as err:
    print("raised:", err)
print("still running")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["raised: a gather failed", "still running"]


def test_computing_with_a_deferred_tensor_says_what_to_do():
    deferred = DeferredTensor("w", (3, 4), torch.float32)
    assert deferred.shape == (3, 4) and deferred.numel() == 12 and deferred.nbytes == 48
    with pytest.raises(TypeError, match="gathered_params"):
        torch.add(deferred, 1)
    with pytest.raises(AttributeError, match="gathered_params"):
        deferred.half()
