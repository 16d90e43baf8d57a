"""Search: pack chunks, simulate the cache, model memory and cost, pick the fastest plan that fits.

Pure functions of (model profile, hardware profile, budget, options): no ``torch.distributed``, no
device calls, no printing. Same inputs, same plan.
"""

from lightning_elixir.search.budget import parse_memory_limit
from lightning_elixir.search.cost import CostBreakdown, step_time_s
from lightning_elixir.search.errors import NoPlanFitsError
from lightning_elixir.search.evaluate import PlanPrediction, evaluate_plan
from lightning_elixir.search.layout import Layout, build_layout, candidate_chunk_numels, layout_from_plan
from lightning_elixir.search.memory import MemoryBreakdown, memory_breakdown
from lightning_elixir.search.options import SearchOptions
from lightning_elixir.search.report import Candidate, LayoutSummary, SearchReport
from lightning_elixir.search.search import search
from lightning_elixir.search.simulate import SimResult, simulate_gathers
from lightning_elixir.search.timeline import predict_timeline

__all__ = [
    "Candidate",
    "CostBreakdown",
    "Layout",
    "LayoutSummary",
    "MemoryBreakdown",
    "NoPlanFitsError",
    "PlanPrediction",
    "SearchOptions",
    "SearchReport",
    "SimResult",
    "build_layout",
    "candidate_chunk_numels",
    "evaluate_plan",
    "layout_from_plan",
    "memory_breakdown",
    "parse_memory_limit",
    "predict_timeline",
    "search",
    "simulate_gathers",
    "step_time_s",
]
