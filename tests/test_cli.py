"""The ``lightning-elixir`` console script: ``plan``, ``hardware``, and the configs in configs/."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch._subclasses.fake_tensor import FakeTensor

from lightning_elixir.demos.gpt import BigramDataModule, GPTLightningModule
from lightning_elixir import ElixirPlan, ElixirStrategy, cli, plan_cli
from lightning_elixir.plan_cli import example_batch
from lightning_elixir.profile import HardwareProfile

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
A100_X8 = ROOT / "configs" / "hardware" / "a100-80gb-x8.json"
LOCAL_CPU = ROOT / "configs" / "hardware" / "local-cpu-x2.json"
PARAMS_20B = 19_750_019_072  # 24 layers of width 8192, vocabulary 50257, sequence 1024 (configs/gpt2_20b.yaml)

# A fresh interpreter runs the command as its only child, so RUSAGE_CHILDREN is the command's own peak.
MEASURE = r"""
import json, resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-3000:],
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


@pytest.fixture
def at_root(monkeypatch):
    """Run from the repository root, as the configs' class paths (lightning_elixir.demos.gpt) expect."""
    monkeypatch.chdir(ROOT)


def _run_measured(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_elixir.cli", *args]
    done = subprocess.run([sys.executable, "-c", MEASURE, *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_plan_20b_on_a_gpu_profile_without_allocating_the_weights(tmp_path):
    out = tmp_path / "plan.json"
    result = _run_measured("plan", "--config", "configs/gpt2_20b.yaml", "--hardware", str(A100_X8), "--devices", "8",
                           "--device-memory-limit", "40GiB", "--out", str(out))
    assert result["rc"] == 0, result["stderr"]
    print(f"20B plan: peak RSS {result['max_rss_bytes'] / 2**30:.2f} GiB")
    # 20B fp32 weights alone would be 74 GiB: the whole command stays far below even one copy in bf16.
    assert result["max_rss_bytes"] < 3 * 2**30
    text = result["stdout"]
    assert f"{PARAMS_20B:,} parameters" in text
    for part in ("predicted step time", "lower bound", "peak", "budget 40.00 GiB per rank", "activations"):
        assert part in text
    plan = ElixirPlan.from_json(out)
    assert plan.world_size == 8 and plan.chunks
    assert PARAMS_20B <= sum(c.numel for c in plan.chunks) < 1.05 * PARAMS_20B
    assert ElixirStrategy(plan=str(out)).plan == plan  # what `fit --trainer.strategy.init_args.plan` passes


def test_plan_reads_config_overrides_and_prints_the_fit_command(at_root, tmp_path, capsys):
    out = tmp_path / "plan.json"
    cli.main(["plan", "--config", "configs/gpt_cpu.yaml", "--hardware", str(LOCAL_CPU), "--out", str(out),
              "--model.init_args.n_layer", "2"])
    text = capsys.readouterr().out
    two_layers = GPTLightningModule(n_layer=2)
    assert f"{sum(p.numel() for p in two_layers.parameters()):,} parameters" in text
    assert "planning for 2 rank(s)" in text  # the config's trainer.devices
    # gpt_cpu.yaml names the strategy "elixir": the command must switch to class_path form to pass a plan
    assert f"--trainer.strategy lightning_elixir.ElixirStrategy --trainer.strategy.init_args.plan {out}" in text
    assert ElixirPlan.from_json(out).world_size == 2
    assert ElixirPlan.from_json(out).name == "plan.json"  # the console names the file it runs, not "auto"


@pytest.mark.parametrize("hardware, overrides, early", [
    (A100_X8, [], True),  # an accelerator, nothing between backward and step
    (A100_X8, ["--trainer.gradient_clip_val", "1.0"], False),  # clipping holds the updates until the step
    (LOCAL_CPU, [], False),  # on a CPU-only machine only when asked for
])
def test_plan_prices_updates_in_backward_as_the_run_would_start_them(at_root, capsys, hardware, overrides, early):
    cli.main(["plan", "--config", "configs/gpt_cpu.yaml", "--hardware", str(hardware), "--devices", "2",
              "--model.init_args.n_layer", "2", *overrides])
    assert ("offloaded updates priced to start in backward" in capsys.readouterr().out) is early


def test_example_batch_runs_the_data_module_on_fake_tensors():
    module = GPTLightningModule(vocab_size=64, block_size=16, n_layer=1, n_head=1, n_embd=8)
    data = BigramDataModule(vocab_size=64, block_size=16, batch_size=3, num_samples=10)
    batch = example_batch(module, data)
    assert [tuple(t.shape) for t in batch] == [(3, 16), (3, 16)]
    assert all(isinstance(t, FakeTensor) for t in batch)  # no data was generated


@pytest.mark.parametrize("command", ["plan", "hardware"])
def test_help_says_what_it_does_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: lightning-elixir {command}" in text
    assert f"lightning-elixir {command} --" in text  # an example command line
    for option in ("--out", "--devices") + (("--hardware", "--device-memory-limit") if command == "plan" else ()):
        assert option in text


def test_hardware_out_writes_a_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))  # the measurement is also cached under ~/.cache
    out = tmp_path / "hw.json"
    cli.main(["hardware", "--device", "cpu", "--out", str(out)])
    profile = HardwareProfile.from_json(out)
    assert profile.device_name == "cpu" and profile.world_size == 1 and profile.matmul_flops_per_s > 0
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--config", "configs/no_such.yaml", "--hardware", str(A100_X8)], "--config configs/no_such.yaml: no such file"),
    (["--config", "configs/gpt_cpu.yaml", "--hardware", "nowhere.json"], "--hardware nowhere.json: no such file"),
    (["--config", "configs/gpt_cpu.yaml", "--hardware", "configs/gpt_cpu.yaml"], "is not a hardware profile"),
    (["--config", "configs/gpt_cpu.yaml", "--hardware", str(A100_X8), "--devices", "0"], "--devices"),
    (["--config", "configs/gpt_cpu.yaml", "--hardware", str(A100_X8), "--devices", "eight"], "--devices"),
    (["--config", "configs/gpt_cpu.yaml", "--hardware", str(A100_X8), "--device-memory-limit", "40 parsecs"],
     "--device-memory-limit"),
    (["--config", "configs/gpt_cpu.yaml", "--hardware", str(A100_X8), "--host-memory-limit", "50%"],
     "give a size such as"),
])
def test_bad_inputs_fail_before_any_work_with_a_message_naming_them(at_root, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("limit", [
    ["--device-memory-limit", "1MiB"],
    # the config's own ElixirStrategy option, in class_path/init_args form
    ["--trainer.strategy", "lightning_elixir.ElixirStrategy",
     "--trainer.strategy.init_args.device_memory_limit", "1MiB"],
], ids=["option", "config"])
def test_a_budget_nothing_fits_exits_with_what_would_help(at_root, capsys, limit):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--config", "configs/gpt_cpu.yaml", "--hardware", str(LOCAL_CPU), *limit])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "No Elixir plan fits the device memory budget of 1.00 MiB" in err and "What would help" in err


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_parses_with_lightning_cli(at_root, config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(config.relative_to(ROOT)), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "lightning_elixir.demos.gpt.GPTLightningModule" in printed and "strategy:" in printed


def test_hardware_profiles_load_and_gpu_ones_say_they_are_estimates():
    for path in sorted((ROOT / "configs" / "hardware").glob("*.json")):
        profile = HardwareProfile.from_json(path)
        if profile.device_name != "cpu":
            assert profile.notes and "ESTIMATE" in profile.notes[0], path


@pytest.mark.parametrize("hardware", [LOCAL_CPU, A100_X8])
def test_plan_for_several_nodes_budgets_host_memory_per_machine_as_fit_does(at_root, capsys, hardware):
    """fit divides a machine's memory among its own ranks (the Trainer's ``devices``); `plan` for a config
    with num_nodes=2 used to divide it among the ranks of every node (the CPU budget halved)."""
    budgets = []
    for nodes in ("1", "2"):
        cli.main(["plan", "--config", "configs/gpt_cpu.yaml", "--hardware", str(hardware), "--trainer.devices", "2",
                  "--trainer.num_nodes", nodes, "--host-memory-limit", "8GiB", "--model.init_args.n_layer", "2"])
        text = capsys.readouterr().out
        assert f"planning for {2 * int(nodes)} rank(s)" in text
        budgets.append(re.search(r"budget ([0-9.]+ [KMGT]iB) per rank", text).group(1))
    assert budgets[0] == budgets[1]
    hardware_profile = HardwareProfile.from_json(hardware)
    assert plan_cli._ranks_per_machine(hardware_profile, 4, 2) == 2
    assert plan_cli._host_bytes("8GiB", plan_cli._ranks_per_machine(hardware_profile, 4, 2)) == 4 << 30
