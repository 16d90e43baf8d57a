"""Synthetic model and hardware profiles for the search tests (built directly, no tracing)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from lightning_elixir.profile.types import Access, HardwareProfile, ModelProfile, ParamInfo

GiB = 1 << 30


def hardware(**overrides) -> HardwareProfile:
    """An H100-like node: fast collectives, PCIe 4 host link, a CPU optimizer 100x slower."""
    fields = dict(
        device_name="synthetic", device_count=8, world_size=8, torch_version="test",
        device_memory_bytes=80 * GiB, matmul_flops_per_s=4e14, device_memory_bytes_per_s=3e12,
        h2d_bytes_per_s=2.5e10, d2h_bytes_per_s=2.5e10,
        all_gather_bytes_per_s=((1 << 20, 2e10), (1 << 26, 1.5e11), (1 << 30, 2e11)),
        reduce_scatter_bytes_per_s=((1 << 20, 2e10), (1 << 26, 1.5e11), (1 << 30, 2e11)),
        optimizer_device_numel_per_s=1e11, optimizer_cpu_numel_per_s=1e9,
        nvme_read_bytes_per_s=3e9, nvme_write_bytes_per_s=2e9, collective_latency_s=2e-5,
    )
    fields.update(overrides)
    return HardwareProfile(**fields)


def flat_hardware(gather_bytes_per_s: float, reduce_bytes_per_s: float, **overrides) -> HardwareProfile:
    """Hardware with size-independent collective bandwidths and no latency (for hand arithmetic)."""
    fields = dict(all_gather_bytes_per_s=((1, gather_bytes_per_s),),
                  reduce_scatter_bytes_per_s=((1, reduce_bytes_per_s),), collective_latency_s=0.0)
    fields.update(overrides)
    return hardware(**fields)


def chain_profile(
    modules: Sequence[Sequence[int]],
    forward_s: Sequence[float] | None = None,
    backward_s: Sequence[float] | None = None,
    activation_bytes: int = 0,
    compute_dtype: str = "bfloat16",
    shared: Sequence[int] = (),
) -> ModelProfile:
    """A chain of modules, each owning parameters ``p{module}_{i}`` of the given numels.

    Forward visits modules in order, backward in reverse. A module index in ``shared`` is used
    again right after the last module (a tied head), so its parameters are shared.
    """
    names = [[f"p{m}_{i}" for i in range(len(numels))] for m, numels in enumerate(modules)]
    params = tuple(ParamInfo(n, k, (k,), "float32", True, f"m{m}")
                   for m, numels in enumerate(modules) for n, k in zip(names[m], numels))
    forward_s = forward_s or [0.0] * len(modules)
    backward_s = backward_s or [0.0] * len(modules)
    order = list(range(len(modules))) + list(shared)
    fwd = [Access("forward", f"m{m}", tuple(names[m]), activation_bytes, forward_s[m]) for m in order]
    bwd = [Access("backward", f"m{m}", tuple(names[m]), activation_bytes, backward_s[m]) for m in reversed(order)]
    shared_names = tuple(n for m in shared for n in names[m])
    return ModelProfile(params, tuple(fwd + bwd), shared_names, activation_bytes, activation_bytes, compute_dtype,
                        sum(a.compute_s for a in fwd), sum(a.compute_s for a in bwd))


def gpt_profile(hidden: int, layers: int, vocab: int = 50257, seq: int = 2048, batch: int = 1,
                flops_per_s: float = 4e14) -> ModelProfile:
    """A GPT-2-shaped profile (tied embedding) in bf16: ~12 * layers * hidden^2 parameters."""
    tokens = batch * seq
    params: list[ParamInfo] = []
    fwd: list[Access] = []
    live = 0

    def module(name: str, shapes: dict[str, tuple[int, ...]], out_features: int, matmul_numel: int = 0) -> None:
        nonlocal live
        for pname, shape in shapes.items():
            numel = 1
            for s in shape:
                numel *= s
            params.append(ParamInfo(f"{name}.{pname}", numel, shape, "float32", True, name))
        live += tokens * out_features * 2
        flops = 2.0 * tokens * matmul_numel
        fwd.append(Access("forward", name, tuple(f"{name}.{p}" for p in shapes), live, flops / flops_per_s, flops))

    module("wte", {"weight": (vocab, hidden)}, hidden)
    module("wpe", {"weight": (seq, hidden)}, hidden)
    for i in range(layers):
        h = f"h.{i}"
        module(f"{h}.ln_1", {"weight": (hidden,), "bias": (hidden,)}, hidden)
        h3, h4 = 3 * hidden, 4 * hidden
        module(f"{h}.attn.c_attn", {"weight": (h3, hidden), "bias": (h3,)}, h3, h3 * hidden)
        module(f"{h}.attn.core", {}, hidden, 2 * seq * hidden)
        module(f"{h}.attn.c_proj", {"weight": (hidden, hidden), "bias": (hidden,)}, hidden, hidden * hidden)
        module(f"{h}.ln_2", {"weight": (hidden,), "bias": (hidden,)}, hidden)
        module(f"{h}.mlp.c_fc", {"weight": (h4, hidden), "bias": (h4,)}, h4, h4 * hidden)
        module(f"{h}.mlp.c_proj", {"weight": (hidden, h4), "bias": (hidden,)}, hidden, h4 * hidden)
    module("ln_f", {"weight": (hidden,), "bias": (hidden,)}, hidden)
    flops = 2.0 * tokens * vocab * hidden
    fwd.append(Access("forward", "lm_head", ("wte.weight",), live + tokens * vocab * 4, flops / flops_per_s, flops))
    bwd = [Access("backward", a.module, a.params, a.live_bytes, 2 * a.compute_s, 2 * a.flops) for a in reversed(fwd)]
    peak = fwd[-1].live_bytes
    return ModelProfile(tuple(params), tuple(fwd + bwd), ("wte.weight",), peak, peak, "bfloat16",
                        sum(a.compute_s for a in fwd), sum(a.compute_s for a in bwd))


@st.composite
def chain_profiles(draw, max_modules: int = 8) -> ModelProfile:
    """Random chains: 1-8 modules of 1-3 parameters, random compute, maybe a tied module."""
    n = draw(st.integers(1, max_modules))
    modules = [draw(st.lists(st.integers(1, 4000), min_size=1, max_size=3)) for _ in range(n)]
    forward_s = draw(st.lists(st.floats(1e-4, 1e-2), min_size=n, max_size=n))
    shared = draw(st.sampled_from([(), (0,)])) if n > 1 else ()
    activation = draw(st.integers(0, 1 << 16))
    dtype = draw(st.sampled_from(["bfloat16", "float32"]))
    return chain_profile(modules, forward_s, [2 * s for s in forward_s], activation, dtype, shared)


@st.composite
def hardwares(draw) -> HardwareProfile:
    """Random but physically ordered hardware: the CPU optimizer is slower than the device's."""
    gather = draw(st.floats(1e5, 1e8))
    device_opt = draw(st.floats(1e6, 1e9))
    return hardware(
        all_gather_bytes_per_s=((1 << 10, gather / 4), (1 << 16, gather)),
        reduce_scatter_bytes_per_s=((1 << 10, gather / 4), (1 << 16, gather * draw(st.floats(0.5, 2.0)))),
        h2d_bytes_per_s=draw(st.floats(1e5, 1e8)), d2h_bytes_per_s=draw(st.floats(1e5, 1e8)),
        optimizer_device_numel_per_s=device_opt,
        optimizer_cpu_numel_per_s=device_opt * draw(st.floats(0.01, 1.0)),
        nvme_read_bytes_per_s=draw(st.floats(1e4, 1e7)), nvme_write_bytes_per_s=draw(st.floats(1e4, 1e7)),
        collective_latency_s=draw(st.floats(0.0, 1e-4)), comm_overlap=draw(st.floats(0.0, 1.0)),
    )
