"""The pinned test install (requirements/test-constraints.txt) and scripts/test_deps.py, without installing anything."""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("test_deps", ROOT / "scripts" / "test_deps.py")
test_deps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(test_deps)


def _install_line(text: str) -> str:
    return next(line.strip() for line in text.splitlines() if "pip install -e \".[test]\"" in line)


def test_ci_runs_the_readme_test_command_with_the_pins() -> None:
    ci = _install_line((ROOT / ".ci" / "run").read_text())
    assert ci in (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install -e \".[test]\" -c requirements/test-constraints.txt" in ci


def test_every_test_dependency_is_pinned_exactly_and_torch_is_not() -> None:
    pins = test_deps.read_constraints()
    assert not test_deps.check_covered(pins)
    assert "torch" not in pins and "lightning-elixir" not in pins
    declared = [Requirement(r) for r in metadata.requires("lightning-elixir") or ()]
    wanted = {test_deps.canonical(r.name) for r in declared
              if r.marker is None or r.marker.evaluate({"extra": "test"})} - {"torch"}
    assert wanted <= set(pins), wanted - set(pins)
    for line in test_deps.CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r"[a-z0-9-]+==[A-Za-z0-9.+!-]+", line), line


def test_the_tests_optional_imports_are_the_ones_checked() -> None:
    """Every module a test skips on or imports optionally is in OPTIONAL_TEST_IMPORTS (so it must be pinned)."""
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r"(?:importorskip|find_spec)\(\"([A-Za-z_]+)", text))
        found |= set(re.findall(r"requires=\"([A-Za-z_]+)\"", text))
        found |= set(re.findall(r"^\s*(?:from|import) (hypothesis|transformers|matplotlib|tensorboard)\b", text, re.M))
    found -= {"pytorch_lightning", "lightning"}  # dependencies of lightning itself
    assert found <= set(test_deps.OPTIONAL_TEST_IMPORTS), found - set(test_deps.OPTIONAL_TEST_IMPORTS)


def test_render_and_read_round_trip_without_torch_or_the_project() -> None:
    text = test_deps.render({"torch": "2.13.0", "lightning-elixir": "0.1.0", "transformers": "5.25.0",
                             "pyyaml": "6.0.4"}, python="3.11.7")
    assert "CPython 3.11.7" in text
    path = ROOT / "tests" / ".constraints-roundtrip.txt"
    try:
        path.write_text(text)
        assert test_deps.read_constraints(path) == {"pyyaml": "6.0.4", "transformers": "5.25.0"}
    finally:
        path.unlink(missing_ok=True)
    assert test_deps.canonical("Typing_Extensions") == "typing-extensions"


def test_closure_of_this_environment_holds_the_test_extra() -> None:
    versions = test_deps.closure()
    for dist in ("lightning-elixir", "torch", "pytest", "lightning", "tensorboard"):
        assert dist in versions, dist
    assert versions["pytest"] == metadata.version("pytest")


def test_report_lists_changed_versions_and_outcomes(tmp_path: Path) -> None:
    assert test_deps.version_changes({"a": "1", "b": "2", "torch": "1"}, {"a": "1", "b": "3", "c": "4", "torch": "2"}) \
        == ["  b: 2 -> 3", "  c: (not installed) -> 4"]
    junit = tmp_path / "r.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="t" name="ok"/>'
                     '<testcase classname="t" name="bad"><failure message="weight w: max |diff| 1e-3">x</failure>'
                     '</testcase><testcase classname="t" name="skip"><skipped/></testcase></testsuite></testsuites>')
    outcomes = test_deps.parse_junit(junit)
    assert outcomes == {"t::ok": "passed", "t::bad": "failed: weight w: max |diff| 1e-3", "t::skip": "skipped"}
    moved = test_deps.outcome_changes({"t::ok": "passed", "t::bad": "passed", "t::skip": "skipped"}, outcomes)
    assert moved == ["  t::bad: passed with the pins, failed: weight w: max |diff| 1e-3 with the newest releases"]
    assert test_deps.summary(outcomes) == "1 failed, 1 passed, 1 skipped"


def test_drift_dry_run_installs_newest_and_pinned_and_runs_the_catalog(capsys: pytest.CaptureFixture,
                                                                       tmp_path: Path) -> None:
    assert test_deps.main(["drift", "--dry-run", "--keep", str(tmp_path), "-k", "hf_"]) == 0
    out = capsys.readouterr().out
    installs = [line for line in out.splitlines() if ".[test]" in line]
    assert len(installs) == 2
    assert "test-constraints.txt" not in installs[0] and "test-constraints.txt" in installs[1]
    assert out.count("pip install -q torch==2.13.0") == 2
    runs = [line for line in out.splitlines() if "-m pytest" in line]
    assert len(runs) == 2 and all(line.endswith("tests/catalog -k hf_") for line in runs)
    assert not any(tmp_path.iterdir())  # nothing was created
