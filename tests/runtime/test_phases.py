"""The phase clock: host time, and on a GPU the stream's time while the self-correction measures."""

from __future__ import annotations

import pytest
import torch

from lightning_elixir.runtime.phases import PhaseClock


class _StreamEvent:
    """A CUDA event stand-in on a machine without one: ``record`` reads a stream clock the test advances."""

    now = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at, self.done = None, False

    def record(self, stream=None) -> None:
        self.at = _StreamEvent.now

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: "_StreamEvent") -> float:
        assert end.done, "read before the end event was waited for"
        return (end.at - self.at) * 1e3


def test_gpu_waits_are_timed_on_the_stream_while_measuring_and_host_waits_on_the_host(monkeypatch):
    """[Note: phases timed on the device]: a stream wait returns at once on the host; what the stream
    lost is what the self-correction must see."""
    monkeypatch.setattr(torch.cuda, "Event", _StreamEvent)
    streams = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams.append(device) or "stream")
    gpu = torch.device("cuda", 0)
    clock = PhaseClock()
    with clock.timing("gather_wait", gpu):
        _StreamEvent.now += 3.0  # not measuring: the host's time, a few microseconds
    assert clock.take()["gather_wait"] < 0.5
    clock.device_timing = True
    with clock.timing("gather_wait", gpu):
        _StreamEvent.now += 3.0  # the stream waited three seconds for the all-gather
    with clock.timing("optimizer", gpu):
        _StreamEvent.now += 0.25
    with clock.timing("reduce_wait", None):  # a wait on the host (a shard landing in host memory)
        _StreamEvent.now += 7.0
    with clock.timing("offload_wait", torch.device("cpu")):
        pass
    taken = clock.take()
    assert taken["gather_wait"] == pytest.approx(3.0) and taken["optimizer"] == pytest.approx(0.25)
    assert taken["reduce_wait"] < 0.5 and taken["offload_wait"] < 0.5
    assert clock.take() == dict.fromkeys(taken, 0.0)  # the spans were read once
    assert streams == [gpu, gpu]  # recorded on the timed device's stream, whichever device is current
