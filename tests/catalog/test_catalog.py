"""The catalog under DDP and under Elixir (plan="auto"; plan="auto" under a budget tight enough that its
plan evicts or offloads, "elixir-tight" in harness.py; a one-parameter-per-chunk ZeRO-3 plan; and small
chunks that several modules share with the fewest cache blocks and prefetch).

All cases run under one strategy in one spawned pair of gloo CPU ranks (harness.py), once per
session and strategy, and only for the cases the selected tests need (``-k hf_`` runs only those).
Tests:
- test_ddp[case]: DDP itself runs the case soundly (the reference must be right);
- test_matches_ddp[case-strategy]: the strategy's losses per step, logged values, learning rates,
  final weights, buffers and extras equal DDP's within the case's tolerance (models.Tol).

Set CATALOG_SUMMARY=<path> to also write a markdown table of every (case, strategy) outcome, and
CATALOG_WORLD_SIZE=3 (or 4) to run the cases on that many ranks instead of two.

At two ranks a sum of two parts is the same in any order, so every plan's reductions equal DDP's to
the bit. From three on, gloo's sum of an element depends on where it lies in the reduced buffer (an
all-reduce of a rolled buffer, rolled back, differs in about a third of its elements at 3 ranks), and
DDP's buckets and Elixir's chunks lay the parameters out differently. Adam turns that rounding into
a whole step wherever the gradient is zero but for rounding, or nearly zero: attention key biases
(softmax ignores them), a LoRA A matrix while its B is still zero, single elements of a weight. At 3
ranks hf_llama, hf_vit, hf_swin and bf16_hf_llama_lora end with such elements (one or two per weight,
or a LoRA matrix) outside the two-rank tolerances, alike under every Elixir layout; their losses agree.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.catalog import compare, harness
from tests.catalog.models import BY_NAME, CASES, Case

COMPARED = ("elixir", "elixir-tight", "zero3-1pp", "zero3-shared")


def _available(case: Case) -> bool:
    return case.requires is None or importlib.util.find_spec(case.requires) is not None


class Runs:
    """Results per strategy, computed on first use for the cases this session selected."""

    def __init__(self, cases: list[str], root: Path) -> None:
        self.cases, self.root = cases, root
        self.results: dict[str, dict[str, list[dict]]] = {}
        self.seconds: dict[str, float] = {}

    def get(self, strategy: str) -> dict[str, list[dict]]:
        if strategy not in self.results:
            start = time.perf_counter()
            self.results[strategy] = harness.run_cases(self.cases, strategy, self.root)
            self.seconds[strategy] = time.perf_counter() - start
        return self.results[strategy]

    def outcome(self, case: Case, strategy: str) -> list[str]:
        ref = self.get("ddp")[case.name]
        problems = compare.check_ddp(case, ref)
        if strategy == "ddp" or problems:
            return [f"DDP: {p}" for p in problems] if strategy != "ddp" else problems
        return compare.compare(case, ref, self.get(strategy)[case.name])


@pytest.fixture(scope="session")
def catalog(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    wanted = {item.callspec.params["case"].name for item in request.session.items
              if item.module is not None and item.module.__name__ == __name__ and hasattr(item, "callspec")
              and "case" in item.callspec.params}
    cases = [c.name for c in CASES if c.name in wanted and _available(c)]
    runs = Runs(cases, tmp_path_factory.mktemp("catalog"))
    yield runs
    summary = os.environ.get("CATALOG_SUMMARY")
    if summary:
        _write_summary(runs, Path(summary))


def _first_line(problems: list[str]) -> str:
    first = problems[0]
    return first.removeprefix("raised: ") if first.startswith("raised: ") else first.splitlines()[0]


def _write_summary(runs: Runs, path: Path) -> None:
    rows = ["| case | strategy | plans | outcome |", "|---|---|---|---|"]
    for case in CASES:
        if case.name not in runs.cases:
            continue
        for strategy in ("ddp",) + COMPARED:
            if strategy not in runs.results:
                continue
            problems = runs.outcome(case, strategy)
            text = "ok" if not problems else _first_line(problems).replace("|", "\\|")[:300]
            plans = ", ".join(sorted(set(runs.results[strategy][case.name][0].get("plans", [])) - {""}))
            rows.append(f"| {case.name} | {strategy} | {plans} | {text} |")
    times = ", ".join(f"{s}: {t:.0f} s" for s, t in runs.seconds.items())
    path.write_text("\n".join(rows) + f"\n\nrun time per strategy: {times}\n")


def _ids(case: Case) -> str:
    return case.name


def test_catalog_size() -> None:
    assert len(CASES) >= 40
    assert len(BY_NAME) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_ddp(case: Case, catalog: Runs) -> None:
    if case.requires:
        pytest.importorskip(case.requires)
    problems = catalog.outcome(case, "ddp")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def _roomy(plan: str) -> bool:
    """Whether a searched plan (``harness._plan_of``) keeps every chunk gathered and nothing offloaded."""
    found = re.match(r"auto \(blocks (\w+), (\d+) of \d+ chunks offloaded", plan)
    return found is not None and found.group(1) == "all" and found.group(2) == "0"


@pytest.mark.parametrize("strategy", COMPARED)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_ddp(case: Case, strategy: str, catalog: Runs) -> None:
    if case.requires:
        pytest.importorskip(case.requires)
    problems = catalog.outcome(case, strategy)
    if strategy == "elixir-tight" and not problems:  # the budget is tight: its plans evict or offload
        problems = [f"under the tight budget the plan keeps everything: {plan}"
                    for plan in catalog.get(strategy)[case.name][0].get("plans", []) if _roomy(plan)]
    if problems:
        pytest.fail(f"{case.name} under {strategy} vs ddp (tolerance: {case.tol.why}):\n" + "\n".join(problems),
                    pytrace=False)
