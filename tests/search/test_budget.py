"""parse_memory_limit: bytes, fractions, units and percentages."""

from __future__ import annotations

import pytest

from lightning_elixir.search import parse_memory_limit

TOTAL = 80 * 2**30


@pytest.mark.parametrize(("limit", "expected"), [
    (1234, 1234),
    (0.5, 40 * 2**30),
    (1.0, TOTAL),
    ("40GiB", 40 * 2**30),
    ("40 GiB", 40 * 2**30),
    ("40gib", 40 * 2**30),
    ("40G", 40 * 2**30),
    ("40GB", 40 * 10**9),
    ("512MiB", 512 * 2**20),
    ("1.5GiB", 3 * 2**29),
    ("80%", 64 * 2**30),
    ("0.25", 20 * 2**30),
    ("1073741824", 2**30),
    ("2e9", 2 * 10**9),
])
def test_accepted_forms(limit, expected):
    assert parse_memory_limit(limit, TOTAL) == expected


@pytest.mark.parametrize("limit", ["forty", "40 parsecs", "", "-1GiB", 0, -5, 0.0, 1.5, True, None, [1], "0%"])
def test_rejected_forms(limit):
    with pytest.raises(ValueError):
        parse_memory_limit(limit, TOTAL)


def test_more_than_the_device_is_an_error_that_says_so():
    with pytest.raises(ValueError, match="exceeds the device"):
        parse_memory_limit("100GiB", TOTAL)


@pytest.mark.parametrize("limit", ["-3GiB", 1.5, [1]])
def test_a_host_limit_is_explained_as_host_memory(limit):
    with pytest.raises(ValueError, match="fraction of host memory") as refused:
        parse_memory_limit(limit, TOTAL, name="host_memory_limit")
    assert "device" not in str(refused.value)
