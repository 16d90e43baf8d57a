"""What out-of-memory recovery costs on the CPU: a recovered step against a normal one, and the per-micro-batch snapshot.

    python examples/benchmarks/oom_recovery.py
    python examples/benchmarks/oom_recovery.py --steps 10 --fail-at 6

1. The snapshot every micro-batch takes while recovery is on ([Note: recovering from out of memory]:
   random states, persistent buffers, metric states, logged results), timed alone on the
   launch-bound GPT of host_overhead.py (24 layers of width 64), where per-call costs show.
2. Two gloo ranks fit the demo GPT with plan="auto" under an emulated device budget
   ([Note: emulated device memory]) that drops at step ``--fail-at`` to 90% of the peak the steps
   before measured: that step runs out of memory on both ranks and is redone under a smaller plan.
   The table gives the median normal step, the recovered step (everything: the failed attempt, the
   agreement, the re-plan, the switch, the redo) and the steps after it under the new plan. Every
   step runs under the emulated budget's dispatch-mode count, so all of them are slower than
   without it; compare them with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_elixir import ElixirStrategy
from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir.recovery import StepSnapshot, state_slots
from lightning_elixir.runtime.emulated import active, emulated_device_memory

CONFIG = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.1, bias=False)
LAUNCH_BOUND = GPTConfig(vocab_size=256, block_size=32, n_layer=24, n_head=2, n_embd=64, bias=False)
BATCH = 4


class _GPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(CONFIG)

    def train_dataloader(self):
        data = torch.randint(CONFIG.vocab_size, (512, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=BATCH)

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), batch[:, 1:].reshape(-1))
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Times(Callback):
    def __init__(self) -> None:
        self.rows: list[list] = []
        self._start = 0.0
        self.plan = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        memory = active()
        self.rows.append([trainer.global_step, time.perf_counter() - self._start, memory.peak if memory else 0])

    def on_train_end(self, trainer, pl_module) -> None:
        self.plan = trainer.strategy.describe_running()


def _fit(rank: int, port: int, out: str, steps: int, limit: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    times = _Times()
    strategy = ElixirStrategy(plan="auto", device_memory_limit=64 << 20, replan=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=out, callbacks=[times])
    error = None
    try:
        with emulated_device_memory({int(k): v for k, v in limit.items()}):
            trainer.fit(_GPT())
    except Exception as err:  # reported in the table
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    recovery = strategy.recovery
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps({
            "rows": times.rows, "error": error,
            "attempts": [[a.step, a.where, a.plan, a.overshoot_bytes] for a in recovery.attempts] if recovery else [],
            "plan": times.plan}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(steps: int, limit: dict) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_fit, args=(_free_port(), out, steps, limit), nprocs=2, start_method="spawn")
        return json.loads(Path(out, "result.json").read_text())


def snapshot_us(repeats: int = 200) -> float:
    model = GPT(LAUNCH_BOUND)
    where = state_slots(model)
    took = []
    for _ in range(repeats):
        start = time.perf_counter()
        StepSnapshot.take(model, None, False, where)
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fail-at", type=int, default=5)
    args = parser.parse_args()
    print(f"snapshot per micro-batch, launch-bound GPT (24 x 64): {snapshot_us():.0f} us")
    roomy = _run(args.fail_at - 1, {1: 1 << 40})
    peak = max(r[2] for r in roomy["rows"])
    limit = int(0.9 * peak)
    run = _run(args.steps, {1: 1 << 40, args.fail_at: limit})
    rows = run["rows"]
    normal = [t for step, t, _ in rows if step not in (1, args.fail_at)]
    before = [t for step, t, _ in rows if 1 < step < args.fail_at]
    after = [t for step, t, _ in rows if step > args.fail_at]
    recovered = [t for step, t, _ in rows if step == args.fail_at]
    print(f"demo GPT {CONFIG.n_layer} x {CONFIG.n_embd}, batch {BATCH} x {CONFIG.block_size}, 2 gloo ranks; emulated "
          f"budget {peak:,} B until step {args.fail_at - 1}, then {limit:,} B")
    if run["error"]:
        print(f"the run ended with {run['error']}")
    for a in run["attempts"]:
        print(f"recovery at step {a[0]} ({a[1]}): ran {a[2]}, short by {a[3]:,} B")
    print(f"ended on {run['plan']}")
    print("| steps | median ms |\n|---|---|")
    for name, values in (("normal (first plan)", before), ("recovered step", recovered),
                         ("after (smaller plan)", after), ("all normal", normal)):
        if values:
            print(f"| {name} | {statistics.median(values) * 1e3:.1f} |")
    if recovered and before:
        print(f"recovered step / normal step: {recovered[0] / statistics.median(before):.2f}x "
              f"(+{(recovered[0] - statistics.median(before)) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
