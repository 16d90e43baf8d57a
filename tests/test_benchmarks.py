"""The benchmark harness: its reduced run end to end, and how it turns rank results into rows and tables."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from examples.benchmarks import harness
from examples.benchmarks.harness import REDUCED_SYSTEMS
from examples.benchmarks.harness_rank import classify, profile_tables
from examples.benchmarks.harness_report import largest_sizes, markdown_table
from examples.benchmarks.harness_systems import WORKLOADS, NotInstallable, flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILURES = ("OOM", "failed", "not installable")


def _rank(step_s: float, **extra) -> dict:
    """One rank's results as a worker writes them."""
    return {"times_s": [step_s] * 3, "cpu_s": [0.9 * step_s] * 3, "losses": [5.0, 4.0], "n_params": 1000, "note": "", "device_name": "cpu",
            "peak_host_bytes": 2**30, "peak_device_bytes": None, **extra}


def _args() -> Namespace:
    return harness.parse_args(["--reduced"])


def test_summarise_takes_the_slowest_rank_and_counts_every_rank_s_tokens():
    args = _args()
    row = harness.summarise(args, [_rank(0.1), _rank(0.3)])
    assert row["status"] == "ok"
    assert row["step_s"] == pytest.approx(0.3)
    tokens = args.batch_size * args.block_size * args.devices
    assert row["tokens_per_s"] == pytest.approx(tokens / 0.3)


def test_summarise_names_a_run_by_its_most_telling_failure():
    args = _args()
    oom = {"error": {"status": "OOM", "reason": "OutOfMemoryError: CUDA out of memory"}}
    hung = {"error": {"status": "failed", "reason": "DistBackendError: connection reset"}}
    assert harness.summarise(args, [hung, oom])["status"] == "OOM"
    assert harness.summarise(args, [_rank(0.1), hung]) == hung["error"]


def test_classify_sorts_errors_into_the_table_s_words():
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))["status"] == "OOM"
    assert classify(NotInstallable("No module named 'deepspeed'"))["status"] == "not installable"
    failed = classify(ValueError("bad\nsecond line"))
    assert failed == {"status": "failed", "reason": "ValueError: bad"}


def test_gpu_rows_carry_tflops_and_mfu_from_the_flop_count():
    args = harness.parse_args(["--accelerator=gpu", "--devices=1", "--size=small", "--peak-tflops=100"])
    row = harness.summarise(args, [_rank(0.5, device_name="NVIDIA H200", peak_device_bytes=3 * 2**30)])
    tokens = args.batch_size * args.block_size
    flops = flops_per_token(1000, 12, 768, args.block_size) * tokens
    assert row["tflops"] == pytest.approx(flops / 0.5 / 1e12)
    assert row["mfu"] == pytest.approx(flops / 0.5 / 100e12)
    rows = [{"workload": "gpt", "budget": None, "system": s, **row} for s in ("ddp", "elixir")]
    table = markdown_table(args, rows)
    assert "| MFU |" in table.splitlines()[0] and f"{row['mfu']:.1%}" in table


def test_table_keeps_failed_rows_and_ratios_against_ddp_and_the_best_peer():
    args = _args()
    ok = harness.summarise(args, [_rank(0.2)])
    rows = [{"workload": "gpt", "budget": None, "system": "ddp", **ok},
            {"workload": "gpt", "budget": None, "system": "fsdp2", **harness.summarise(args, [_rank(0.1)])},
            {"workload": "gpt", "budget": None, "system": "elixir_zero2", **harness.summarise(args, [_rank(0.4)])},
            {"workload": "gpt", "budget": None, "system": "deepspeed_zero2", "status": "not installable",
             "reason": "import deepspeed: No module named 'deepspeed'"}]
    rows[0]["rounds"], rows[2]["rounds"] = [0.2, 0.3], [0.4, 0.25]  # per round: 0.5x and 1.2x DDP
    table = markdown_table(args, rows)
    header = table.splitlines()[0].strip("| ").split(" | ")
    elixir = next(line for line in table.splitlines() if line.startswith("| elixir_zero2 |")).strip("| ").split(" | ")
    cell = dict(zip(header, elixir))
    assert (cell["vs ddp"], cell["vs best peer"]) == ("0.50", "0.25")  # half DDP's tokens/s, a quarter of fsdp2's
    assert cell["vs ddp, paired"] == "0.85"  # the median of the rounds' ratios
    assert cell["CPU ms"] == "360"
    assert "| deepspeed_zero2 | not installable: import deepspeed" in table
    assert "best peer: fsdp2" in table


def test_profile_tables_list_labels_and_operators():
    import torch
    from torch.profiler import profile, record_function

    with profile() as prof:
        with record_function("bench::matmul"):
            torch.randn(64, 64) @ torch.randn(64, 64)
    text = profile_tables(prof, on_gpu=False)
    labels, ops = text.split("operators:")
    assert "bench::matmul" in labels and "aten::mm" in ops and "aten::mm" not in labels


def test_reduced_run_reports_every_system_and_workload(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, os.path.join("examples", "benchmarks", "harness.py"), "--reduced",
                           "--json", str(out), "--run-timeout", "300"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    for workload in WORKLOADS:
        assert f"## {workload}:" in proc.stdout
        for system in REDUCED_SYSTEMS:
            row = next(r for r in results if (r["workload"], r["system"]) == (workload, system))
            if row["status"] == "ok":
                assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
                assert math.isfinite(row["loss_last"])
            else:
                assert row["status"] in FAILURES and row["reason"], row
        table = proc.stdout.split(f"## {workload}:")[1]
        assert all(f"| {system} |" in table for system in REDUCED_SYSTEMS)


def test_search_quality_runs_the_self_correction_and_compares_memory_for_llama():
    proc = subprocess.run([sys.executable, os.path.join("examples", "benchmarks", "search_quality.py"), "--model",
                           "llama", "--n-layer", "1", "--rounds", "1", "--warmup-steps", "2", "--timed-steps", "1",
                           "--calibration-steps", "1", "--chunk-sizes", "1", "--block-points", "2", "--prefetch", "0",
                           "--skip-20b"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for section in ("self-correction per budget", "corrected/best", "profiles calibrated on the chosen plan",
                    "runtime-held peak of one step"):
        assert section in out, out
    summary = next(line for line in out.splitlines() if line.startswith("over all "))
    assert "pred/meas" in summary and "goal within 5%" in summary


def test_overhead_compares_the_runtime_with_the_plain_module_at_world_size_one(capsys):
    from examples.benchmarks import overhead

    overhead.main(["--model", "llama", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab-size", "64",
                   "--block-size", "16", "--batch-size", "2", "--steps", "1", "--rounds", "1", "--top", "1000"])
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert {"plain", "zero2", "zero3"} <= set(rows)
    assert "| Elixir::pre_forward | 0.0 |" in out  # the runtime's hooks are listed, and cost nothing in plain
    assert "a sharded optimizer on 2 ranks saves" in out


def test_collectives_benchmark_prints_both_tables_with_every_collective():
    proc = subprocess.run([sys.executable, "examples/benchmarks/collectives.py", "--sizes-mib", "0.25", "--calls", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 0.25 MiB |")]
    assert len(rows) == 2, proc.stdout
    assert all(len(row.split(" | ")) == 5 and "nan" not in row for row in rows)  # 4 collectives each, all timed
    for name in ("reduce_scatter_tensor", "exchange + add", "exchange, reused buffers", "all-reduce", "all-gather"):
        assert name in proc.stdout


def test_size_grid_stops_at_the_first_size_out_of_memory_and_reports_the_largest_that_trained(monkeypatch):
    args = harness.parse_args(["--accelerator=gpu", "--devices=1", "--sizes=small,medium,2x64x4",
                               "--budgets=16GB,80GB", "--systems=ddp,elixir", "--workloads=gpt"])
    assert [s[0] for s in args.size_list] == ["small", "medium", "2x64x4"]
    ran = []

    def fake_run(shaped, argv, system, workload, budget):  # ddp runs out of memory from medium on under 16 GB
        ran.append((shaped.n_layer, system, budget))
        if system == "ddp" and budget == "16GB" and shaped.n_layer > 12:
            return {"status": "OOM", "reason": "OutOfMemoryError"}, ""
        return harness.summarise(shaped, [_rank(0.1, device_name="NVIDIA H200", peak_device_bytes=2**30)]), ""

    monkeypatch.setattr(harness, "run_system", fake_run)
    rows = harness.run_grid(args, [])
    assert (2, "ddp", "16GB") not in ran and (2, "ddp", "80GB") in ran  # not run past its first OOM
    skipped = next(r for r in rows if (r["size"], r["system"], r["budget"]) == ("2x64x4", "ddp", "16GB"))
    assert skipped["status"] == "OOM" and skipped["reason"] == "not run: OOM at medium"
    assert {(r["size"], r["n_layer"], r["n_embd"]) for r in rows} == {("small", 12, 768), ("medium", 24, 1024),
                                                                      ("2x64x4", 2, 64)}
    table = largest_sizes(args, rows)
    assert "| ddp | small | 2x64x4 |" in table and "| elixir | 2x64x4 | 2x64x4 |" in table


def test_sizes_refuse_a_shape_they_cannot_read():
    with pytest.raises(SystemExit):
        harness.parse_args(["--sizes=medium,huge"])
    with pytest.raises(SystemExit):
        harness.parse_args(["--size=small", "--sizes=medium"])


def test_step_timer_keeps_the_run_s_device_peak_across_the_monitor_s_resets(monkeypatch):
    """Elixir's monitor resets the allocator's peak at every step's start: the timer reads it after setup and
    after every step, so the row's peak is the run's (as for DDP), not the last step's."""
    from types import SimpleNamespace

    import torch

    from examples.benchmarks import harness_rank

    readings = iter([900, 300, 400, 250, 250])  # after setup, after each of three steps, at the end
    monkeypatch.setattr(harness_rank, "_device_peak", lambda device: next(readings))
    timer = harness_rank._timed_callback(Namespace(profile=None, warmup=0, profile_steps=0))
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), runtime=None))
    timer.on_train_start(trainer, None)
    for step in range(3):
        timer.on_train_batch_start(trainer, None, None, step)
        timer.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, step)
    timer.on_train_end(trainer, None)
    assert timer.peaks["peak_device_bytes"] == 900
    assert timer.peaks["peak_host_bytes"] > 0
