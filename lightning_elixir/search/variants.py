"""Plans searched over recomputation variants: the step traced with different blocks recomputing.

[Note: recomputation variants]
A profile is one step traced with some blocks recomputing ([Note: searched recomputation] in
recompute.py): its backward re-runs those blocks' forwards and their activations are not kept. A
plan searched on it is only right if it recomputes the same blocks. Planning traces each variant it
weighs (none, every other block, every block) and keeps them all (``PlanningResult.variants``);
every later search, the self-correction's on calibrated profiles and an out-of-memory recovery's at
a lowered budget, searches them all again here. So a plan always carries the recomputation of the
profile it was searched on, by construction rather than by each caller copying it, and a smaller
budget may be met by recomputing more blocks where offloading more state would be slower (the trade
the first search made, made again with what the run has measured).

Only what planning traced can be searched again. Planning traces the variants when the plan
without recomputation offloads or does not fit, and when it fits but is predicted near its budget
(``planner.NEAR_BUDGET``: the plan a prediction error can push out of memory, whose recovery should be
free to recompute); a plan well inside its budget traces no variant but its own, and its recoveries
offload.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_elixir.plan import ElixirPlan
from lightning_elixir.profile.types import HardwareProfile, ModelProfile
from lightning_elixir.search.errors import NoPlanFitsError
from lightning_elixir.search.options import SearchOptions
from lightning_elixir.search.report import SearchReport
from lightning_elixir.search.search import search


@dataclass(frozen=True)
class Variant:
    """The step as traced with ``recompute``'s blocks recomputing."""

    recompute: tuple[str, ...]
    profile: ModelProfile


@dataclass(frozen=True)
class Searched:
    """The search's best plan for one variant; ``plan.recompute`` is the variant's."""

    plan: ElixirPlan
    report: SearchReport
    variant: Variant


def search_each(variants: Sequence[Variant], hardware: HardwareProfile, budget_bytes: int,
                options: SearchOptions) -> tuple[list[Searched], list[NoPlanFitsError]]:
    """Each variant's best plan for ``budget_bytes``, and why the others fit nothing."""
    found: list[Searched] = []
    failures: list[NoPlanFitsError] = []
    for variant in variants:
        try:
            plan, report = search(variant.profile, hardware, budget_bytes, options)
        except NoPlanFitsError as err:
            failures.append(err)
            continue
        found.append(Searched(dataclasses.replace(plan, recompute=variant.recompute), report, variant))
    return found, failures


def fastest(found: Sequence[Searched], failures: Sequence[NoPlanFitsError]) -> Searched:
    """The plan predicted fastest (the earlier variant on a tie: fewer blocks recomputing); with none,
    raises the failure whose most frugal plan needs the least memory."""
    if not found:
        raise least_needing(failures)
    return min(found, key=lambda s: s.report.winner.step_s)


def least_needing(failures: Sequence[NoPlanFitsError]) -> NoPlanFitsError:
    """The failure whose most frugal plan needs the least device memory."""
    return min(failures, key=lambda f: f.min_device_bytes)


def search_variants(variants: Sequence[Variant], hardware: HardwareProfile, budget_bytes: int,
                    options: SearchOptions) -> Searched:
    """The fastest predicted plan over ``variants`` that fits ``budget_bytes`` ([Note: recomputation variants]).

    Raises:
        NoPlanFitsError: No variant has a plan that fits; the one whose most frugal plan needs the least."""
    if not variants:
        raise ValueError("search_variants needs at least one variant")
    return fastest(*search_each(variants, hardware, budget_bytes, options))


def variant_for(variants: Sequence[Variant], recompute: Sequence[str]) -> Variant | None:
    """The variant traced with exactly ``recompute``'s blocks recomputing (None: not traced)."""
    return next((v for v in variants if v.recompute == tuple(recompute)), None)
