"""The versions the test suite installs, and a check of the newest releases against them.

The README's test command and .ci/run install the ``test`` extra with
``-c requirements/test-constraints.txt``: every package the extra and the package itself pull in,
at the versions the suite is known to pass with. ``pyproject.toml`` keeps ranges, as a library's
dependencies should. torch is not in the file: it is installed first as ``torch==2.13.0`` (the CPU
build), and on a GPU machine as the build you want.

    python scripts/test_deps.py freeze
        Write the constraints file from the active environment: the dependency closure of
        ``lightning-elixir[test]`` and torch, as installed, less torch and the project itself.
        Run it in an environment where the whole suite passes.

    python scripts/test_deps.py drift [--all] [--dry-run] [-k EXPR] [--keep DIR] [--pinned-python PATH]
                                      [--report FILE] [--write-constraints]
        Install the newest releases (the README's command without the constraints) in a temporary
        virtual environment, and the pinned ones in another, run the catalog tests (every test with
        --all) in both, and report which packages changed and which tests changed outcome. A new
        release then shows up as this report, not as a red CI. It is not part of CI or of the
        default pytest run; run it on a schedule (e.g. weekly). Exit status 1 when an outcome
        changed. With --all --write-constraints and no test failing on the newest releases, it
        rewrites the constraints file from that environment: the way to update the pins.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "requirements" / "test-constraints.txt"
PROJECT = "lightning-elixir"
TORCH = "torch==2.13.0"
"""Installed before the project, so that pip keeps this CPU build instead of choosing one itself."""
NOT_PINNED = {"torch", PROJECT}
OPTIONAL_TEST_IMPORTS = {"transformers": "transformers", "peft": "peft", "hypothesis": "hypothesis",
                         "matplotlib": "matplotlib", "tensorboard": "tensorboard", "pytest": "pytest",
                         "safetensors": "safetensors"}
"""Modules the tests import or skip on (import name: distribution name); each must be pinned."""
HEADER = """\
# The test dependencies at versions the suite is known to pass with, for
#   pip install torch==2.13.0 && pip install -e ".[test]" -c requirements/test-constraints.txt
# (the README's test command and .ci/run). Written by `python scripts/test_deps.py freeze` from
# an environment where the whole suite passed; `python scripts/test_deps.py drift` checks the
# newest releases against it. torch is not pinned here: it is installed first.
# Resolved on CPython {python}.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------------------------------------------------
# the installed dependency closure (run inside the environment it describes)


def closure() -> dict[str, str]:
    """Installed versions of the distributions that ``lightning-elixir[test]`` and torch need, recursively."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(PROJECT, frozenset({"test"})), ("torch", frozenset())]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (canonical(name), extras) in done:
            continue
        done.add((canonical(name), extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement whose marker did not hold, or an optional one that is absent
        seen[canonical(dist.metadata["Name"])] = dist.version
        for text in dist.requires or ():
            req = Requirement(text)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return seen


def read_constraints(path: Path = CONSTRAINTS) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"{path}: not an exact pin: {line!r}")
        pins[canonical(name.strip())] = version.strip()
    return pins


def render(versions: dict[str, str], python: str) -> str:
    lines = [f"{name}=={version}" for name, version in sorted(versions.items()) if name not in NOT_PINNED]
    return HEADER.format(python=python) + "\n".join(lines) + "\n"


def check_covered(pins: dict[str, str]) -> list[str]:
    """What the pins miss: an optional test import, or a pin of torch or of the project."""
    problems = [f"{dist} (imported by the tests as {mod}) is not pinned"
                for mod, dist in OPTIONAL_TEST_IMPORTS.items() if canonical(dist) not in pins]
    problems += [f"{name} must not be pinned here" for name in NOT_PINNED if name in pins]
    return problems


def freeze(python: str, out: Path) -> None:
    versions = json.loads(_run([python, str(Path(__file__).resolve()), "_closure"], capture=True))
    missing = [dist for dist in OPTIONAL_TEST_IMPORTS.values() if canonical(dist) not in versions]
    if missing:
        raise SystemExit(f"{python}: {', '.join(missing)} not installed; install the test extra first")
    version = _run([python, "-c", "import platform; print(platform.python_version())"], capture=True).strip()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(versions, version))
    problems = check_covered(read_constraints(out))
    if problems:
        raise SystemExit(f"{out}: " + "; ".join(problems))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}: "
          f"{len(read_constraints(out))} pins from {python}")


# ---------------------------------------------------------------------------------------------------------------------
# drift: newest releases against the pins


def _run(cmd: list[str], capture: bool = False, dry: bool = False, env: Optional[dict] = None,
         check: bool = True) -> str:
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if dry:
        return ""
    done = subprocess.run(cmd, cwd=ROOT, text=True, env=env, check=False,
                          stdout=subprocess.PIPE if capture else None)
    if check and done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}")
    return done.stdout if capture else ""


def make_env(where: Path, pinned: bool, dry: bool) -> str:
    """A fresh virtual environment with the README's install; returns its python."""
    _run([sys.executable, "-m", "venv", str(where)], dry=dry)
    python = str(where / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", TORCH], dry=dry)
    extra = ["-c", str(CONSTRAINTS)] if pinned else []
    _run([python, "-m", "pip", "install", "-q", "-e", ".[test]", *extra], dry=dry)
    return python


def run_tests(python: str, targets: list[str], junit: Path, keyword: Optional[str], dry: bool) -> dict[str, str]:
    """Outcome per test id: passed, failed, error or skipped (and the failure's first line)."""
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *targets]
    if keyword:
        cmd += ["-k", keyword]
    start = time.perf_counter()
    _run(cmd, dry=dry, check=False)
    if dry:
        return {}
    print(f"  ({time.perf_counter() - start:.0f} s)")
    return parse_junit(junit)


def parse_junit(path: Path) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                first = (child.get("message") or child.text or "").strip().splitlines()
                outcome = f"{'failed' if child.tag == 'failure' else 'error'}: {first[0][:200] if first else ''}"
                break
            if child.tag == "skipped":
                outcome = "skipped"
        outcomes[test] = outcome
    return outcomes


def version_changes(pinned: dict[str, str], newest: dict[str, str]) -> list[str]:
    rows = []
    for name in sorted(set(pinned) | set(newest)):
        if name in NOT_PINNED:
            continue
        a, b = pinned.get(name), newest.get(name)
        if a != b:
            rows.append(f"  {name}: {a or '(not installed)'} -> {b or '(not installed)'}")
    return rows


def outcome_changes(pinned: dict[str, str], newest: dict[str, str]) -> list[str]:
    rows = []
    for test in sorted(set(pinned) | set(newest)):
        a, b = pinned.get(test, "(not run)"), newest.get(test, "(not run)")
        if a.split(":")[0] != b.split(":")[0]:
            rows.append(f"  {test}: {a.split(':')[0]} with the pins, {b} with the newest releases")
    return rows


def summary(outcomes: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        key = outcome.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test ran"


def drift(args: argparse.Namespace) -> int:
    targets = ["tests"] if args.all else ["tests/catalog"]
    if args.keep:
        base = Path(args.keep)
    elif args.dry_run:
        base = Path(tempfile.gettempdir()) / "elixir-drift-XXXXXX"
    else:
        base = Path(tempfile.mkdtemp(prefix="elixir-drift-"))
    print(f"environments under {base}")
    pins = read_constraints()
    newest_python = make_env(base / "newest", pinned=False, dry=args.dry_run)
    pinned_python = args.pinned_python or make_env(base / "pinned", pinned=True, dry=args.dry_run)
    if args.dry_run:
        run_tests(newest_python, targets, base / "newest.xml", args.k, dry=True)
        run_tests(pinned_python, targets, base / "pinned.xml", args.k, dry=True)
        return 0
    closure_of = {p: json.loads(_run([p, str(Path(__file__).resolve()), "_closure"], capture=True))
                  for p in {newest_python, pinned_python}}
    off_pins = version_changes(pins, closure_of[pinned_python])
    newest_outcomes = run_tests(newest_python, targets, base / "newest.xml", args.k, dry=False)
    pinned_outcomes = run_tests(pinned_python, targets, base / "pinned.xml", args.k, dry=False)

    changed = version_changes(pins, closure_of[newest_python])
    moved = outcome_changes(pinned_outcomes, newest_outcomes)
    report = ["# test dependency drift", "",
              f"tests: {' '.join(targets)}{f' -k {args.k!r}' if args.k else ''}", "",
              "## releases newer than (or missing from) requirements/test-constraints.txt",
              *(changed or ["  none"]), ""]
    if off_pins:
        report += ["## the pinned environment differs from the constraints file (its results are not the pins')",
                   *off_pins, ""]
    report += ["## outcomes", f"  pinned: {summary(pinned_outcomes)}", f"  newest: {summary(newest_outcomes)}", "",
               "## tests whose outcome changed with the newest releases", *(moved or ["  none"]), ""]
    text = "\n".join(report)
    print("\n" + text)
    if args.report:
        Path(args.report).write_text(text)
    failing = [t for t, o in newest_outcomes.items() if o.startswith(("failed", "error"))]
    if args.write_constraints:
        if failing or not newest_outcomes:
            print(f"constraints kept: {len(failing)} tests fail with the newest releases")
        elif not args.all:
            print("constraints kept: --write-constraints needs --all (the whole suite must pass)")
        else:
            freeze(newest_python, CONSTRAINTS)
    return 1 if moved else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_freeze = sub.add_parser("freeze", help="write the constraints file from the active environment")
    p_freeze.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
    p_freeze.add_argument("--out", default=str(CONSTRAINTS), help="where to write (default: %(default)s)")
    p_drift = sub.add_parser("drift", help="the newest releases against the pins")
    p_drift.add_argument("--all", action="store_true", help="run every test, not only tests/catalog")
    p_drift.add_argument("-k", default=None, help="pytest -k expression, to run fewer tests")
    p_drift.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p_drift.add_argument("--keep", metavar="DIR", help="build the environments in DIR (kept) instead of a temporary one")
    p_drift.add_argument("--pinned-python", metavar="PATH",
                         help="an interpreter whose environment has the pins, instead of building one")
    p_drift.add_argument("--report", metavar="FILE", help="also write the report to FILE")
    p_drift.add_argument("--write-constraints", action="store_true",
                         help="with --all and no failure on the newest releases, rewrite the constraints from them")
    sub.add_parser("_closure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == "_closure":
        print(json.dumps(closure()))
        return 0
    if args.command == "freeze":
        freeze(args.python, Path(args.out).resolve())
        return 0
    return drift(args)


if __name__ == "__main__":
    sys.exit(main())
