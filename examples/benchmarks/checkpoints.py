"""Checkpoint save and load of the example GPT at world size 2: the full format against the sharded one.

    python examples/benchmarks/checkpoints.py           # GPT ~63M parameters, ~2 minutes on 2 cores, < 5 GB
    python examples/benchmarks/checkpoints.py --quick   # GPT ~2M parameters, under a minute

Two spawned gloo ranks (one CPU thread each) build ``ElixirRuntime(model, ElixirPlan(chunk_numel=...,
cache_blocks="all"))`` and an AdamW set up by ``shard_optimizer``, and take one training step so that
the optimizer state exists. Then, per format:

- "full": what ``ElixirStrategy(state_dict_type="full")`` does: every rank builds the checkpoint's
  structure with deferred tensors (``deferred_state_dict``, ``deferred_optimizer_state_dict``) and
  gathers chunk by chunk (``deferred_records``); rank 0 writes each gathered tensor into the file
  as it comes (``write_torch_file``, [Note: streamed full checkpoints]). Loading, every rank
  ``torch.load``s that file and calls ``load_full_state_dict`` and ``load_full_optimizer_state_dict``.
- "full-dict": the same file written as before streaming: rank 0 keeps ``full_state_dict`` and
  ``full_optimizer_state_dict`` whole and ``torch.save``s them (the peers' way; for comparison).
- "sharded": ``save_sharded`` and ``load_sharded`` on a directory (torch.distributed.checkpoint).

Between save and load the ranks take one more training step, so that a load has something to undo;
"restored" says whether every rank's masters and optimizer state afterwards equal those saved.

Times are wall seconds from a barrier before the call to a barrier after it (the slowest rank), the
fastest of ``--repeats``. A load reads files just written, so mostly from the page cache, not the disk.

Memory: a background thread samples the process's resident set (/proc/self/statm) every
``--sample-ms`` while a save or load runs; "extra peak" is that peak less the resident set just
before the call (after ``gc.collect`` and ``malloc_trim``, so that freed heap the call could reuse
is not counted as held). The kernel's own high-water mark (VmHWM, reset through
/proc/self/clear_refs) is reported next to it where the kernel allows the reset: it sees spikes
shorter than the sampling period. The stated goal for the full format is an extra peak of at most
one chunk per rank; the largest chunk's fp32 size is the yardstick.

The resident set is what the kernel charges, which is not only live tensors: glibc raises its mmap
threshold to the size of a freed mmap'd block (up to 32 MiB), after which chunk-sized buffers come
from the heap and stay resident when freed. So each measurement runs twice, in fresh ranks: with
glibc's defaults (what a training process gets) and with ``MALLOC_MMAP_THRESHOLD_`` fixed at
``--mmap-threshold-mib`` (every larger block is mmap'd and unmapped when freed, so the resident
set follows the live tensors). Nothing is asserted on timings.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_elixir.demos.gpt import GPT, GPTConfig  # noqa: E402
from lightning_elixir.plan import ElixirPlan  # noqa: E402
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer  # noqa: E402
from lightning_elixir.runtime.runtime import ElixirRuntime  # noqa: E402
from lightning_elixir.runtime.sharded import load_sharded, save_sharded  # noqa: E402
from lightning_elixir.runtime.full_file import drain, write_torch_file  # noqa: E402
from lightning_elixir.runtime.state_dict import (deferred_optimizer_state_dict, deferred_records,  # noqa: E402
                                                 deferred_state_dict, full_optimizer_state_dict, full_state_dict,
                                                 load_full_optimizer_state_dict, load_full_state_dict)
from tests.distributed import run_distributed  # noqa: E402

MiB = 1 << 20
WORLD_SIZE = 2
FP32_BYTES = 4
ADAMW_STATES = 2
"""Per-element AdamW state: exp_avg and exp_avg_sq (``step`` is one scalar per parameter)."""
FORMATS = ("full", "full-dict", "sharded")
# Defaults of the options left unset, per --quick. The default chunk holds about one transformer block
# of the default GPT (12 x 768^2 ~ 7.1M elements) and the tied embedding (8192 x 768 ~ 6.3M).
SIZES = {
    False: dict(n_layer=8, n_embd=768, n_head=12, vocab_size=8192, block_size=256, chunk_numel=8_000_000),
    True: dict(n_layer=2, n_embd=256, n_head=4, vocab_size=2048, block_size=128, chunk_numel=1_000_000),
}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small GPT, for a run of seconds")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--chunk-numel", type=int, help="capacity of a chunk (8M; quick 1M)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank in the training steps")
    p.add_argument("--repeats", type=int, default=1, help="saves and loads per format; the fastest counts")
    p.add_argument("--sample-ms", type=float, default=5.0, help="period of the resident-set sampler")
    p.add_argument("--dir", help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--malloc", choices=("both", "default", "fixed"), default="both",
                   help="glibc's default mmap threshold, a fixed one, or one run of each")
    p.add_argument("--mmap-threshold-mib", type=float, default=1.0, help="the fixed mmap threshold")
    args = p.parse_args(argv)
    for key, value in SIZES[args.quick].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ---- memory -------------------------------------------------------------------------------------


def _rss_bytes(fd: int) -> int:
    """Resident set of this process, from an open /proc/self/statm (its second field, in pages)."""
    return int(os.pread(fd, 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_hwm() -> bool:
    """Reset VmHWM to the current resident set; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _trim_heap() -> None:
    """Hand freed heap back to the kernel, so that the baseline holds only live memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the baseline may hold reusable free memory
        pass


class RssSampler:
    """Peak resident set over a ``with`` block, sampled on a background thread."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.fd = os.open("/proc/self/statm", os.O_RDONLY)
        self.before_bytes = self.peak_bytes = _rss_bytes(self.fd)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, _rss_bytes(self.fd))
            self._stop.wait(self.period_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, _rss_bytes(self.fd))
        os.close(self.fd)


def measure(fn: Callable[[], None], period_s: float) -> dict[str, Any]:
    """Run ``fn`` on every rank between barriers: its wall seconds, resident set before and extra peaks."""
    _trim_heap()
    hwm = _reset_hwm()
    with RssSampler(period_s) as rss:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - start
    return {"s": seconds, "before_bytes": rss.before_bytes, "extra_bytes": rss.peak_bytes - rss.before_bytes,
            "hwm_extra_bytes": _hwm_bytes() - rss.before_bytes if hwm else None}


# ---- one rank -----------------------------------------------------------------------------------


def train_step(model: GPT, runtime: ElixirRuntime, optimizer: torch.optim.Optimizer, args, seed: int) -> None:
    """One forward, backward and ``optimizer_step`` on a random batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(args.vocab_size, (args.batch_size, args.block_size), generator=g)
    logits = model(x)
    F.cross_entropy(logits.view(-1, logits.size(-1)), torch.roll(x, -1, dims=1).view(-1)).backward()
    optimizer_step(runtime, optimizer)
    optimizer.zero_grad()


def snapshot(runtime: ElixirRuntime, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's masters and per-element optimizer state, copied."""
    masters = [chunk.master.clone() for chunk in runtime.chunks]
    # In parameter order, not ``optimizer.state``'s: a load re-inserts the entries in another order.
    states = [v.clone() for group in optimizer.param_groups for p in group["params"]
              for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]
    return masters + states


def _save_full(runtime, optimizer, file: str) -> None:
    """Gather chunk by chunk on every rank; rank 0 writes each gathered tensor as it comes."""
    state = {"model": deferred_state_dict(runtime), "optimizer": deferred_optimizer_state_dict(runtime, optimizer, 0)}
    records = deferred_records(runtime, [optimizer], state)
    if runtime.group.rank == 0:
        with open(file, "wb") as f:
            write_torch_file(state, records, f)
    drain(records)


def _save_full_dict(runtime, optimizer, file: str) -> None:
    """Gather on every rank; rank 0 keeps both state dicts and writes one file."""
    state = {"model": full_state_dict(runtime), "optimizer": full_optimizer_state_dict(runtime, optimizer)}
    if runtime.group.rank == 0:
        torch.save(state, file)


def _load_full(runtime, optimizer, file: str) -> None:
    """Every rank reads the whole file and loads its shards from it."""
    state = torch.load(file, map_location="cpu", weights_only=True)
    load_full_state_dict(runtime, state["model"])
    load_full_optimizer_state_dict(runtime, optimizer, state["optimizer"])


def _disk_bytes(path: str) -> int:
    """Size of a file, or of every file under a directory."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def bench_format(model: GPT, runtime: ElixirRuntime, optimizer, args, save: Callable, load: Callable,
                 path: str, step: int) -> dict[str, Any]:
    """``--repeats`` rounds of save, a training step, load; the fastest save and load, and whether loads restored."""
    runs, restored = [], True
    for _ in range(args.repeats):
        saved = snapshot(runtime, optimizer)
        save_m = measure(lambda: save(path), args.sample_ms / 1e3)
        step += 1
        train_step(model, runtime, optimizer, args, step)  # so that the load has something to undo
        load_m = measure(lambda: load(path), args.sample_ms / 1e3)
        restored &= _same(saved, snapshot(runtime, optimizer))
        del saved
        runs.append((save_m, load_m))
    dist.barrier()
    return {"save": min((s for s, _ in runs), key=lambda m: m["s"]),
            "load": min((m for _, m in runs), key=lambda m: m["s"]), "restored": restored,
            "disk_bytes": _disk_bytes(path) if runtime.group.rank == 0 else None, "step": step}


def bench_rank(rank: int, world_size: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """One rank: build and train the GPT one step, then save and load it in each format."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=0.0)
    model = GPT(config)
    params_numel = sum(p.numel() for p in model.parameters())  # tied weights count once
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=args.chunk_numel, cache_blocks="all"))
    optimizer = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-4))
    train_step(model, runtime, optimizer, args, seed=0)
    ops = {"full": (lambda p: _save_full(runtime, optimizer, p), lambda p: _load_full(runtime, optimizer, p),
                    os.path.join(root, "full.pt")),
           "full-dict": (lambda p: _save_full_dict(runtime, optimizer, p), lambda p: _load_full(runtime, optimizer, p),
                         os.path.join(root, "full-dict.pt")),
           "sharded": (lambda p: save_sharded(runtime, [optimizer], p),
                       lambda p: load_sharded(runtime, [optimizer], p), os.path.join(root, "sharded"))}
    out, step = {}, 0
    for name in FORMATS:
        out[name] = bench_format(model, runtime, optimizer, args, *ops[name], step)
        step = out[name]["step"]
    chunk_numels = [chunk.numel for chunk in runtime.chunks]
    runtime.restore_module()
    return {"formats": out, "params_numel": params_numel, "chunk_numel": max(chunk_numels),
            "chunks": len(chunk_numels)}


# ---- report -------------------------------------------------------------------------------------


def print_table(header: tuple, rows: list[tuple]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    print()


def _mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _extra(m: dict[str, Any]) -> int:
    """The extra peak used for the verdict: the larger of the sampled one and the kernel's."""
    return max(m["extra_bytes"], m["hwm_extra_bytes"] or 0)


def report(args: argparse.Namespace, ranks: list[dict[str, Any]], title: str) -> None:
    r0 = ranks[0]
    model_bytes = r0["params_numel"] * FP32_BYTES
    chunk_bytes = r0["chunk_numel"] * FP32_BYTES
    print(f"## {title}\n")
    rows = []
    for name in FORMATS:
        per = [r["formats"][name] for r in ranks]
        rows.append((name, f"{max(p['save']['s'] for p in per):.2f}", f"{max(p['load']['s'] for p in per):.2f}",
                     _mib(per[0]["disk_bytes"]), *(_mib(p["save"]["extra_bytes"]) for p in per),
                     _mib(chunk_bytes), _mib(model_bytes), "yes" if all(p["restored"] for p in per) else "NO"))
    print_table(("format", "save s", "load s", "checkpoint on disk MiB", "rank 0 extra peak MiB",
                 "rank 1 extra peak MiB", "chunk MiB", "model fp32 MiB", "restored"), rows)
    print(f"Extra resident memory per rank against \"extra peak <= one chunk per rank\" (chunk "
          f"{_mib(chunk_bytes)} MiB, model {_mib(model_bytes)} MiB, AdamW state {_mib(ADAMW_STATES * model_bytes)} "
          f"MiB); the verdict takes the larger of sampled and VmHWM:\n")
    rows = []
    for name in FORMATS:
        for op in ("save", "load"):
            for rank, r in enumerate(ranks):
                m = r["formats"][name][op]
                rows.append((name, op, rank, _mib(m["before_bytes"]), _mib(m["extra_bytes"]),
                             _mib(m["hwm_extra_bytes"]), f"{_extra(m) / chunk_bytes:.2f}",
                             "met" if _extra(m) <= chunk_bytes else "NOT met"))
    print_table(("format", "op", "rank", "RSS before MiB", "extra peak MiB (sampled)", "extra peak MiB (VmHWM)",
                 "extra / chunk", "<= one chunk"), rows)
    for rank, r in enumerate(ranks):
        m = r["formats"]["full"]["save"]
        verdict = "met" if _extra(m) <= chunk_bytes else "NOT met"
        print(f"- full format save, rank {rank}: extra peak {_mib(_extra(m))} MiB = {_extra(m) / chunk_bytes:.2f} "
              f"chunks; goal {verdict}")
    print()


def run_ranks(args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    """``bench_rank`` on fresh spawned ranks that start with ``env`` added to the environment."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read by glibc when each spawned interpreter starts
    root = tempfile.mkdtemp(prefix="bench-checkpoints-", dir=args.dir)
    try:
        return run_distributed(bench_rank, WORLD_SIZE, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def allocator_settings(args: argparse.Namespace) -> list[tuple[str, dict[str, str]]]:
    """(title, environment) of each allocator setting to run."""
    threshold_bytes = int(args.mmap_threshold_mib * MiB)
    settings = {"default": ("glibc malloc defaults (dynamic mmap threshold)", {}),
                "fixed": (f"MALLOC_MMAP_THRESHOLD_={threshold_bytes} ({args.mmap_threshold_mib:g} MiB): "
                          "freed large blocks are unmapped", {"MALLOC_MMAP_THRESHOLD_": str(threshold_bytes)})}
    return list(settings.values()) if args.malloc == "both" else [settings[args.malloc]]


def main(argv=None) -> None:
    args = _parse(argv)
    load_avg = os.getloadavg()[0]
    start = time.perf_counter()
    results = [(title, run_ranks(args, env)) for title, env in allocator_settings(args)]
    r0 = results[0][1][0]
    print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} vocab={args.vocab_size} "
          f"block={args.block_size}: {r0['params_numel'] / 1e6:.1f}M parameters; {WORLD_SIZE} gloo ranks on CPU "
          f"(1 thread each), fp32, AdamW; chunk_numel={args.chunk_numel}, {r0['chunks']} chunks, "
          f"cache_blocks=\"all\"; times: slowest rank, fastest of {args.repeats}; 1-minute load average before: "
          f"{load_avg:.2f}; total {time.perf_counter() - start:.0f} s\n")
    for title, ranks in results:
        report(args, ranks, title)


if __name__ == "__main__":
    main()
