"""Timed microbenchmarks of one machine: operator overhead, matmul, attention and elementwise
operators at a few sizes, memory copy, host transfer, NVMe, and how much of a collective hides
behind compute (the optimizer's speeds: optimizer_bench.py).

Each function returns a speed (per second), speeds at a few sizes, or a fraction, and allocates
only what it measures, freed on return. Sizes are fixed per device kind so every rank runs the same
work (the collective benchmarks run a deterministic sequence of collectives: see [Note: same
collectives on every rank] in ``hardware.py``). Together they take a few seconds on a GPU and two
to three on a CPU. The compute calibration (operator overhead, matmul, attention and elementwise
rates; [Note: roofline] in ``cost.py``) keeps the fastest of three blocks of calls per size, the
sizes' blocks taking turns (``fastest_s``): other work on the machine only slows a block down.

[Note: measuring communication overlap]
The cost model lets a prefetch or a reduce-scatter run while compute runs, and charges the compute
``(1 - comm_overlap)`` of the collective's time for it. On a GPU, NCCL has its own engine and
takes almost nothing from compute; on a CPU, gloo copies, sums and moves bytes through sockets on
the cores the compute needs. So we measure that charge. Per round: a matmul step alone (``t_step``),
a fixed number of collectives alone (``t_m``), then the collectives again in a background thread
while this thread runs matmul steps until they are done: ``n`` steps in a window of ``t_window``.
The compute the collectives cost is what the window did not compute, so

    overlap = 1 - (t_window - n * t_step) / t_m,   clamped to [0, 1] (timing noise).

We do not use the makespan of a fixed compute loop and the collectives run together,
``(t_c + t_m - t_both) / min(t_c, t_m)``: it also counts how much the collectives are stretched by
the compute. On 2 cores with 2 gloo ranks they stretch ~2.5x while the compute loses ~80% of their
time, so it reads ~0, and the search would never prefetch, though a prefetch measurably pays there.

- The injected collectives are synchronous, so they run in a thread, which waits with the GIL
  released while gloo or NCCL works. On an accelerator the thread issues on a stream of its own (on
  the current stream its collectives would queue behind the matmuls) and synchronises it before it
  says it is done; each matmul step synchronises the current stream, alone and in the window alike.
- Every phase starts after a tiny all-gather, so that no rank's collectives wait for a rank still
  computing in the phase before (that wait would count as lost compute).
- Each round pairs phases close in time; the median over rounds counts, so a burst of other load
  on the machine sways one round, not the result. This is the noisiest number of the profile (on
  a 2-core VM single rounds spread over most of [0, 1]; medians of 8 over ~0.05-0.3); the ranks
  keep the smallest.
- Every rank runs the same collectives; only the number of matmul steps, which run none, is
  rank-local.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from lightning_elixir.devices import indexed, use_device

Collective = Callable[[torch.Tensor, torch.Tensor], object]
"""``fn(out, inp)``: an all-gather or reduce-scatter bound to a process group by the caller."""

_MiB = 1 << 20


@dataclass(frozen=True)
class BenchSizes:
    """How big each microbenchmark is: small on a CPU, large enough to saturate an accelerator."""

    matmul_dim: int
    """Side of the square matmul."""
    copy_bytes: int
    """Bytes copied for memory and host-transfer bandwidth."""
    optimizer_numel: int
    """Parameter elements the AdamW benchmark updates."""
    collective_bytes: tuple[int, ...]
    """Full message sizes of the collective benchmark, ascending."""
    nvme_bytes: int
    """Bytes written and read back for NVMe bandwidth."""
    iters: int
    """Timed repetitions of each benchmark (after one warm-up)."""
    overlap_collectives: int = 4
    """Collectives (all-gathers and reduce-scatters in turn, at the largest collective size) that
    the overlap benchmark times alone and beside compute."""
    overlap_rounds: int = 8
    """Rounds of the overlap benchmark; the median of their estimates counts."""
    matmul_dims: tuple[int, ...] = ()
    """Sides of the smaller square matmuls timed for the size-dependent rate (besides
    ``matmul_dim``); empty: ``matmul_dim`` / 8, / 4 and / 2."""
    attention_shapes: tuple[tuple[int, int, int, int], ...] = ((4, 4, 64, 64), (4, 4, 128, 64), (4, 4, 256, 64))
    """(batch, heads, sequence, head dim) of the causal attention calls timed for the attention
    rates, ascending in work."""
    elementwise_bytes: tuple[int, ...] = (256 * 1024, 2 * _MiB, 16 * _MiB)
    """Bytes of each tensor of the elementwise benchmark, ascending."""
    overhead_steps: int = 20
    """Tiny training steps per timed block (the fastest of three counts) for the fixed cost of one
    operator."""
    host_update_numel: int = 1 << 20
    """Shard elements of each chunk of the host update benchmark (``optimizer_bench.host_update_costs``)."""
    host_update_chunks: int = 4
    """Chunks the host update benchmark updates in turn: enough that their state does not fit in the
    host's caches, as a model's offloaded state does not."""

    def matmul_sides(self) -> tuple[int, ...]:
        """Sides of the square matmuls of the size-dependent rate, ascending, ``matmul_dim`` last."""
        dims = self.matmul_dims or (self.matmul_dim // 8, self.matmul_dim // 4, self.matmul_dim // 2)
        return tuple(sorted({d for d in dims if 0 < d < self.matmul_dim} | {self.matmul_dim}))

    def matmul_iters(self, side: int) -> int:
        """Timed calls of a ``side`` matmul: about the work of ``iters`` calls at ``matmul_dim``
        (small matmuls are fast, and a few calls would be all noise), at most 10,000."""
        return _scaled_iters(self.iters, (self.matmul_dim / side) ** 3)

    def attention_iters(self, shape: tuple[int, int, int, int]) -> int:
        """Timed calls of attention at ``shape``: about the work of ``iters`` calls at the largest
        shape, at most 10,000."""
        return _scaled_iters(self.iters, _attention_work(self.attention_shapes[-1]) / _attention_work(shape))

    def elementwise_iters(self, nbytes: int) -> int:
        """Timed rounds of the elementwise operators on ``nbytes`` tensors: about the work of
        ``iters`` rounds at the largest size, at most 10,000."""
        return _scaled_iters(self.iters, self.elementwise_bytes[-1] / nbytes)

    @classmethod
    def for_device(cls, device: torch.device) -> "BenchSizes":
        """Default sizes for ``device``'s kind."""
        if device.type == "cpu":
            # Four 4 MiB collectives take ~20 ms over gloo on loopback: the overlap benchmark ~0.9 s.
            return cls(1024, 64 * _MiB, 4 * _MiB, (256 * 1024, _MiB, 4 * _MiB), 64 * _MiB, 3,
                       overlap_collectives=4, overlap_rounds=8, matmul_dims=(128, 256, 512),
                       attention_shapes=((4, 4, 64, 64), (4, 4, 128, 64), (4, 4, 256, 64)),
                       elementwise_bytes=(256 * 1024, 2 * _MiB, 16 * _MiB),
                       host_update_numel=_MiB, host_update_chunks=4)  # 64 MiB of state
        # Chunks of 16M shard elements, 1 GiB of state: the shards of the chunks a 20-50B model is cut into.
        return cls(8192, 1024 * _MiB, 64 * _MiB, (2 * _MiB, 8 * _MiB, 32 * _MiB, 128 * _MiB), 512 * _MiB, 10,
                   overlap_collectives=8, overlap_rounds=10, matmul_dims=(1024, 2048, 4096),
                   attention_shapes=((8, 16, 512, 128), (8, 16, 1024, 128), (8, 16, 2048, 128)),
                   elementwise_bytes=(_MiB, 16 * _MiB, 256 * _MiB),
                   host_update_numel=16 * _MiB, host_update_chunks=4)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def time_s(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean seconds of ``fn`` over ``iters`` calls, after one warm-up call."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def fastest_s(calls: Sequence[tuple[Callable[[], object], int]], device: torch.device, blocks: int = 3) -> list[float]:
    """Seconds per call of each ``(fn, iters)``: the fastest of ``blocks`` blocks of its ``iters``
    calls, after one warm-up call each. The blocks of all ``calls`` take turns, so a burst of other
    work on the machine slows one block of several of them rather than every block of one; and such
    work only ever slows a block down."""
    for fn, _ in calls:
        fn()
    best = [float("inf")] * len(calls)
    for _ in range(blocks):
        for i, (fn, iters) in enumerate(calls):
            per_block = max(1, -(-iters // blocks))
            synchronize(device)
            start = time.perf_counter()
            for _ in range(per_block):
                fn()
            synchronize(device)
            best[i] = min(best[i], (time.perf_counter() - start) / per_block)
    return best


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, sizes: BenchSizes) -> float:
    """Dense square matmul throughput in ``dtype`` at ``sizes.matmul_dim``."""
    n = sizes.matmul_dim
    return 2 * n**3 / fastest_s([(_matmul_call(device, dtype, n), sizes.iters)], device)[0]


def op_overhead_s(device: torch.device, sizes: BenchSizes, dtype: torch.dtype = torch.float32) -> float:
    """Seconds per operator of a tiny training step: what every operator of a step costs however
    little it computes (see [Note: roofline] in cost.py).

    The step is forward and backward of four blocks ``x + gelu(linear(layer_norm(x)))`` on a 4 x 16
    batch, the forward under autocast in ``dtype`` unless float32 (as ``profile_model`` runs a
    step); its operators, autocast's casts included, are counted as the cost model counts them
    (views excluded)."""
    model = torch.nn.Sequential(*(_TinyBlock(16, device) for _ in range(4)))
    x = torch.ones(4, 16, device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)  # as a training step starts: no gradient to accumulate into
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x).float().square().mean()
        loss.backward()

    with _OpCounter() as counter:
        step()
    return fastest_s([(step, 3 * sizes.overhead_steps)], device)[0] / counter.ops


def matmul_points(device: torch.device, dtype: torch.dtype, sizes: BenchSizes) -> tuple[tuple[float, float], ...]:
    """(FLOPs of one call, FLOP/s) of square matmuls in ``dtype`` at ``sizes.matmul_sides()``, ascending."""
    sides = sizes.matmul_sides()
    seconds = fastest_s([(_matmul_call(device, dtype, n), sizes.matmul_iters(n)) for n in sides], device)
    return tuple((2.0 * n**3, 2.0 * n**3 / call_s) for n, call_s in zip(sides, seconds))


def attention_points(device: torch.device, dtype: torch.dtype, sizes: BenchSizes
                     ) -> tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]:
    """(forward, backward) points (FLOPs of one call, FLOP/s) of causal scaled dot product
    attention in ``dtype`` at ``sizes.attention_shapes``, the FLOPs by PyTorch's formulas (which
    count the full score matrix: a causal call does about half of that)."""
    calls = []
    for shape in sizes.attention_shapes:
        iters = sizes.attention_iters(shape)
        calls += [(fn, iters) for fn in _attention_calls(device, dtype, shape)]
    seconds = fastest_s(calls, device)
    forward, backward = [], []
    for shape, forward_s, both_s in zip(sizes.attention_shapes, seconds[::2], seconds[1::2]):
        backward_s = max(both_s - forward_s, both_s / 100)  # never 0 (timing noise)
        forward_flops = float(sdpa_flop_count(shape, shape, shape))
        backward_flops = float(sdpa_backward_flop_count(shape, shape, shape, shape))
        forward.append((forward_flops, forward_flops / forward_s))
        backward.append((backward_flops, backward_flops / backward_s))
    return tuple(forward), tuple(backward)


def elementwise_points(device: torch.device, dtype: torch.dtype, sizes: BenchSizes) -> tuple[tuple[float, float], ...]:
    """(Bytes one call reads and writes, bytes per second) of out-of-place elementwise and
    normalisation operators (add, GELU, layer norm, softmax: the operators of a transformer layer
    that are not matmuls; see ``_elementwise_round``), on tensors of ``sizes.elementwise_bytes`` in
    ``dtype``, ascending. The bytes are counted as the cost model counts them: every input and
    output tensor."""
    rounds = [_elementwise_call(device, dtype, nbytes) for nbytes in sizes.elementwise_bytes]
    iters = [sizes.elementwise_iters(nbytes) for nbytes in sizes.elementwise_bytes]
    seconds = fastest_s([(fn, n) for (_, fn), n in zip(rounds, iters)], device)
    return tuple((moved / 4, moved / round_s) for (moved, _), round_s in zip(rounds, seconds))  # 4 operators


def memory_bytes_per_s(device: torch.device, sizes: BenchSizes) -> float:
    """Device memory bandwidth: bytes read plus bytes written per second by a copy."""
    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * sizes.copy_bytes / time_s(lambda: dst.copy_(src), device, sizes.iters)


def host_transfer_bytes_per_s(device: torch.device, sizes: BenchSizes) -> tuple[float, float]:
    """(host-to-device, device-to-host) bandwidth through pinned host memory.

    On the CPU there is no transfer: this times a host copy (one direction's bytes per second).
    """
    nbytes = sizes.copy_bytes
    if device.type == "cpu":
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        copy_bytes_per_s = nbytes / time_s(lambda: dst.copy_(src), device, sizes.iters)
        return copy_bytes_per_s, copy_bytes_per_s
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / time_s(lambda: dev.copy_(host, non_blocking=True), device, sizes.iters)
    d2h = nbytes / time_s(lambda: host.copy_(dev, non_blocking=True), device, sizes.iters)
    return h2d, d2h


def collective_s(fn: Collective, out_bytes: int, in_bytes: int, device: torch.device, iters: int) -> float:
    """Mean seconds of ``fn(out, inp)`` on float32 buffers of the given sizes (multiples of 4)."""
    out = torch.empty(out_bytes // 4, dtype=torch.float32, device=device)
    inp = torch.ones(in_bytes // 4, dtype=torch.float32, device=device)
    return time_s(lambda: fn(out, inp), device, iters)


def comm_overlap(all_gather: Collective, reduce_scatter: Collective, world_size: int, device: torch.device,
                 dtype: torch.dtype, sizes: BenchSizes) -> float:
    """Fraction of a collective's time that compute running at the same time does not lose
    (see [Note: measuring communication overlap])."""
    communicate = _alternating_collectives(all_gather, reduce_scatter, world_size, device, sizes)
    sync = partial(all_gather, torch.empty(world_size, device=device), torch.zeros(1, device=device))
    step = _matmul_step(device, dtype, sizes.matmul_dim // 4)
    communicate()  # warm-up
    steps = max(1, round(_phase_s(communicate, sync, device) / time_s(step, device, 10)))
    rounds = [_overlap_round(communicate, step, steps, sync, device) for _ in range(sizes.overlap_rounds)]
    return statistics.median(rounds)


def hidden_fraction(comm_s: float, window_s: float, computed_s: float) -> float:
    """How much of a collective's time (``comm_s`` alone) compute did not lose while it ran: in a
    window of ``window_s`` the compute did ``computed_s`` of work (clamped to [0, 1])."""
    if comm_s <= 0.0:
        return 1.0
    return min(max(1.0 - (window_s - computed_s) / comm_s, 0.0), 1.0)


def local_copy(out: torch.Tensor, inp: torch.Tensor) -> None:
    """The world-size-1 stand-in for a collective: copy the input into (the start of) the output."""
    out[: inp.numel()].copy_(inp)


def nvme_bytes_per_s(path: str | os.PathLike, nbytes: int) -> tuple[float, float]:
    """(read, write) bandwidth of a file under ``path``, bypassing the page cache for the read."""
    block = os.urandom(8 * _MiB)
    fd, name = tempfile.mkstemp(prefix="elixir-bench-", dir=path)
    try:
        write_s = _timed(lambda: _write_file(fd, block, nbytes))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        read_s = _timed(lambda: _read_file(fd, len(block)))
    finally:
        os.close(fd)
        os.unlink(name)
    return nbytes / read_s, nbytes / write_s


def _alternating_collectives(all_gather: Collective, reduce_scatter: Collective, world_size: int,
                             device: torch.device, sizes: BenchSizes) -> Callable[[], None]:
    """``sizes.overlap_collectives`` all-gathers and reduce-scatters in turn, at the largest size."""
    shard_numel = sizes.collective_bytes[-1] // (4 * world_size)
    gathered = torch.empty(shard_numel * world_size, device=device)
    shard = torch.ones(shard_numel, device=device)
    grads = torch.ones(shard_numel * world_size, device=device)
    reduced = torch.empty(shard_numel, device=device)

    def communicate() -> None:
        for i in range(sizes.overlap_collectives):
            if i % 2 == 0:
                all_gather(gathered, shard)
            else:
                reduce_scatter(reduced, grads)

    return communicate


def _scaled_iters(iters: int, factor: float) -> int:
    """``iters`` times ``factor``, rounded, at least ``iters`` and at most 10,000."""
    return max(iters, min(10_000, round(iters * factor)))


def _attention_work(shape: tuple[int, int, int, int]) -> int:
    """Proportional to the FLOPs of attention at (batch, heads, sequence, head dim)."""
    batch, heads, seq, head_dim = shape
    return batch * heads * seq * seq * head_dim


class _TinyBlock(torch.nn.Module):
    """``x + gelu(linear(layer_norm(x)))``: a residual block of the overhead benchmark's step."""

    def __init__(self, width: int, device: torch.device) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, device=device)
        self.linear = torch.nn.Linear(width, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.linear(self.norm(x)))


class _OpCounter(TorchDispatchMode):
    """Counts the operators that run under it, views excluded (as the cost model charges them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _attention_calls(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int]
                     ) -> tuple[Callable[[], object], Callable[[], object]]:
    """(forward, forward and backward) of causal attention on ``shape`` queries, keys and values."""
    q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.ones(shape, device=device, dtype=dtype)

    def attend() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def attend_and_back() -> None:
        q.grad = k.grad = v.grad = None
        attend().backward(grad)

    return attend, attend_and_back


def _elementwise_round(a: torch.Tensor, b: torch.Tensor, a32: torch.Tensor) -> None:
    """The elementwise benchmark's operators, as a mixed-precision step runs them: add and GELU in
    the compute dtype, layer norm and softmax in float32 (autocast's policy for them)."""
    torch.add(a, b)
    torch.nn.functional.gelu(a)
    torch.nn.functional.layer_norm(a32, a32.shape[-1:])
    torch.softmax(a32, -1)


def _elementwise_call(device: torch.device, dtype: torch.dtype, nbytes: int) -> tuple[int, Callable[[], None]]:
    """(Bytes read and written, the call) of one ``_elementwise_round`` on ``nbytes`` tensors of the
    compute dtype."""
    width = 256
    rows = max(1, nbytes // (width * dtype.itemsize))
    a32 = torch.linspace(-4.0, 4.0, rows * width, device=device).view(rows, width)  # cheaper than random
    a, b = a32.to(dtype), a32.flip(0).to(dtype)
    moved = 3 * a.nbytes + 2 * a.nbytes + 2 * a32.nbytes + 2 * a32.nbytes  # add, gelu, layer_norm, softmax
    return moved, partial(_elementwise_round, a, b, a32)


def _matmul_call(device: torch.device, dtype: torch.dtype, n: int) -> Callable[[], torch.Tensor]:
    """An ``n`` x ``n`` matmul in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return partial(torch.mm, a, b)


def _matmul_step(device: torch.device, dtype: torch.dtype, n: int) -> Callable[[], None]:
    """One ``n`` x ``n`` matmul in ``dtype`` on the current stream, waited for."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty_like(a)

    def step() -> None:
        torch.mm(a, b, out=out)
        if device.type != "cpu":
            torch.accelerator.current_stream(device).synchronize()

    return step


def _repeat(fn: Callable[[], object], times: int) -> None:
    """Call ``fn`` ``times`` times."""
    for _ in range(times):
        fn()


def _phase_s(fn: Callable[[], object], sync: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, started after ``sync`` (every rank at once) and an idle device."""
    sync()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _overlap_round(communicate: Callable[[], None], step: Callable[[], None], steps: int,
                   sync: Callable[[], object], device: torch.device) -> float:
    """One estimate of the overlap: matmul steps alone, the collectives alone, then both at once."""
    step_s = _phase_s(partial(_repeat, step, steps), sync, device) / steps
    comm_s = _phase_s(communicate, sync, device)
    sync()
    synchronize(device)
    window_s, done = _steps_while(communicate, step, device)
    return hidden_fraction(comm_s, window_s, done * step_s)


def _steps_while(background: Callable[[], None], step: Callable[[], None], device: torch.device) -> tuple[float, int]:
    """Seconds ``background`` takes in a thread (on its own stream on an accelerator), and how many
    times ``step`` ran in this thread meanwhile."""
    done = threading.Event()
    errors: list[BaseException] = []
    device = indexed(device)

    def run() -> None:
        try:
            use_device(device)
            _run_on_side_stream(background, device)
        except BaseException as err:  # re-raised in the caller's thread
            errors.append(err)
        finally:
            done.set()

    thread = threading.Thread(target=run, name="elixir-bench-comm", daemon=True)
    steps, start = 0, time.perf_counter()
    thread.start()
    try:
        while not done.is_set():
            step()
            steps += 1
    finally:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start, steps


def _run_on_side_stream(fn: Callable[[], None], device: torch.device) -> None:
    """``fn()`` on a stream of its own, waited for (on the CPU: just ``fn()``)."""
    if device.type == "cpu":
        fn()
        return
    stream = torch.Stream(device)
    with stream:
        fn()
    stream.synchronize()


def _timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (at least a nanosecond)."""
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-9)


def _write_file(fd: int, block: bytes, nbytes: int) -> None:
    """Write ``nbytes`` of ``block`` repeats and flush them to the device."""
    for _ in range(nbytes // len(block)):
        os.write(fd, block)
    os.fsync(fd)


def _read_file(fd: int, block_bytes: int) -> None:
    """Read the file back from the start."""
    os.lseek(fd, 0, os.SEEK_SET)
    while os.read(fd, block_bytes):
        pass
