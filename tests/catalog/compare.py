"""Comparisons of one strategy's results with DDP's, and the sanity checks of DDP's own results.

A result (per rank) is what harness._run_case returns: errors, steps [(trainer index, global_step,
batch_idx, loss)], step_metrics (trainer.callback_metrics after every training batch), lrs,
metrics (callback_metrics after the run), weights (rank 0: the state_dict of a checkpoint written
by the Trainer after the run), init (rank 0: module.state_dict() before the run), buffers
(module.named_buffers() after the run, per rank) and extras (per case, per rank).

Every check reports what differs instead of stopping at the first difference, so one test failure
shows the whole picture: the exception, then the first few mismatches of each kind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from tests.catalog.harness import WORLD_SIZE
from tests.catalog.models import Case, Tol

RANKS = tuple(range(WORLD_SIZE))
SHOW = 6
"""Mismatches listed per kind (the rest are counted)."""


def close(a: Any, b: Any, rel: float) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-7)


def finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of floating tensors holding NaN or inf."""
    return [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


class Problems:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.counts: dict[str, int] = {}

    def add(self, kind: str, message: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.counts[kind] <= SHOW:
            self.lines.append(message)

    def result(self) -> list[str]:
        more = [f"... and {n - SHOW} more {kind} mismatches" for kind, n in self.counts.items() if n > SHOW]
        return self.lines + more


def _tensor_diff(path: str, want: torch.Tensor, got: torch.Tensor, tol: Tol) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{path}: got {type(got).__name__}, DDP a tensor"
    if want.shape != got.shape or want.dtype != got.dtype:
        return f"{path}: got {got.dtype}{list(got.shape)}, DDP {want.dtype}{list(want.shape)}"
    if got.is_complex():  # compared as its real and imaginary parts
        got, want = torch.view_as_real(got), torch.view_as_real(want)
    if got.is_floating_point():
        if not bool(torch.isfinite(got).all()):
            return f"{path}: not finite ({int((~torch.isfinite(got)).sum())} of {got.numel()} elements)"
        if not torch.allclose(got.double(), want.double(), rtol=tol.weight_rtol, atol=tol.weight_atol):
            diff = (got.double() - want.double()).abs()
            return (f"{path}: max |diff| {diff.max().item():.3g} (DDP max |value| {want.abs().max().item():.3g}, "
                    f"{int((diff > tol.weight_atol + tol.weight_rtol * want.double().abs()).sum())} of "
                    f"{want.numel()} elements off)")
        return None
    return None if torch.equal(want, got) else f"{path}: integer tensors differ: {got.tolist()} vs DDP {want.tolist()}"


def diff_values(path: str, want: Any, got: Any, tol: Tol, problems: Problems, kind: str) -> None:
    """Recursive comparison of extras/metrics: tensors by the weight tolerance, numbers by the loss tolerance."""
    if isinstance(want, torch.Tensor):
        message = _tensor_diff(path, want, got, tol)
        if message:
            problems.add(kind, message)
    elif isinstance(want, Mapping):
        if not isinstance(got, Mapping):
            problems.add(kind, f"{path}: got {type(got).__name__}, DDP a dict")
            return
        if set(want) != set(got):
            problems.add(kind, f"{path}: keys differ: missing {sorted(set(want) - set(got))[:8]}, "
                               f"extra {sorted(set(got) - set(want))[:8]}")
        for k in want:
            if k in got:
                diff_values(f"{path}[{k!r}]", want[k], got[k], tol, problems, kind)
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            problems.add(kind, f"{path}: got {got!r:.120}, DDP {want!r:.120}")
            return
        for i, (a, b) in enumerate(zip(want, got)):
            diff_values(f"{path}[{i}]", a, b, tol, problems, kind)
    elif isinstance(want, float) or isinstance(got, float):
        if not isinstance(got, (int, float)) or not close(want, got, tol.loss):
            problems.add(kind, f"{path}: {got!r} vs DDP {want!r}")
    elif want != got:
        problems.add(kind, f"{path}: {got!r} vs DDP {want!r}")


def _weights(ref: dict, got: dict, tol: Tol, problems: Problems) -> None:
    want, have = ref["weights"], got["weights"]
    if have is None:
        problems.add("weights", "rank 0: no final weights (the run or trainer.save_checkpoint failed)")
        return
    if set(want) != set(have):
        problems.add("weights", f"checkpoint keys differ: missing {sorted(set(want) - set(have))[:8]}, "
                                f"extra {sorted(set(have) - set(want))[:8]}")
    init = ref["init"] or {}
    for name, w in want.items():
        if name not in have:
            continue
        h = have[name]
        if tol.update is not None and name in init and w.is_floating_point() and isinstance(h, torch.Tensor) \
                and h.shape == w.shape and h.dtype == w.dtype:
            if not bool(torch.isfinite(h).all()):
                problems.add("weights", f"weight {name}: not finite")
                continue
            dw, dh = (w - init[name]).double(), (h - init[name]).double()
            err, scale = (dh - dw).norm().item(), dw.norm().item()
            if err > tol.update * scale + tol.weight_atol:
                problems.add("weights", f"weight {name}: update differs by {err:.3g} (norm), "
                                        f"DDP's update norm {scale:.3g}")
            continue
        message = _tensor_diff(f"weight {name}", w, h, tol)
        if message:
            problems.add("weights", message)


def exception_line(error: str) -> str:
    """"rank R <phase>: <Exception> [at <innermost frame outside lightning_elixir and torch>]: <message>"."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    if len(lines) < 2:
        return lines[0] if lines else ""
    head = lines[0].split(": Traceback")[0]
    kind, _, message = lines[-1].strip().partition(": ")
    frames = [line.strip() for line in lines if line.startswith('  File "')
              and not any(part in line for part in ("/lightning_elixir/", "/tests/catalog/", "/torch/"))]
    where = ""
    if frames:  # 'File ".../pkg/mod.py", line 12, in fn' -> 'mod.py:12 fn'
        path, _, rest = frames[-1][len('File "'):].partition('", line ')
        number, _, function = rest.partition(", in ")
        where = f" [at {path.rsplit('/', 1)[-1]}:{number} {function}]"
    return f"{head}: {kind.rsplit('.', 1)[-1]}{where}: {message}"


def report_errors(results: list[dict]) -> list[str]:
    """One headline per distinct exception, then each distinct traceback once."""
    errors = [e for r in RANKS for e in results[r]["errors"]]
    if not errors:
        return []
    seen: dict[str, str] = {}
    for error in errors:
        last = error.strip().splitlines()[-1]
        seen.setdefault(last, error)
    by_text: dict[str, list[str]] = {}
    for error in errors:  # "rank R phase: ..." -> ranks grouped by identical text
        rank, _, text = exception_line(error).removeprefix("rank ").partition(" ")
        by_text.setdefault(text, []).append(rank)
    lines = ["raised: " + "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(r)} {t}" for t, r in by_text.items())]
    return lines + [e.rstrip() for e in seen.values()] + ["---"]


def compare(case: Case, ref: list[dict], got: list[dict]) -> list[str]:
    """Everything in which ``got`` differs from DDP's ``ref``; empty when they match."""
    tol = case.tol
    problems = Problems()
    problems.lines += report_errors(got)
    for r in RANKS:
        want, have = ref[r]["steps"], got[r]["steps"]
        if len(want) != len(have):
            problems.add("steps", f"rank {r}: {len(have)} training batches recorded, DDP {len(want)}")
        for (ia, sa, ba, la), (ib, sb, bb, lb) in zip(want, have):
            if (ia, sa, ba) != (ib, sb, bb):
                problems.add("steps", f"rank {r}: batch (trainer, global_step, batch_idx) = {(ib, sb, bb)}, "
                                      f"DDP {(ia, sa, ba)}")
            elif not close(la, lb, tol.loss):
                problems.add("losses", f"rank {r} trainer {ia} step {sa} batch {ba}: loss {lb!r} vs DDP {la!r}")
        for i, (a, b) in enumerate(zip(ref[r]["step_metrics"], got[r]["step_metrics"])):
            diff_values(f"rank {r} logged after batch {i}", a, b, tol, problems, "logged")
        for i, (a, b) in enumerate(zip(ref[r]["lrs"], got[r]["lrs"])):
            diff_values(f"rank {r} lrs after batch {i}", a, b, tol, problems, "lr")
        diff_values(f"rank {r} trainer.callback_metrics", ref[r]["metrics"], got[r]["metrics"], tol, problems,
                    "metrics")
        diff_values(f"rank {r} buffers", ref[r]["buffers"], got[r]["buffers"], tol, problems, "buffers")
        diff_values(f"rank {r} extras", ref[r]["extras"], got[r]["extras"], tol, problems, "extras")
    _weights(ref[0], got[0], tol, problems)
    return problems.result()


def check_ddp(case: Case, ref: list[dict]) -> list[str]:
    """DDP's own results are sound: no error, finite values, weights trained (or untouched) as the case says."""
    problems = report_errors(ref)
    if problems:
        return problems
    for r in RANKS:
        losses = [loss for *_, loss in ref[r]["steps"]]
        if case.trains and not losses:
            problems.append(f"rank {r}: no training batch recorded")
        if any(loss is None or not math.isfinite(loss) for loss in losses):
            problems.append(f"rank {r}: losses not all finite: {losses}")
        bad = [k for k, v in ref[r]["metrics"].items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            problems.append(f"rank {r}: metrics not finite: {bad}")
    if len(ref[0]["steps"]) != len(ref[1]["steps"]):
        problems.append("the ranks ran different numbers of batches")
    weights, init = ref[0]["weights"], ref[0]["init"]
    if not weights:
        return problems + ["rank 0: no final weights"]
    if finite(weights):
        problems.append(f"weights not finite: {finite(weights)}")
    common = [k for k in init if k in weights and init[k].is_floating_point()]
    changed = [k for k in common if not torch.equal(init[k], weights[k])]
    if case.trains and init and not changed:
        problems.append("training changed no weight")
    if not case.trains and changed:
        problems.append(f"weights changed although the case does not train: {changed}")
    if not problems and case.ddp_check is not None:
        try:
            case.ddp_check(ref)
        except AssertionError as err:
            problems.append(f"case check: {err}")
    return problems
