"""When nothing fits: the minimum memory is stated exactly, with the lever that would help."""

from __future__ import annotations

import pytest

from lightning_elixir.search import NoPlanFitsError, SearchOptions, search
from lightning_elixir.search.report import format_bytes
from tests.search.profiles import chain_profile, hardware

MODEL = chain_profile([[1000], [1000], [1000], [1000]], activation_bytes=100)


def options(**kw) -> SearchOptions:
    return SearchOptions(world_size=2, min_chunk_numel=1, shard_align_numel=1, margin_bytes=0, **kw)


def no_fit(model, budget, opts, hw=None) -> NoPlanFitsError:
    with pytest.raises(NoPlanFitsError) as info:
        search(model, hw or hardware(), budget, opts)
    return info.value


def test_the_stated_minimum_is_exact():
    err = no_fit(MODEL, 1000, options())
    assert isinstance(err, ValueError)
    assert f"needs at least {format_bytes(err.min_device_bytes)}" in str(err)
    search(MODEL, hardware(), err.min_device_bytes, options())  # fits exactly there
    with pytest.raises(NoPlanFitsError):
        search(MODEL, hardware(), err.min_device_bytes - 1, options())


def test_activations_point_at_the_micro_batch_and_checkpointing():
    model = chain_profile([[1000], [1000]], activation_bytes=1 << 20)
    err = no_fit(model, 1 << 19, options())
    message = str(err)
    assert "activations dominate" in message
    assert "smaller micro-batch" in message and "activation checkpointing" in message
    assert "activations 1.00 MiB" in message
    assert err.levers[0].startswith("activations dominate")


def test_cpu_memory_limit_points_at_nvme():
    err = no_fit(MODEL, 40_000, options(host_memory_bytes=1000))
    assert "CPU memory is the limit" in str(err)
    assert "nvme_path" in str(err)
    assert not any("activations dominate" in lever for lever in err.levers)


def test_offload_disabled_says_so():
    err = no_fit(MODEL, 40_000, options(allow_cpu=False))
    assert "offloading sharded state to CPU or NVMe would help" in str(err)
    assert "allow_cpu=False" in str(err)


def test_nvme_without_measured_bandwidth_says_so():
    hw = hardware(nvme_read_bytes_per_s=0.0, nvme_write_bytes_per_s=0.0)
    err = no_fit(MODEL, 40_000, options(allow_cpu=False, nvme_available=True), hw)
    assert "bandwidth was not measured" in str(err)


def test_more_devices_are_offered_with_their_estimate_where_they_help():
    err = no_fit(MODEL, 1000, options())
    more = [lever for lever in err.levers if lever.startswith("more devices")]
    assert len(more) == 1 and "with 4 ranks the most frugal plan needs" in more[0]


def test_more_devices_are_not_offered_where_activations_fill_every_rank():
    model = chain_profile([[100], [100]], activation_bytes=1 << 20)
    err = no_fit(model, 1 << 19, options())
    more = [lever for lever in err.levers if lever.startswith("more devices")]
    assert len(more) == 1 and more[0].startswith("more devices would not help")


def test_a_bad_budget_is_a_plain_value_error():
    for budget in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="budget_bytes"):
            search(MODEL, hardware(), budget, options())
