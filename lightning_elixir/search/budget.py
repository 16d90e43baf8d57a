"""The device memory budget: parse a user's ``device_memory_limit``."""

from __future__ import annotations

import re
from typing import Union

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    # Bare letters follow the convention of nvidia-smi and Slurm: binary units.
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*|%)\s*$")


def _accepted(name: str) -> str:
    """The forms a limit takes, for errors."""
    return (f'bytes as an int, a fraction of {_owner(name)} memory in (0, 1] as a float, '
            'or a string like "40GiB", "40GB", "40G", "80%"')


def parse_memory_limit(limit: Union[int, float, str], device_total_bytes: int,
                       name: str = "device_memory_limit") -> int:
    """The device memory budget in bytes from a user-facing limit.

    Args:
        limit: bytes (int); a fraction of the device's memory (float in (0, 1]); or a string with a
            unit ("40GiB", "40 GB", "512MiB", "40G" = GiB) or a percentage ("80%"). A bare numeric
            string is a fraction when it has a decimal point and is at most 1 ("0.8"), else bytes.
        device_total_bytes: total memory of one device (for fractions and the sanity check).
        name: the argument's name, for errors (``host_memory_limit`` takes the same forms).

    Returns:
        The budget in bytes, at most ``device_total_bytes``.

    Raises:
        ValueError: the limit is not understood, not positive, or larger than the device.
    """
    if device_total_bytes <= 0:
        raise ValueError(f"device_total_bytes must be positive, got {device_total_bytes}")
    nbytes = _to_bytes(limit, device_total_bytes, name)
    if nbytes <= 0:
        raise ValueError(f"{name} must be positive, got {limit!r}")
    if nbytes > device_total_bytes:
        raise ValueError(f"{name} {limit!r} ({nbytes:,} bytes) exceeds the {_owner(name)}'s {device_total_bytes:,} "
                         "bytes; use at most that, or a fraction like 0.9")
    return nbytes


def check_memory_limit(limit: Union[int, float, str], name: str = "device_memory_limit") -> None:
    """Check the form of a ``device_memory_limit`` without knowing the device (at construction).

    Accepts what ``parse_memory_limit`` accepts for some device: positive bytes, a fraction in
    (0, 1], a string with a unit or a percentage. Whether it fits the device is checked once the
    device is known.

    Raises:
        ValueError: the limit is not understood or not positive.
    """
    if _to_bytes(limit, _ANY_DEVICE_BYTES, name) <= 0:
        raise ValueError(f"{name} must be positive, got {limit!r}")


_ANY_DEVICE_BYTES = 1 << 60
"""A device size for checking a limit's form: fractions of it are positive unless vanishingly small."""


def _to_bytes(limit: Union[int, float, str], device_total_bytes: int, name: str) -> int:
    """Bytes from an int, a fraction or a string, before range checks."""
    if isinstance(limit, bool):
        raise ValueError(f"{name} must be {_accepted(name)}; got {limit!r}")
    if isinstance(limit, int):
        return limit
    if isinstance(limit, float):
        if not 0.0 < limit <= 1.0:
            raise ValueError(f"a float {name} is a fraction of {_owner(name)} memory in (0, 1], got {limit}")
        return int(limit * device_total_bytes)
    if isinstance(limit, str):
        return _parse_string(limit, device_total_bytes, name)
    raise ValueError(f"{name} must be {_accepted(name)}; got {type(limit).__name__}")


def _owner(name: str) -> str:
    """Whose memory a limit is of: "host" for host_memory_limit, else "device"."""
    return "host" if name.startswith("host") else "device"


def _parse_string(text: str, device_total_bytes: int, name: str) -> int:
    """Bytes from a string with a unit, a percentage, or a bare number."""
    match = _PATTERN.match(text)
    if match is None or match.group(2).lower() not in {"", "%", *_UNITS}:
        raise ValueError(f"cannot read {name} {text!r}; use {_accepted(name)}")
    number, unit = match.group(1), match.group(2).lower()
    value = float(number)
    if unit == "%":
        return _to_bytes(value / 100.0, device_total_bytes, name)
    if unit:
        return int(value * _UNITS[unit])
    # A bare number: up to 1 with a decimal point it is a fraction ("0.8"), otherwise bytes ("2e9").
    return int(value) if number.isdigit() or value > 1.0 else _to_bytes(value, device_total_bytes, name)
