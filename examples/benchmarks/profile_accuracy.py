"""How good is the profiler? Predicted vs measured step time on this machine, and 20B profile time.

    python examples/benchmarks/profile_accuracy.py [--device cpu] [--threads N] [--repeats 7]

For a few sizes of the example GPT: the ModelProfile's compute estimate over the measured
HardwareProfile against the median wall time of real forward+loss+backward steps, twice: with the
peak-rate roofline alone ("roofline": no operator overhead, every matmul and attention at the peak
matmul rate, bytes at the copy bandwidth) and with the calibrated model ("calibrated": the measured
per-operator overhead and the size-dependent matmul, attention and elementwise rates, see
[Note: roofline] in profile/cost.py); then how long profiling a ~20B GPT (hidden 8192, 24 layers,
vocab 50257, sequence 1024) takes on fake tensors and how much resident memory it adds.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

import torch

from lightning_elixir.demos.gpt import GPT, BigramTokens, GPTConfig, GPTLightningModule
from lightning_elixir.profile import HardwareProfile, profile_hardware, profile_model

SIZES = [  # (n_layer, n_embd, block_size, batch)
    (4, 128, 64, 8),
    (4, 256, 128, 8),
    (6, 512, 256, 8),
]


def gpt_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(batch[0])
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), batch[1].view(-1))


def measured_step_s(model: torch.nn.Module, batch, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """Median wall time of real steps (first one discarded as warm-up)."""
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = gpt_loss(model, batch)
        loss.backward()
        _sync(device)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def accuracy_rows(device: torch.device, dtype: torch.dtype, repeats: int) -> list[tuple]:
    hardware = profile_hardware(device, compute_dtype=dtype, refresh=True)  # same conditions as the steps
    print(calibration(hardware))
    rows = []
    for n_layer, n_embd, block_size, batch_size in SIZES:
        torch.manual_seed(0)
        module = GPTLightningModule(n_layer=n_layer, n_embd=n_embd, block_size=block_size, n_head=4).to(device)
        data = BigramTokens(512, block_size, batch_size)
        x, y = (torch.stack(t).to(device) for t in zip(*(data[i] for i in range(batch_size))))
        profile = profile_model(module.model, (x, y), step_fn=gpt_loss, compute_dtype=dtype, hardware=hardware)
        roofline = profile_model(module.model, (x, y), step_fn=gpt_loss, compute_dtype=dtype,
                                 hardware=peak_roofline(hardware)).compute_s
        real_s = measured_step_s(module.model, (x, y), dtype, device, repeats)
        params_m = profile.total_numel / 1e6
        rows.append((f"L{n_layer} d{n_embd} T{block_size} B{batch_size}", _dtype(dtype), f"{params_m:.1f}M",
                     f"{real_s * 1e3:.1f}", f"{roofline * 1e3:.1f}", f"{roofline / real_s:.2f}",
                     f"{profile.compute_s * 1e3:.1f}", f"{profile.compute_s / real_s:.2f}"))
    return rows


def peak_roofline(hardware: HardwareProfile) -> HardwareProfile:
    """``hardware`` without its calibration: no operator overhead, every matmul and attention at the
    peak matmul rate, bytes at the copy bandwidth."""
    return dataclasses.replace(hardware, op_overhead_s=0.0, matmul_points=(), attention_points=(),
                               attention_backward_points=(), elementwise_points=())


def calibration(hardware: HardwareProfile) -> str:
    """One line with the measured compute calibration of ``hardware``."""

    def span(points: tuple[tuple[float, float], ...], scale: float) -> str:
        rates = [rate / scale for _, rate in points]
        return f"{min(rates):.0f}-{max(rates):.0f}" if rates else "-"

    return (f"{hardware.compute_dtype}: operator overhead {hardware.op_overhead_s * 1e6:.1f} us, matmul "
            f"{span(hardware.matmul_points, 1e9)} GFLOP/s (peak {hardware.matmul_flops_per_s / 1e9:.0f}), attention "
            f"{span(hardware.attention_points, 1e9)} / backward {span(hardware.attention_backward_points, 1e9)} "
            f"GFLOP/s, elementwise {span(hardware.elementwise_points, 1e9)} GB/s "
            f"(copy {hardware.device_memory_bytes_per_s / 1e9:.0f})")


def profile_20b() -> tuple[int, float, float]:
    """(parameters, seconds, resident bytes added) for profiling the ~20B GPT on fake tensors."""
    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=64, n_embd=8192)
    with torch.device("meta"):
        model = GPT(config)
    tokens = torch.zeros(1, 1024, dtype=torch.long)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    profile = profile_model(model, (tokens, tokens), step_fn=gpt_loss, compute_dtype=torch.bfloat16,
                            param_dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib) * 1024
    return profile.total_numel, seconds, grew


def print_table(header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(cell).rjust(w) for cell, w in zip(row, widths)))


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: as configured)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-20b", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if not args.skip_20b:  # first, so that the resident high-water mark is not the real models'
        numel, seconds, grew = profile_20b()
        print(f"20B GPT profile: {numel / 1e9:.2f}B parameters in {seconds:.2f} s, "
              f"peak resident memory +{grew / 2**20:.0f} MiB\n")
    rows = [row for dtype in (torch.float32, torch.bfloat16) for row in accuracy_rows(device, dtype, args.repeats)]
    print(f"\nstep time on {device} ({torch.get_num_threads()} CPU threads): predicted vs measured")
    print_table(("model", "dtype", "params", "measured_ms", "roofline_ms", "ratio", "calibrated_ms", "ratio"), rows)


if __name__ == "__main__":
    main()
