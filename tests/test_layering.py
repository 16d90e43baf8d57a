"""Imports flow one way: plan <- profile <- search; plan, schedule, timeline, devices <- runtime; only the glue
imports everything."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_elixir

PACKAGE = Path(lightning_elixir.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _package_imports(files) -> dict[str, set[str]]:
    return {f.name: {m for m in _imports(f) if m.startswith("lightning_elixir")} for f in files}


def test_plan_imports_nothing_of_the_package_and_no_distributed():
    imports = _imports(PACKAGE / "plan.py")
    assert not {m for m in imports if m.startswith(("lightning_elixir", "torch"))}


def test_runtime_imports_only_plan_schedule_timeline_units_and_itself():
    shared = ("lightning_elixir.plan", "lightning_elixir.schedule", "lightning_elixir.timeline", "lightning_elixir.units",
              "lightning_elixir.devices")
    for name, mods in _package_imports((PACKAGE / "runtime").glob("*.py")).items():
        assert all(m in shared or m.startswith("lightning_elixir.runtime") for m in mods), name


def test_schedule_and_timeline_are_pure():
    for name in ("schedule.py", "timeline.py"):
        imports = _imports(PACKAGE / name)
        assert not {m for m in imports if m.startswith(("lightning_elixir", "torch"))}, name


def test_devices_needs_torch_only():
    imports = _imports(PACKAGE / "devices.py")
    assert not {m for m in imports if m.startswith("lightning")}


def test_units_read_the_module_tree_only():
    imports = _imports(PACKAGE / "units.py")
    assert {m for m in imports if m.startswith(("lightning_elixir", "torch"))} == {"torch.nn"}


def test_profile_and_search_do_not_import_runtime_or_lightning():
    for sub in ("profile", "search"):
        for path in (PACKAGE / sub).glob("*.py"):
            mods = _imports(path)
            assert not {m for m in mods if m.startswith(("lightning_elixir.runtime", "lightning.", "torch.distributed"))}, path


def test_only_the_glue_imports_lightning():
    glue = {"__init__.py", "strategy.py", "precision.py", "launcher.py", "mirror.py", "cli.py", "plan_cli.py",
            "checkpointing.py", "monitor.py", "averaging.py", "autoplan.py", "toggling.py", "after_step.py",
            "finetuning.py", "rank_hooks.py", "inputs.py", "steps.py"}
    for path in PACKAGE.rglob("*.py"):
        if (path.name in glue and path.parent == PACKAGE) or path.parent == PACKAGE / "demos":
            continue  # the glue, and the demo LightningModules
        assert not {m for m in _imports(path) if m == "lightning" or m.startswith("lightning.")}, path
