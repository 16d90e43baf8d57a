"""Memory timelines: the search's prediction equals what the runtime holds, position by position."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir import ElixirPlan
from lightning_elixir.plan import CACHE_MIN, REDUCE_BUFFERS
from lightning_elixir.profile import ModelProfile, profile_model
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.search import SearchOptions, build_layout, memory_breakdown
from lightning_elixir.search.layout import access_chunks
from lightning_elixir.search.simulate import resolve_cache_blocks
from lightning_elixir.search.timeline import predict_timeline
from lightning_elixir.timeline import KINDS, MemoryTimeline, TimelineError
from tests.distributed import run_distributed

GPT_CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BUDGET_BYTES = 1 << 30
ADAMW_BYTES = 8
"""AdamW's per-element state: exp_avg and exp_avg_sq in fp32."""


class FrozenTiedMLP(nn.Module):
    """A tied embedding/head (a private chunk) around a frozen layer between trained ones."""

    def __init__(self, vocab: int = 48, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.frozen = nn.Linear(4 * width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.frozen.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.emb(idx)))
        return self.head(self.fc2(F.gelu(self.frozen(h))))


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return FrozenTiedMLP()
    return GPT(dataclasses.replace(GPT_CONFIG, activation_checkpointing=name == "gpt_checkpointed"))


def _vocab(name: str) -> int:
    return 48 if name == "mlp" else GPT_CONFIG.vocab_size


def _batch(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(_vocab(name), (2, 8 if name == "mlp" else GPT_CONFIG.block_size),
                      generator=torch.Generator().manual_seed(seed))
    return x, torch.roll(x, -1, 1)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


@pytest.fixture(scope="module")
def profiles() -> dict[str, ModelProfile]:
    """Profiles by case name, traced on first use."""
    return {}


def _profile(profiles: dict[str, ModelProfile], name: str) -> ModelProfile:
    if name not in profiles:
        profiles[name] = profile_model(_model(name), _batch(name, 0), step_fn=_loss)
    return profiles[name]


def _plan(profile: ModelProfile, chunk_numel: int, blocks, prefetch: int, world_size: int = 1) -> ElixirPlan:
    """A plan on the search's layout; ``("min+", K)`` asks for K blocks beyond the fewest, as an int count."""
    layout = build_layout(profile, chunk_numel, world_size)
    if isinstance(blocks, tuple):
        blocks = resolve_cache_blocks(CACHE_MIN, access_chunks(layout, profile), len(layout.public)) + blocks[1]
    return ElixirPlan(chunks=layout.chunks, world_size=world_size, cache_blocks=blocks, prefetch_depth=prefetch)


def _train(runtime: ElixirRuntime, optimizer, name: str, steps: range, micro_batches: int) -> None:
    for step in steps:
        for m in range(micro_batches):
            _loss(runtime.module, _batch(name, step * micro_batches + m)).backward()
        optimizer_step(runtime, optimizer)
        optimizer.zero_grad()


def measure(name: str, plan: ElixirPlan, micro_batches: int) -> MemoryTimeline:
    """The timeline the runtime records on the third optimizer step (the first two learn the order)."""
    runtime = ElixirRuntime(_model(name), plan)
    optimizer = shard_optimizer(runtime, torch.optim.AdamW(runtime.module.parameters(), lr=1e-3))
    _train(runtime, optimizer, name, range(2), micro_batches)
    recorder = runtime.record_timeline(BUDGET_BYTES)
    _train(runtime, optimizer, name, range(2, 3), micro_batches)
    assert recorder.done and runtime.timeline_recorder is None
    return recorder.timeline


def assert_same_runtime_bytes(predicted: MemoryTimeline, measured: MemoryTimeline) -> None:
    assert len(predicted) == len(measured) > 0
    assert predicted.labels == measured.labels
    assert predicted.differences(measured) == ()
    assert predicted["runtime"] == measured["runtime"]


@pytest.mark.parametrize("name,chunk_numel,blocks,prefetch", [
    ("gpt", 4096, "all", 2),  # ZeRO-2: every chunk stays gathered
    ("gpt", 4096, "min", 0),  # ZeRO-3: the fewest blocks, gather on every use
    ("gpt", 4096, ("min+", 1), 1),
    ("gpt", 8192, "min", 2),
    ("mlp", 4096, "all", 2),
    ("mlp", 4096, "min", 0),
    ("mlp", 4096, ("min+", 1), 1),
    ("gpt_checkpointed", 4096, "min", 1),  # a recomputation holds its backward's chunks too
    ("gpt_checkpointed", 4096, ("min+", 2), 2),
])
def test_the_predicted_timeline_equals_the_measured_one(profiles, name, chunk_numel, blocks, prefetch):
    profile = _profile(profiles, name)
    plan = _plan(profile, chunk_numel, blocks, prefetch)
    options = SearchOptions(micro_batches=2, optimizer_bytes_per_numel=ADAMW_BYTES)
    measured = measure(name, plan, micro_batches=2)
    predicted = predict_timeline(profile, plan, options, BUDGET_BYTES)
    assert_same_runtime_bytes(predicted, measured)
    assert measured.micro_batches == predicted.micro_batches == 2
    assert measured.budget_bytes == predicted.budget_bytes == BUDGET_BYTES
    assert measured["activations"] is None and measured["total"] is None  # no allocator statistics on a CPU
    assert predicted["total"] == tuple(r + a for r, a in zip(predicted["runtime"], predicted["activations"]))


def _measure_on_rank(rank: int, world_size: int, name: str, plan: ElixirPlan) -> dict:
    return measure(name, plan, micro_batches=2).to_dict()


def test_every_rank_holds_what_was_predicted_for_it(profiles):
    profile = _profile(profiles, "mlp")
    plan = _plan(profile, 4096, 2, 1, world_size=2)
    options = SearchOptions(world_size=2, micro_batches=2, optimizer_bytes_per_numel=ADAMW_BYTES)
    measured = [MemoryTimeline.from_dict(t) for t in run_distributed(_measure_on_rank, 2, "mlp", plan)]
    predicted = [predict_timeline(profile, plan, options, BUDGET_BYTES, rank=r) for r in range(2)]
    for p, m in zip(predicted, measured):
        assert_same_runtime_bytes(p, m)
    # Optimizer state covers trained elements only, and the ranks' shards hold different padding.
    assert predicted[0]["optimizer"] != predicted[1]["optimizer"]


def test_reductions_in_flight_bound_the_gradient_buffers(profiles):
    """Each rank holds its gradient shards and the reductions in flight, never the whole model's gradient
    (as when every reduction was retired at the end of backward): gradients land in a chunk's buffer
    only when its reduction starts ([Note: gradients land per chunk] in runtime/chunk.py)."""
    profile = _profile(profiles, "gpt")
    world_size = 2
    plan = _plan(profile, 4096, "min", 1, world_size=world_size)
    assert len(plan.chunks) > 2 * (REDUCE_BUFFERS + 1)  # more chunks than the bound lets hold buffers
    options = SearchOptions(world_size=world_size, micro_batches=2, optimizer_bytes_per_numel=ADAMW_BYTES)
    measured = [MemoryTimeline.from_dict(t) for t in run_distributed(_measure_on_rank, world_size, "gpt", plan)]
    fp32 = 4
    full_bytes = max(spec.numel for spec in plan.chunks) * fp32
    shards_bytes = sum(spec.numel // world_size for spec in plan.chunks) * fp32
    in_flight_bytes = REDUCE_BUFFERS * (full_bytes + full_bytes // world_size)
    for rank, timeline in enumerate(measured):
        assert_same_runtime_bytes(predict_timeline(profile, plan, options, rank=rank), timeline)
        # At the peak REDUCE_BUFFERS reductions are in flight, each with its full buffer and its shard's.
        assert max(timeline["grads"]) == shards_bytes + in_flight_bytes


def test_recording_waits_for_a_whole_step_and_skips_evaluation(profiles):
    profile = _profile(profiles, "gpt")
    plan = _plan(profile, 4096, ("min+", 1), 1)
    runtime = ElixirRuntime(_model("gpt"), plan)
    optimizer = shard_optimizer(runtime, torch.optim.AdamW(runtime.module.parameters(), lr=1e-3))
    _train(runtime, optimizer, "gpt", range(2), micro_batches=2)
    _loss(runtime.module, _batch("gpt", 0)).backward()
    recorder = runtime.record_timeline()  # armed after the step's first micro-batch: not this step
    _loss(runtime.module, _batch("gpt", 1)).backward()
    optimizer_step(runtime, optimizer)
    optimizer.zero_grad()
    assert not recorder.started and len(recorder.timeline) == 0
    with torch.no_grad():
        runtime.module(_batch("gpt", 2)[0])
    _train(runtime, optimizer, "gpt", range(3, 4), micro_batches=2)
    assert recorder.done
    options = SearchOptions(micro_batches=2, optimizer_bytes_per_numel=ADAMW_BYTES)
    assert_same_runtime_bytes(predict_timeline(profile, plan, options), recorder.timeline)


def test_mixed_precision_with_an_offloaded_chunk_counts_device_bytes_only(profiles):
    name = "gpt"
    profile = profile_model(_model(name), _batch(name, 0), step_fn=_loss, compute_dtype=torch.bfloat16)
    plan = _plan(profile, 4096, "min", 1)
    chunks = tuple(dataclasses.replace(spec, placement="cpu") if i == 1 else spec for i, spec in enumerate(plan.chunks))
    plan = dataclasses.replace(plan, chunks=chunks)
    runtime = ElixirRuntime(_model(name), plan, compute_dtype=torch.bfloat16, master_dtype=torch.float32)
    optimizer = shard_optimizer(runtime, torch.optim.AdamW(runtime.module.parameters(), lr=1e-3))
    recorder = None
    for step in range(3):
        recorder = runtime.record_timeline() if step == 2 else None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(runtime.module, _batch(name, step))
        loss.backward()
        optimizer_step(runtime, optimizer)
        optimizer.zero_grad()
    options = SearchOptions(optimizer_bytes_per_numel=ADAMW_BYTES)  # bf16 compute: fp32 masters, fp32 reduction
    predicted = predict_timeline(profile, plan, options)
    assert_same_runtime_bytes(predicted, recorder.timeline)
    all_device = predict_timeline(profile, _plan(profile, 4096, "min", 1), options)
    assert all_device["optimizer"][0] > predicted["optimizer"][0]


def test_the_timeline_stays_within_what_the_memory_breakdown_bounds(profiles):
    profile = _profile(profiles, "gpt")
    options = SearchOptions(world_size=2, micro_batches=2, optimizer_bytes_per_numel=ADAMW_BYTES)
    layout = build_layout(profile, 4096, 2)
    for blocks in ("all", ("min+", 1)):
        plan = _plan(profile, 4096, blocks, 1, world_size=2)
        n_blocks = len(layout.public) if blocks == "all" else plan.cache_blocks
        bound = memory_breakdown(layout, profile, n_blocks, tuple(s.placement for s in layout.chunks), options)
        timeline = predict_timeline(profile, plan, options)
        held = bound.param_shard_bytes + bound.cache_bytes + bound.private_bytes
        assert max(timeline["params"]) == held  # the cache fills up...
        if blocks == "all":  # ...at once for a plan whose every chunk stays gathered ([Note: resident plans])
            assert set(timeline["params"]) == {held}
        else:  # ...one block at a time otherwise: memory is allocated as it is filled
            assert timeline["params"][0] < held
        assert max(timeline["optimizer"]) + min(timeline["grads"]) <= bound.device_state_bytes


def test_at_one_rank_a_plan_that_would_evict_keeps_its_shards_as_its_chunks(profiles):
    # [Note: a world of one]: releasing a block would free nothing its shard does not hold.
    profile = _profile(profiles, "gpt")
    options = SearchOptions(micro_batches=2, optimizer_bytes_per_numel=ADAMW_BYTES)
    evicting, resident = (predict_timeline(profile, _plan(profile, 4096, blocks, 1), options)
                          for blocks in (("min+", 1), "all"))
    assert evicting.to_dict() == resident.to_dict()
    assert len(set(evicting["params"])) == 1


def _timeline(**overrides) -> MemoryTimeline:
    fields = dict(labels=("fwd a", "fwd b", "bwd b"), params_bytes=(10, 30, 20), grads_bytes=(4, 4, 9),
                  optimizer_bytes=(8, 8, 8), activation_bytes=(1, 5, 2), budget_bytes=100)
    return MemoryTimeline(**{**fields, **overrides})


def test_a_timeline_adds_up_its_kinds_and_round_trips_through_json():
    timeline = _timeline()
    assert timeline["runtime"] == (22, 42, 37)
    assert timeline["total"] == (23, 47, 39)
    assert timeline.peak("total") == (47, "fwd b")
    assert MemoryTimeline.from_dict(json.loads(json.dumps(timeline.to_dict()))) == timeline
    assert set(KINDS) == {"params", "grads", "optimizer", "runtime", "activations", "total"}
    unknown = _timeline(activation_bytes=None)
    assert unknown["total"] is None and unknown.peak("activations") is None
    assert timeline.differences(_timeline(grads_bytes=(4, 5, 9))) == ((1, "grads", 4, 5),)


@pytest.mark.parametrize("bad,match", [
    (dict(grads_bytes=(1, 2)), "grads_bytes has 2 positions"),
    (dict(params_bytes=(1, -1, 2)), "ints >= 0"),
    (dict(budget_bytes=0), "budget_bytes"),
    (dict(micro_batches=0), "micro_batches"),
])
def test_a_malformed_timeline_is_refused(bad, match):
    with pytest.raises(TimelineError, match=match):
        _timeline(**bad)


def test_unknown_keys_and_kinds_are_refused():
    with pytest.raises(TimelineError, match="unknown MemoryTimeline key"):
        MemoryTimeline.from_dict({**_timeline().to_dict(), "cache_bytes": [1, 2, 3]})
    with pytest.raises(KeyError, match="unknown kind"):
        _timeline()["cache"]
    with pytest.raises(TimelineError, match="cannot be compared"):
        _timeline().differences(_timeline(labels=("fwd a",), params_bytes=(1,), grads_bytes=(1,),
                                          optimizer_bytes=(1,), activation_bytes=(1,)))


def test_a_step_that_does_not_run_the_model_predicts_an_empty_timeline():
    """A validation step that logs without calling the model (its profile has no access): nothing to show,
    and no error for the monitor that draws it."""
    profile = profile_model(_model("mlp"), _batch("mlp", 0), step_fn=lambda model, batch: None, backward=False)
    assert profile.accesses == ()
    for world_size in (1, 2):
        plan = _plan(profile, 4096, "all", 1, world_size)
        timeline = predict_timeline(profile, plan, SearchOptions(world_size=world_size), BUDGET_BYTES)
        assert len(timeline) == 0
