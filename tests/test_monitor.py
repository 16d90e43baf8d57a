"""The planning callback through the CLI: TensorBoard tags, predicted vs measured timelines, the saved plan."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import torch

from lightning_elixir import ElixirMonitor, ElixirPlan
from tests.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS = 5
_LAUNCH_VARIABLES = {"LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}


def _fit(root: Path, steps: int, *args: str) -> str:
    """``lightning-elixir fit --config configs/gpt_cpu.yaml`` for ``steps`` steps on 2 CPU processes; its output."""
    # Without the launch variables earlier in-process fits leave behind: with LOCAL_RANK set, Lightning
    # takes the processes for launched externally and rank 0 waits for a rank 1 nobody starts.
    # Nor PYTHONPATH, and from a directory outside the repository: the config's classes (the package's
    # demos) resolve wherever the installed package is run.
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES | {"PYTHONPATH"}}
    env.update(MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-m", "lightning_elixir.cli", "fit", "--config",
                           str(REPO / "configs/gpt_cpu.yaml"), f"--trainer.max_steps={steps}",
                           "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
                           f"--trainer.default_root_dir={root}", *args],
                          cwd=root, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """``lightning-elixir fit --config configs/gpt_cpu.yaml --trainer.max_steps 5`` on 2 CPU processes."""
    root = tmp_path_factory.mktemp("monitor")
    output = _fit(root, STEPS)
    (events,) = glob.glob(str(root / "lightning_logs" / "version_0" / "events.out.tfevents.*"))
    accumulator = EventAccumulator(events, size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    accumulator.Reload()
    return {"root": root, "logs": root / "lightning_logs" / "version_0", "events": accumulator, "output": output}


def test_planning_reports_progress_in_a_few_lines(cpu_run):
    lines = [line for line in cpu_run["output"].splitlines() if line.startswith("Elixir:")]
    assert 3 <= len(lines) <= 5, lines
    assert "planned in" in lines[1] and "chose chunk=" in lines[2] and "budget per rank" in lines[3]


def _series(events: EventAccumulator, tag: str) -> list[float]:
    return [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.step)]


def test_tensorboard_has_the_plan_the_timelines_and_per_step_memory(cpu_run):
    events = cpu_run["events"]
    tags = events.Tags()
    assert "elixir/plan/text_summary" in tags["tensors"]
    text = events.Tensors("elixir/plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "Elixir search" in text and "chunk_numel" in text
    for kind in ("params", "grads", "optimizer", "runtime", "activations", "total", "budget"):
        assert f"elixir/predicted_memory/{kind}_mib" in tags["scalars"]
    for kind in ("params", "grads", "optimizer", "runtime"):
        assert f"elixir/measured_memory/{kind}_mib" in tags["scalars"]
    steps = {e.step for e in events.Scalars("elixir/time/step_ms")}
    assert steps == set(range(1, STEPS + 1))
    for tag in ("elixir/memory/runtime_held_mib", "elixir/memory/host_mib", "elixir/memory/nvme_mib", "elixir/time/compute_ms",
                "elixir/time/gather_wait_ms", "elixir/time/reduce_wait_ms", "elixir/time/optimizer_ms",
                "elixir/predicted_time/step_ms"):
        assert {e.step for e in events.Scalars(tag)} == steps, tag
    if "matplotlib" in sys.modules or _has_matplotlib():
        assert "elixir/memory_timeline" in tags["images"]
        assert (cpu_run["logs"] / "elixir_memory_timeline.png").stat().st_size > 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_predicted_and_measured_runtime_bytes_agree_at_every_position(cpu_run):
    events = cpu_run["events"]
    for kind in ("params", "grads", "optimizer", "runtime"):
        predicted = _series(events, f"elixir/predicted_memory/{kind}_mib")
        measured = _series(events, f"elixir/measured_memory/{kind}_mib")
        assert len(predicted) == len(measured) > 0
        assert predicted == measured, kind
    total, runtime = _series(events, "elixir/predicted_memory/total_mib"), _series(events, "elixir/predicted_memory/runtime_mib")
    assert all(t >= r for t, r in zip(total, runtime))


def test_the_saved_plan_trains_again_without_searching(cpu_run, tmp_path):
    path = cpu_run["logs"] / "elixir_plan.json"
    saved = ElixirPlan.from_json(path)
    assert (cpu_run["logs"] / "elixir_report.txt").read_text().startswith("Elixir search")
    out = _fit(tmp_path, 2, "--trainer.strategy=lightning_elixir.ElixirStrategy",
               f"--trainer.strategy.init_args.plan={path}")
    assert "Elixir: planning" not in out  # the monitor's first line when it searches
    (line,) = [line for line in out.splitlines() if line.startswith("Elixir: running plan")]  # one line, not two
    blocks = "all" if saved.cache_blocks == "all" else str(saved.cache_blocks)
    assert f"chunk={saved.chunk_numel:,} blocks={blocks} prefetch={saved.prefetch_depth}" in line, line
    assert "None" not in line
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in out


def _readme_tags() -> set[str]:
    """Every full ``elixir/...`` tag the README's monitor section names, braces expanded."""
    import re

    text = (REPO / "README.md").read_text()
    section = text[text.index("## ElixirMonitor"):text.index("## Further reading")]
    tags = set()
    for tag in re.findall(r"`(elixir/[^`]+)`", section):
        match = re.search(r"\{([^}]*)\}", tag)
        options = match.group(1).split(",") if match else [""]
        tags |= {tag[:match.start()] + o + tag[match.end():] if match else tag for o in options}
    return tags


CONDITIONAL = {  # logged only on CUDA, only when the self-correction calibrated, or only after a recovery from
    # out of memory (tests/test_oom_recovery.py): named in the source instead
    "elixir/memory/device_peak_mib", "elixir/calibration/compute_scale", "elixir/calibration/bandwidth_scale",
    "elixir/calibration/optimizer_scale", "elixir/calibration/host_update_scale",
    "elixir/calibration/calibrated_step_ms", "elixir/recovery/count", "elixir/recovery/overshoot_mib",
    "elixir/recovery/budget_mib", "elixir/recovery",
}


def test_every_tag_the_readme_names_is_logged(cpu_run):
    tags = cpu_run["events"].Tags()
    logged = set(tags["scalars"]) | set(tags["images"]) | {t.removesuffix("/text_summary") for t in tags["tensors"]}
    hparams = (cpu_run["logs"] / "hparams.yaml").read_text()
    logged |= {line.split(":")[0].strip() for line in hparams.splitlines() if line.startswith("elixir/")}
    source = (REPO / "lightning_elixir" / "monitor.py").read_text()
    readme = _readme_tags()
    assert len(readme) > 30, readme
    missing = sorted(t for t in readme if t not in logged and not (t in CONDITIONAL and f'"{t}"' in source))
    assert not missing, f"the README names tags that are not logged: {missing}"


class _Bar:
    is_enabled, is_disabled = True, False

    def __init__(self) -> None:
        self.printed: list[str] = []

    def print(self, text: str) -> None:
        self.printed.append(text)


class _Trainer:
    def __init__(self, bar=None, rank_zero=True) -> None:
        self.progress_bar_callback, self.is_global_zero = bar, rank_zero


def test_console_lines_go_through_the_progress_bar_when_one_is_drawn(caplog):
    from lightning_elixir.monitor import console

    bar = _Bar()
    console(_Trainer(bar), "Elixir: after 4 steps, keeping the plan")
    assert bar.printed == ["Elixir: after 4 steps, keeping the plan"]
    console(_Trainer(bar, rank_zero=False), "not on rank 1")
    assert len(bar.printed) == 1
    with caplog.at_level("INFO"):
        console(_Trainer(None), "Elixir: without a bar")
    assert "Elixir: without a bar" in caplog.text


def test_without_matplotlib_the_figure_is_named_once_with_how_to_get_it(monkeypatch, tmp_path):
    import builtins

    from lightning_elixir import monitor

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    bar = _Bar()
    monitor._log_figure(_Trainer(bar), str(tmp_path), None, None)
    (line,) = bar.printed
    assert str(tmp_path / monitor.FIGURE_FILE) in line and "pip install matplotlib" in line


def test_the_allocator_peak_is_reset_only_at_the_steps_the_monitor_reads(monkeypatch):
    """The peak memory statistics are the user's (``torch.cuda.max_memory_allocated`` after fit, as under DDP):
    the monitor resets them at a step's start only when it reads that step's peak, for the self-correction or
    for the step it logs."""
    from types import SimpleNamespace

    from lightning_elixir.runtime.phases import PhaseClock

    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    runtime = SimpleNamespace(device=torch.device("cuda", 0), clock=PhaseClock())
    planner = SimpleNamespace(may_replan=False)

    def batch_start(global_step: int) -> None:
        trainer = SimpleNamespace(strategy=SimpleNamespace(runtime=runtime, planner=planner), global_step=global_step,
                                  log_every_n_steps=5, is_global_zero=True)
        monitor._step_started = None  # a new optimizer step
        monitor.on_train_batch_start(trainer, None, None, global_step)

    monitor = ElixirMonitor(timeline_step=1000)
    for step in range(10):
        batch_start(step)
    assert len(resets) == 2  # the steps that end at global steps 5 and 10, which are logged
    planner.may_replan = True  # the self-correction reads every step's peak
    batch_start(10)
    batch_start(11)
    assert len(resets) == 4
