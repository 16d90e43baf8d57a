"""The report: the markdown tables of a grid's results, with ratios to DDP and to the best peer, and the plot
of tokens/s against budget."""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Optional

from examples.benchmarks.harness_rank import write_json
from examples.benchmarks.harness_systems import ELIXIR_SYSTEMS, base_system


def status_cell(row: dict, width: int = 90) -> str:
    """A failure as a table cell: "OOM", or the status and the start of its reason."""
    if row["status"] == "OOM":
        return "OOM"
    text = f"{row['status']}: {row['reason']}"
    return text if len(text) <= width else text[:width - 3] + "..."


def _ratio(row: dict, base: Optional[dict]) -> str:
    return f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}" if base and row["status"] == "ok" else "-"


def paired_ratio(row: dict, base: Optional[dict]) -> Optional[float]:
    """The median over rounds of ``base``'s step time over ``row``'s in the same round: on a noisy
    machine, steadier than the ratio of the best rounds (each round runs both within minutes)."""
    if not base or row["status"] != "ok" or base["status"] != "ok":
        return None
    pairs = [(b, r) for b, r in zip(base.get("rounds", ()), row.get("rounds", ()))
             if isinstance(b, float) and isinstance(r, float)]
    return statistics.median(b / r for b, r in pairs) if pairs else None


def _cells(row: dict, ddp: Optional[dict], peer: Optional[dict], gpu: bool) -> list[str]:
    """A row's measured cells, from "step ms" to the last number."""
    if row["status"] != "ok":
        return [status_cell(row)]
    paired = paired_ratio(row, ddp)
    cells = [f"{row['step_s'] * 1e3:.0f}", f"{row['cpu_s'] * 1e3:.0f}", f"{row['tokens_per_s']:.0f}", _ratio(row, ddp),
             "-" if paired is None else f"{paired:.2f}", _ratio(row, peer),
             f"{row['peak_host_bytes'] / 2**20:.0f}"]
    if gpu:
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        cells += [f"{row['peak_device_bytes'] / 2**30:.1f}", f"{row['tflops']:.1f}", mfu]
    return cells


def markdown_table(args: argparse.Namespace, rows: list[dict]) -> str:
    """One workload's rows, with ratios to DDP and to the best peer of the same budget."""
    gpu = args.accelerator == "gpu"
    lead = ["budget", "system"] if gpu else ["system"]
    numbers = ["step ms", "CPU ms", "tokens/s", "vs ddp", "vs ddp, paired", "vs best peer", "peak host MiB"]
    numbers += ["peak device GiB", "TFLOP/s", "MFU"] if gpu else []
    header = [*lead, *numbers, "notes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    best_peers = []
    for budget in args.budget_list:
        ok = [r for r in rows if r["budget"] == budget and r["status"] == "ok"]
        ddp = next((r for r in ok if r["system"] == "ddp"), None)
        peer = max((r for r in ok if base_system(r["system"]) not in ELIXIR_SYSTEMS), key=lambda r: r["tokens_per_s"], default=None)
        best_peers.append(f"{budget + ': ' if budget else ''}{peer['system'] if peer else 'none ran'}")
        for r in (r for r in rows if r["budget"] == budget):
            measured = _cells(r, ddp, peer, gpu)
            cells = [*([budget or "all"] if gpu else []), r["system"], *measured,
                     *["-"] * (len(numbers) - len(measured)), r.get("note", "")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nbest peer: {'; '.join(best_peers)}\n"


def report(args: argparse.Namespace, results: list[dict], load: float, elapsed_s: float) -> None:
    print(f"{args.devices} x {args.accelerator}, {args.precision}, batch {args.batch_size}/rank x seq "
          f"{args.block_size}; {args.warmup} warm-up + median of {args.steps} steps (slowest rank), fastest of "
          f"{args.rounds} round(s); 1-minute load average before: {load:.2f}; {elapsed_s:.0f} s in all\n")
    print("CPU ms: host CPU time of one step, all of a process's threads, the mean over ranks. vs ddp: "
          "tokens/s over DDP's, best rounds; paired: the median over rounds of the same ratio within a round.\n")
    for workload in args.workload_list:
        for size in args.size_list:
            rows = [r for r in results if r["workload"] == workload and r.get("size") == (size and size[0])]
            params = next((r["n_params"] for r in rows if r["status"] == "ok"), None)
            n_layer, n_embd, n_head = size[1] if size else (args.n_layer, args.n_embd, args.n_head)
            print(f"## {workload}: {f'{params / 1e6:.1f}M parameters, ' if params else ''}"
                  f"{f'size {size[0]}, ' if size else ''}n_layer {n_layer}, n_embd {n_embd}, n_head {n_head}, "
                  f"vocab {args.vocab_size}\n")
            print(markdown_table(args, rows))
        if len(args.size_list) > 1:
            print(f"## {workload}: the largest size each system trains\n")
            print(largest_sizes(args, [r for r in results if r["workload"] == workload]))
    if args.accelerator == "gpu":
        print("TFLOP/s: (6 N + 12 L d T) FLOPs per token x tokens per step / step time, all ranks together; "
              "MFU: over the GPUs' dense bf16 peak.\n")
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "workload", "budget", "out")}
    write_json(args.json, {"config": config, "results": results})
    print(f"results: {args.json}")
    if args.accelerator == "gpu" and plot(args, results):
        print(f"plot: {args.png}")


def largest_sizes(args: argparse.Namespace, rows: list[dict]) -> str:
    """One workload's size grid as a table: per system and budget, the largest size that trained ("none"
    when not even the smallest did)."""
    budgets = [b or "all" for b in args.budget_list]
    lines = ["| system | " + " | ".join(budgets) + " |", "|" + "---|" * (len(budgets) + 1)]
    for system in args.system_list:
        cells = []
        for budget in args.budget_list:
            ran = [r["size"] for r in rows if (r["system"], r["budget"], r["status"]) == (system, budget, "ok")]
            cells.append(max(ran, key=[s[0] for s in args.size_list].index) if ran else "none")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(args: argparse.Namespace, results: list[dict]) -> bool:
    """Tokens/s against budget, one line per system and one panel per workload; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [(w, s and s[0]) for w in args.workload_list for s in args.size_list]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (workload, size) in zip(axes[0], panels):
        colors = plt.get_cmap("tab20").colors  # more systems than the default cycle's 10 colours
        for i, system in enumerate(args.system_list):
            ran = {r["budget"]: r["tokens_per_s"] for r in results if r.get("size") == size
                   and (r["workload"], r["system"], r["status"]) == (workload, system, "ok")}
            points = [(i, ran[b]) for i, b in enumerate(args.budget_list) if b in ran]
            if points:
                ax.plot(*zip(*points), marker="osD^v<>"[i % 7], color=colors[2 * i % 20 + i // 10 % 2], label=system)
        ax.set_xticks(range(len(args.budget_list)), [b or "all" for b in args.budget_list])
        ax.set(title=f"{workload} {size}" if size else workload, xlabel="device memory budget per rank",
               ylabel="tokens/s")
        ax.legend(fontsize=7)
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    return True
