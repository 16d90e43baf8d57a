"""The plan: what the search decides and the runtime executes.

Plans are frozen dataclasses, validated on construction, changed with ``dataclasses.replace`` and
round-tripped through JSON. This module imports no ``torch.distributed`` and makes no device calls.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional, Union

PLACEMENTS = ("device", "cpu", "nvme")
ALIGN_NUMEL = 64
"""Every parameter starts at a multiple of this many elements inside its chunk. Kernels then see
the same pointer alignment as for separately allocated tensors (BLAS results can depend on it)."""
CACHE_ALL = "all"
CACHE_MIN = "min"
_MIN_PLUS = re.compile(r"min\+([0-9]+)")
REDUCE_BUFFERS = 2
"""Gradient reduce-scatters the runtime keeps in flight in backward: starting one more finishes the
oldest, so that at most this many full-chunk gradient buffers wait on a reduction while later chunks
are computed (the search budgets them: ``SearchOptions.reduce_buffers``)."""


class PlanError(ValueError):
    """A plan is malformed or does not match the model it is applied to."""


def _got(value: Any) -> str:
    """``value`` as an error message shows it: its type and its repr (shortened)."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def spare_blocks(cache_blocks: Union[int, str]) -> Optional[int]:
    """K of a ``cache_blocks`` of "min" (0) or "min+K"; None for an int or "all"."""
    if cache_blocks == CACHE_MIN:
        return 0
    match = _MIN_PLUS.fullmatch(cache_blocks) if isinstance(cache_blocks, str) else None
    return int(match.group(1)) if match else None


def min_plus_blocks(spare: int, fewest: int, n_public: int) -> int:
    """The blocks of "min+K" (``spare`` = K): the fewest one access needs plus K, at most one per public chunk."""
    return min(fewest + spare, max(n_public, fewest))


def stays_gathered(cache_blocks: int, n_public: int, offloads: bool, world_size: int) -> bool:
    """Whether every chunk is gathered once per step and kept ([Note: resident plans] in runtime/protocol.py):
    no chunk's state is offloaded (an offloaded chunk is gathered at its first use, after its update on
    the host), and every public chunk has a block of its own (``cache_blocks`` resolved to an int) or
    there is one rank, whose shards are its chunks: releasing one would free nothing and gathering it
    again would only copy it ([Note: a world of one] in runtime/chunk.py)."""
    return not offloads and (cache_blocks >= n_public or world_size == 1)


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (True/False are ints to Python, never to a plan)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(owner: Any, field: str, what: str, minimum: int, optional: bool = False) -> None:
    """Check that ``owner.field`` is an int >= ``minimum`` (or None when ``optional``); store it as an int."""
    value = getattr(owner, field)
    if optional and value is None:
        return
    expected = f"an int >= {minimum}" + (" or None" if optional else "")
    if not _is_int(value):
        raise PlanError(f"{what} field {field!r} must be {expected}, got {_got(value)}")
    if value < minimum:
        raise PlanError(f"{what} field {field!r} must be {expected}, got {value}")
    object.__setattr__(owner, field, int(value))


def _check_type(owner: Any, field: str, what: str, kind: type, expected: str) -> None:
    value = getattr(owner, field)
    if not isinstance(value, kind):
        raise PlanError(f"{what} field {field!r} must be {expected}, got {_got(value)}")


def _as_tuple(owner: Any, field: str, what: str, expected: str) -> tuple:
    """``owner.field`` as a tuple (JSON gives lists); a string or a mapping is not a sequence here."""
    value = getattr(owner, field)
    if isinstance(value, (str, bytes, Mapping, AbstractSet)) or not isinstance(value, Iterable):
        raise PlanError(f"{what} field {field!r} must be {expected}, got {_got(value)}")
    value = tuple(value)
    object.__setattr__(owner, field, value)
    return value


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of the layout: parameters packed, in order, into one flat buffer."""

    params: tuple[str, ...]
    """Parameter names (as in ``named_parameters(remove_duplicate=True)``), in packing order."""
    numel: int
    """Total elements of the chunk including padding; a multiple of the world size."""
    private: bool = False
    """A private chunk stays gathered for the whole step (tied or shared parameters)."""
    placement: str = "device"
    """Where this chunk's sharded state (fp32 master, optimizer states, gradient) lives."""

    def __post_init__(self) -> None:
        params = _as_tuple(self, "params", "chunk", "a list of parameter names (strings)")
        bad = [p for p in params if not isinstance(p, str)]
        if bad:
            raise PlanError(f"chunk field 'params' must be a list of parameter names (strings), got {_got(bad[0])} "
                            f"in {_got(list(params))}")
        if not params:
            raise PlanError("a chunk must hold at least one parameter")
        _check_int(self, "numel", "chunk", 1)
        _check_type(self, "private", "chunk", bool, "a bool (true/false)")
        _check_type(self, "placement", "chunk", str, f"one of {PLACEMENTS}")
        if self.placement not in PLACEMENTS:
            raise PlanError(f"unknown placement {self.placement!r}; use one of {PLACEMENTS}")


@dataclass(frozen=True)
class ElixirPlan:
    """How to partition and place a model: chunk layout, cache size, prefetch, placement."""

    chunk_numel: int | None = None
    """Capacity of a public chunk in elements. None: about an eighth of the model, at least 1M
    elements (or the whole model) and the largest parameter, at most 32M elements."""
    cache_blocks: Union[int, str] = CACHE_ALL
    """Chunk-sized blocks for gathered public chunks: an int, "all" (ZeRO-2: nothing is re-gathered
    within a step), "min" (the fewest blocks the model's modules need at once, grown when backward
    needs more) or "min+K" (K blocks more than "min", room to prefetch into; ZeRO-3 is "min+1")."""
    prefetch_depth: int = 2
    """How many upcoming chunks are gathered ahead of use (0 disables prefetch). Two hide a
    gather's latency behind the next access without crowding compute (measured on CPU/gloo)."""
    chunks: tuple[ChunkSpec, ...] = ()
    """An explicit layout; empty means: pack ``named_parameters()`` order with ``chunk_numel``."""
    world_size: int | None = None
    """The world size an explicit layout was built for (chunk numels are multiples of it)."""
    reduce_in_fp32: bool = True
    """Reduce-scatter gradients in fp32 (exact) rather than in the compute dtype (half the bytes)."""
    name: str = "custom"
    """A label for logs and reports."""
    recompute: tuple[str, ...] = ()
    """Blocks (module names) whose activations are recomputed in backward rather than kept: the
    runtime checkpoints them ([Note: searched recomputation] in recompute.py)."""

    def __post_init__(self) -> None:
        _check_int(self, "chunk_numel", "plan", 1, optional=True)
        blocks = f"an int >= 1, {CACHE_ALL!r}, {CACHE_MIN!r} or 'min+K' (K an int)"
        if _is_int(self.cache_blocks):
            _check_int(self, "cache_blocks", "plan", 1)
        elif self.cache_blocks != CACHE_ALL and spare_blocks(self.cache_blocks) is None:
            raise PlanError(f"plan field 'cache_blocks' must be {blocks}, got {_got(self.cache_blocks)}")
        _check_int(self, "prefetch_depth", "plan", 0)
        chunks = _as_tuple(self, "chunks", "plan", "a list of chunks")
        for i, spec in enumerate(chunks):
            if not isinstance(spec, ChunkSpec):
                raise PlanError(f"plan field 'chunks' must hold ChunkSpecs (JSON: objects), got {_got(spec)} at index {i}")
        _check_int(self, "world_size", "plan", 1, optional=True)
        _check_type(self, "reduce_in_fp32", "plan", bool, "a bool (true/false)")
        _check_type(self, "name", "plan", str, "a string")
        recompute = _as_tuple(self, "recompute", "plan", "a list of module names")
        if any(not isinstance(n, str) for n in recompute) or len(set(recompute)) != len(recompute):
            raise PlanError(f"plan field 'recompute' must list distinct module names, got {_got(self.recompute)}")
        if self.chunks and self.world_size is None:
            raise PlanError("a plan with an explicit chunk layout must state the world_size it was built for")
        if self.world_size is not None:
            for spec in self.chunks:
                if spec.numel % self.world_size:
                    raise PlanError(f"chunk numel {spec.numel} is not a multiple of world_size {self.world_size}")
        names = [name for spec in self.chunks for name in spec.params]
        if len(names) != len(set(names)):
            raise PlanError("a parameter appears in more than one chunk of the plan")

    @property
    def offloads(self) -> bool:
        """Whether any chunk's sharded state is placed off the device."""
        return any(spec.placement != "device" for spec in self.chunks)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Serialise to a JSON string, and write it to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ElixirPlan":
        """Build from a dict, rejecting unknown keys with a message that lists the known ones."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a dict (a JSON object), got {_got(data)}")
        _reject_unknown(cls, data, "plan")
        data = dict(data)
        raw_chunks = data.pop("chunks", ())
        if isinstance(raw_chunks, (str, bytes, Mapping)) or not isinstance(raw_chunks, (list, tuple)):
            raise PlanError(f"plan field 'chunks' must be a list of chunk objects, got {_got(raw_chunks)}")
        chunks = []
        for i, raw in enumerate(raw_chunks):
            if isinstance(raw, ChunkSpec):
                chunks.append(raw)
                continue
            if not isinstance(raw, Mapping):
                raise PlanError(f"chunk {i} of the plan must be an object with keys {_field_names(ChunkSpec)}, "
                                f"got {_got(raw)}")
            _reject_unknown(ChunkSpec, raw, "chunk")
            try:
                chunks.append(ChunkSpec(**raw))
            except PlanError as err:
                raise PlanError(f"chunk {i} of the plan: {err}") from None
            except TypeError as err:  # a required key is missing
                raise PlanError(f"chunk {i} of the plan: {err}; a chunk needs at least 'params' and 'numel'") from None
        return cls(**data, chunks=tuple(chunks))

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> "ElixirPlan":
        """Load from a JSON string or a path to a JSON file."""
        return cls.from_dict(load_json_object(text_or_path, "plan", PlanError))


def load_json_object(text_or_path: str | os.PathLike, what: str, error: type[Exception]) -> dict[str, Any]:
    """A JSON object from a string or a file, or ``error`` saying what is wrong with it."""
    text = str(text_or_path)
    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    elif not text.lstrip().startswith(("{", "[")):  # not JSON text either
        raise error(f"{what} file {text!r} does not exist")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{what} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise error(f"a {what} JSON must be an object")
    return data


def _field_names(cls: type) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(cls))


def _reject_unknown(cls: type, data: Mapping[str, Any], what: str) -> None:
    known = set(_field_names(cls))
    unknown = sorted(set(data) - known, key=str)
    if unknown:
        raise PlanError(f"unknown {what} key(s) {unknown}; known keys are {sorted(known)}")


def check_private_params(names: Any, plan: "ElixirPlan | str") -> tuple[str, ...]:
    """``private_params`` as a tuple of names, checked against ``plan``'s explicit layout if it has one.

    Raises:
        TypeError: ``names`` is a string (it would be split into characters) or holds non-strings.
        PlanError: a name sits in a public chunk of the plan's layout.
    """
    if isinstance(names, (str, bytes)):
        raise TypeError(f"private_params must be a list of parameter names, got the string {names!r}; "
                        f"write private_params=[{names!r}]")
    if isinstance(names, Mapping) or not isinstance(names, Iterable):
        raise TypeError(f"private_params must be a list of parameter names, got {_got(names)}")
    names = tuple(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"private_params must be a list of parameter names (strings), got {_got(bad[0])} "
                        f"in {_got(list(names))}")
    if isinstance(plan, ElixirPlan) and plan.chunks:
        public = sorted({n for spec in plan.chunks if not spec.private for n in spec.params} & set(names))
        if public:
            raise PlanError(f"private_params {public} sit in public chunks of the plan's layout; give each its own "
                            "private chunk in the plan (private=true), or leave them out of private_params")
    return names


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return int(math.ceil(value / multiple) * multiple)


def shard_aligned(numel: int, world_size: int) -> int:
    """A chunk capacity of at least ``numel`` whose ``world_size`` shards each hold a multiple of
    ``ALIGN_NUMEL`` elements.

    [Note: shards on the vector grid]
    Parameters start at multiples of ``ALIGN_NUMEL`` in their chunk, and so does every shard: a rank's
    view of a parameter then starts on the whole parameter's 64-element grid and ends either where the
    parameter ends or on the grid. Element-wise kernels (the optimizer's step on the shard views) run a
    vectorised body and a scalar loop for the remainder; in fp32 both give the same bits, but in bf16
    and fp16 the remainder loop rounds an intermediate that the vector body keeps in fp32 (torch's SGD
    with momentum on a bf16 parameter of 256 elements, viewed as two shards split at element 136: 6
    elements a bf16 step apart from the whole parameter's after 3 steps). On the grid, every element
    takes the path it takes on the whole parameter, so a low-precision master (``precision="bf16-true"``,
    a parameter kept in its own dtype) trains to the bits DDP gets. It costs at most
    ``ALIGN_NUMEL - 1`` elements per shard. A layout given in a plan is run as given."""
    return round_up(numel, world_size * ALIGN_NUMEL)


DEFAULT_CHUNK_NUMEL = 32 * 1024 * 1024
"""Largest default chunk capacity: big enough that collectives run near peak bandwidth."""
DEFAULT_MIN_CHUNKS = 8
"""Without a searched plan, aim for about this many public chunks, so that gathers and
reduce-scatters of one chunk overlap with compute on the others."""
DEFAULT_MIN_CHUNK_NUMEL = 1 << 20
"""...but no smaller than this: every chunk pays a collective's launch latency twice a step
(measured ~0.8 ms with gloo on a CPU, where 19 chunks of 260K elements ran 30% slower than 8 of 720K)."""


def default_chunk_numel(public_numels: Sequence[int], world_size: int = 1) -> int:
    """The chunk capacity of a plan that leaves ``chunk_numel`` unset, for public parameters of these
    sizes packed in this order.

    About ``DEFAULT_MIN_CHUNKS`` chunks of ``DEFAULT_MIN_CHUNK_NUMEL`` to ``DEFAULT_CHUNK_NUMEL``
    elements, then the smallest capacity that packs the parameters into no more chunks than that:
    every chunk is gathered and reduced at its capacity, so a last chunk that holds a sliver of the
    model but is padded to a full one costs its full size in memory and on the network (a model of
    1.2M elements packed into 1M-element chunks moved 2.1M elements per collective round, balanced
    1.2M). What is left unused is then at most about one parameter per chunk.
    """
    numels = list(public_numels) or [1]
    used = chunk_used_numel(numels)
    largest = max(numels)
    target = max(largest, min(DEFAULT_CHUNK_NUMEL, max(DEFAULT_MIN_CHUNK_NUMEL, -(-used // DEFAULT_MIN_CHUNKS))))
    high = round_up(target, world_size)
    count = len(_next_fit(numels, high))
    # a lower bound: the elements themselves, without the alignment gaps that a split between chunks removes
    low = min(high, max(largest, -(-sum(numels) // count)))
    while low < high:  # next-fit needs no more chunks when they grow, so the fewest is found by bisection
        mid = (low + high) // 2
        if len(_next_fit(numels, round_up(mid, world_size))) <= count:
            high = mid
        else:
            low = mid + 1
    return low


def _next_fit(numels: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``numels`` packed in order into chunks of ``capacity`` (aligned, as ``slot_offsets``);
    a parameter larger than the capacity gets a chunk of its own (the caller checks sizes)."""
    groups: list[list[int]] = []
    used = 0
    for i, numel in enumerate(numels):
        start = round_up(used, ALIGN_NUMEL)
        if not groups or start + numel > capacity:
            groups.append([])
            start = 0
        groups[-1].append(i)
        used = start + numel
    return groups


def slot_offsets(numels: Sequence[int]) -> list[int]:
    """Offset of each parameter inside its chunk, each aligned to ``ALIGN_NUMEL`` elements."""
    offsets, used = [], 0
    for numel in numels:
        start = round_up(used, ALIGN_NUMEL)
        offsets.append(start)
        used = start + numel
    return offsets


def chunk_used_numel(numels: Sequence[int]) -> int:
    """Elements a chunk needs for these parameters, alignment gaps included."""
    return slot_offsets(numels)[-1] + numels[-1] if numels else 0


def pack_chunks(
    order: Sequence[tuple[str, int]],
    chunk_numel: int,
    world_size: int,
    private: Iterable[str] = (),
) -> tuple[ChunkSpec, ...]:
    """Pack parameters greedily, in the given order, into chunks of one size.

    Args:
        order: (name, numel) per parameter in the order they should be laid out (first use).
        chunk_numel: capacity of a public chunk; rounded up to a multiple of ``world_size`` (the search's
            sizes and a plan's default packing are already ``shard_aligned``).
        world_size: number of ranks each chunk is sharded over.
        private: names that get a chunk of their own that stays gathered (tied or shared weights), its
            shards on the vector grid ([Note: shards on the vector grid]).

    Returns:
        Public chunks in order, then one private chunk per private parameter.
    """
    private = set(private)
    capacity = round_up(chunk_numel, world_size)
    largest = max((n for name, n in order if name not in private), default=0)
    if largest > capacity:
        raise PlanError(f"chunk_numel {chunk_numel} is smaller than the largest parameter ({largest} elements)")
    names = [name for name, _ in order if name not in private]
    numels = [numel for name, numel in order if name not in private]
    public = [ChunkSpec(tuple(names[i] for i in group), capacity) for group in _next_fit(numels, capacity)]
    privates = [ChunkSpec((name,), shard_aligned(numel, world_size), private=True) for name, numel in order
                if name in private]
    return tuple(public + privates)


PRESETS: Mapping[str, ElixirPlan] = MappingProxyType({
    "zero2": ElixirPlan(cache_blocks=CACHE_ALL, name="zero2"),
    # The chunks one module needs, and one block to gather the next module's chunk into while it runs
    # (FSDP's forward and backward prefetch). Without the spare block nothing can be prefetched: at
    # "min", every gather waits in the open (the harness's GPT on CPU/gloo: 0.91x FSDP2's throughput
    # at "min", 1.18x with the spare block, paired ratios in BENCHMARKS.md).
    "zero3": ElixirPlan(cache_blocks="min+1", prefetch_depth=1, name="zero3"),
})
"""Fixed plans for comparison runs, registered as the strategy names "elixir_zero2"/"elixir_zero3"."""


PlanInput = Union[str, ElixirPlan, Mapping[str, Any], os.PathLike]
"""What ``ElixirStrategy(plan=...)`` accepts."""


def resolve_plan(plan: PlanInput) -> Union[str, ElixirPlan]:
    """"auto", an ElixirPlan, a dict, a preset name ("zero2"/"zero3"), a plan JSON file's path or JSON text.

    A bare word that is none of these is reported as a mistyped name (with the valid ones), not as a
    missing file."""
    if isinstance(plan, ElixirPlan):
        return plan
    if isinstance(plan, Mapping):
        return ElixirPlan.from_dict(dict(plan))
    if plan == "auto":
        return "auto"
    if isinstance(plan, str) and plan in PRESETS:
        return PRESETS[plan]
    valid = ("auto", *PRESETS)
    names = ", ".join(repr(n) for n in valid)
    if isinstance(plan, (str, os.PathLike)):
        text = str(plan)
        if os.path.isfile(text) or text.lstrip().startswith(("{", "[")):
            return ElixirPlan.from_json(plan)  # a plan file or JSON text: its own errors say what is wrong
        if isinstance(plan, str) and not text.endswith(".json") and "/" not in text and os.sep not in text:
            # a bare word: a mistyped name, not a missing file
            word = text.strip().lower()
            close = difflib.get_close_matches(word[7:] if word.startswith("elixir_") else word, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PlanError(f"plan={plan!r} is not a plan name (valid: {names}) nor an existing plan JSON file{hint}")
        raise PlanError(f"plan file {text!r} does not exist; plan= takes a plan name ({names}), an ElixirPlan, "
                        "a dict, JSON text or the path of a plan JSON file")
    raise PlanError(f"plan must be {names}, an ElixirPlan, a dict, JSON text or a JSON file path, "
                    f"got {type(plan).__name__} {plan!r}")
