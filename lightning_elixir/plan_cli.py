"""``lightning-elixir plan``: the plan a LightningCLI config would get, searched without its weights.

    lightning-elixir plan --config configs/gpt2_20b.yaml --hardware configs/hardware/a100-80gb-x8.json \\
        --devices 8 --device-memory-limit 40GiB --out plan.json
    lightning-elixir fit --config configs/gpt2_20b.yaml --trainer.strategy.init_args.plan plan.json

[Note: planning from a config]
The config is read by LightningCLI's own parser, as ``lightning-elixir fit`` reads it (several
``--config`` files and ``--model.init_args.n_layer 8`` style overrides work the same), but no
Trainer is built: the model is instantiated under ``torch.device("meta")`` (and its
``configure_model`` runs there, as under the strategy), so a 20B model costs a few hundred bytes
per parameter tensor. One batch is taken from the data module's ``train_dataloader`` with its
``setup`` running on fake tensors ([Note: assumed values] in profile/assumed.py answers the host
reads a loader makes, such as its seed): the profile only needs shapes and dtypes, and the data
of a big config (a vocabulary-squared bigram table) is never generated. A data module that cannot
run on fake tensors is set up for real, with a warning. The step is profiled on the CPU on fake
tensors and searched for the hardware profile given, whatever machine this is: nothing here
touches an accelerator, so a GPU cluster's plan can be made on a laptop.

What the planning run would take from the machine it runs on is an argument here instead: the
device memory comes from the hardware profile (or ``--device-memory-limit``), and the host memory
offloaded state may fill from ``--host-memory-limit`` (the profile does not record it).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_elixir.autoplan import updates_start_in_backward
from lightning_elixir.plan import PlanError
from lightning_elixir.planner import PlanningResult, search_options, search_with_recomputation, with_private_params
from lightning_elixir.recompute import recomputing
from lightning_elixir.profile import HardwareProfile, ProfileError, profile_model
from lightning_elixir.profile.assumed import AssumedValues, host_conversions
from lightning_elixir.runtime.policy import PrecisionPolicy
from lightning_elixir.search import NoPlanFitsError, parse_memory_limit
from lightning_elixir.search.budget import check_memory_limit
from lightning_elixir.search.report import format_bytes, format_ms

log = logging.getLogger(__name__)

PROG = "lightning-elixir plan"
_FIT_ONLY = {"model", "train_dataloaders", "val_dataloaders", "datamodule"}
_STRATEGY_KEYS = ("device_memory_limit", "host_memory_limit", "private_params", "nvme_path", "updates_in_backward")
"""ElixirStrategy options in the config that planning honours (command-line options win)."""

DESCRIPTION = """\
Search the Elixir plan (chunk size, cache blocks, prefetch depth, CPU/NVMe offload) for the
model and data of a LightningCLI config on a given machine, and print its predicted step time,
its peak memory per device and the physical lower bound. The model is built on the meta device
and profiled on fake tensors: no weights are allocated and no GPU is used, so a cluster's plan
can be made on a laptop. With --out the plan is written as JSON for ElixirStrategy(plan=...).
"""
EXAMPLES = """\
examples:
  # a GPT-2 20B on one 8-GPU A100 node, each GPU limited to 40 GiB:
  lightning-elixir plan --config configs/gpt2_20b.yaml --hardware configs/hardware/a100-80gb-x8.json \\
      --devices 8 --device-memory-limit 40GiB --out plan.json
  # then train with that plan instead of planning again:
  lightning-elixir fit --config configs/gpt2_20b.yaml --trainer.strategy.init_args.plan plan.json
  # the CPU example, planned on a profile of this machine (see `lightning-elixir hardware --help`):
  lightning-elixir plan --config configs/gpt_cpu.yaml --hardware configs/hardware/local-cpu-x2.json --devices 2

Any other option is passed to the config parser, as for `lightning-elixir fit`, e.g.
--model.init_args.n_layer 12 or --data.init_args.batch_size 4.
"""


def build_parser() -> argparse.ArgumentParser:
    """The options of ``lightning-elixir plan`` (the rest go to LightningCLI's parser)."""
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description=DESCRIPTION)
    parser.add_argument("-c", "--config", required=True, action="append", metavar="YAML",
                        help="a LightningCLI config, as for `lightning-elixir fit --config` (repeatable)")
    parser.add_argument("--hardware", required=True, metavar="JSON",
                        help="the hardware profile of the machine to train on, as written by `lightning-elixir "
                             "hardware --out` (estimates for common GPU nodes are in configs/hardware/)")
    parser.add_argument("--devices", type=_positive_int, metavar="N",
                        help="ranks (GPUs) the plan shards over, on all nodes together "
                             "(default: the config's trainer.devices x trainer.num_nodes)")
    parser.add_argument("--device-memory-limit", metavar="SIZE",
                        help='memory each device may use, e.g. "40GiB", "40GB", "80%%" or "0.5" (default: the '
                             "config's device_memory_limit, else all of the profile's device memory)")
    parser.add_argument("--host-memory-limit", metavar="SIZE",
                        help='host memory per machine that offloaded state may fill, e.g. "512GiB" (default: '
                             "the config's host_memory_limit, else no limit)")
    parser.add_argument("--nvme", action="store_true",
                        help="allow NVMe placement (the profile must have NVMe bandwidths, and training needs "
                             "nvme_path); default: allowed when the config sets nvme_path")
    parser.add_argument("--out", metavar="JSON",
                        help="write the plan here, for ElixirStrategy(plan=...) (default: print only)")
    return parser


def _positive_int(text: str) -> int:
    """``--devices``: a whole number of ranks, at least one."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number of devices (ranks), got {text!r}")
    return value


@dataclass(frozen=True)
class ConfigInputs:
    """What planning takes from a config: the meta model, one batch and the trainer's settings."""

    module: LightningModule
    """The model, with its parameters on the meta device."""
    batch: Any
    """One training batch (fake tensors unless the data module needed real ones)."""
    precision: str
    """The trainer's precision flag, e.g. "bf16-mixed"."""
    micro_batches: int
    """``trainer.accumulate_grad_batches``."""
    gradient_clip_val: Any
    """``trainer.gradient_clip_val`` (clipping holds offloaded updates until the step)."""
    devices: Optional[int]
    """``trainer.devices x trainer.num_nodes`` when the config gives a number, else None."""
    strategy: Mapping[str, Any]
    """The ElixirStrategy options in ``_STRATEGY_KEYS`` that the config sets."""
    strategy_is_class: bool
    """Whether the config names the strategy by class_path/init_args (else by a registered name)."""
    num_nodes: int = 1
    """``trainer.num_nodes``: the ranks are spread over this many machines, which share no host memory."""


class _ConfigReader(LightningCLI):
    """LightningCLI that parses a fit config and builds its model and data module, but no Trainer."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        # the keys `fit` accepts at the top level of a config (ckpt_path, ...), so that its configs parse
        parser.add_method_arguments(Trainer, "fit", skip=set(_FIT_ONLY))

    def instantiate_classes(self) -> None:
        config = self.config.clone()
        del config["trainer"]  # its strategy, callbacks and loggers would be built (and checked) for nothing
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        with torch.device("meta"):
            init = instantiate(config)
            init.model.configure_model()
        self.model, self.datamodule = init.model, init.get("data")


def read_config(configs: Sequence[str], overrides: Sequence[str]) -> ConfigInputs:
    """Parse the config files (and overrides) as ``fit`` would; see [Note: planning from a config]."""
    # planning draws no random numbers: the config's seed_everything is not applied
    args = [arg for path in configs for arg in ("--config", path)] + list(overrides) + ["--seed_everything=false"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")  # we pass args on purpose
        reader = _ConfigReader(subclass_mode_model=True, subclass_mode_data=True, run=False, args=args,
                               save_config_callback=None)
    trainer = reader.config.trainer
    return ConfigInputs(
        module=reader.model, batch=example_batch(reader.model, reader.datamodule),
        precision=str(_convert_precision_to_unified_args(trainer.precision or "32-true")),
        micro_batches=int(trainer.accumulate_grad_batches), gradient_clip_val=trainer.gradient_clip_val,
        devices=_config_devices(trainer),
        strategy=_strategy_options(trainer.strategy), strategy_is_class=hasattr(trainer.strategy, "class_path"),
        num_nodes=max(1, int(trainer.num_nodes or 1)))


def _config_devices(trainer: Any) -> Optional[int]:
    """The config's world size when it is a plain number of devices."""
    devices = trainer.devices
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        return None
    return devices * int(trainer.num_nodes or 1)


def _strategy_options(strategy: Any) -> dict[str, Any]:
    """The planning options an ElixirStrategy in class_path/init_args form sets."""
    init_args = getattr(strategy, "init_args", None)  # None for a name such as "elixir"
    if init_args is None:
        return {}
    return {key: init_args[key] for key in _STRATEGY_KEYS if init_args.get(key) is not None}


def example_batch(module: LightningModule, datamodule: Optional[LightningDataModule]) -> Any:
    """The first training batch, on fake tensors when the data allows ([Note: planning from a config])."""
    source = datamodule if datamodule is not None else module
    if datamodule is None and not is_overridden("train_dataloader", module):
        raise ValueError("the config has no data module (data:) and the model defines no train_dataloader(); "
                         "planning profiles one training batch")
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            values = AssumedValues(mode)
            with values, host_conversions(values):
                return _first_batch(source)
    except StopIteration:
        raise ValueError(f"{type(source).__name__}.train_dataloader() yielded no batch") from None
    except Exception as err:  # noqa: BLE001 (any failure on fake tensors: real data will tell)
        log.warning("could not set up %s on fake tensors (%s: %s); loading one real batch instead",
                    type(source).__name__, type(err).__name__, err)
    return _first_batch(source)


def _first_batch(source: Any) -> Any:
    """``prepare_data``, ``setup("fit")`` and the first batch of ``train_dataloader()``."""
    if isinstance(source, LightningDataModule):
        source.prepare_data()
        source.setup("fit")
    loader = source.train_dataloader()
    return next(iter(loader))


def plan_config(inputs: ConfigInputs, hardware: HardwareProfile, devices: int, device_memory_limit: Any = None,
                host_memory_limit: Any = None, nvme: bool = False) -> PlanningResult:
    """Profile ``inputs`` on fake tensors and search a plan for ``devices`` ranks of ``hardware``.

    Raises:
        ValueError: A memory limit is not understood, or the precision is not one Elixir runs.
        NoPlanFitsError: Nothing fits the budget (the message says what would help).
    """
    policy = PrecisionPolicy.from_flag(inputs.precision)
    local = _ranks_per_machine(hardware, devices, inputs.num_nodes)
    budget = _budget_bytes(hardware, device_memory_limit, local)
    host_bytes = _host_bytes(host_memory_limit, local)

    def traced(names: tuple[str, ...] = (), conditional: Optional[tuple[str, ...]] = None) -> Any:
        with recomputing(inputs.module, names):
            profile = profile_model(inputs.module, inputs.batch, compute_dtype=policy.autocast_dtype or policy.compute_dtype,
                                    hardware=hardware, device="cpu", param_dtype=policy.compute_dtype,
                                    conditional_params=conditional)
        return with_private_params(profile, inputs.strategy.get("private_params", ()))

    early = updates_start_in_backward(inputs.module, inputs.strategy.get("updates_in_backward"),
                                      hardware.device_name != "cpu", inputs.precision == "16-mixed",
                                      inputs.gradient_clip_val)  # the config's callbacks are not built
    options = search_options(devices, inputs.micro_batches, policy.compute_dtype, policy.autocast_dtype,
                             nvme_available=nvme, host_memory_bytes=host_bytes, updates_in_backward=early)
    base = traced()  # a variant runs the same module calls: the same value-dependent ones
    best, variants, notes = search_with_recomputation(
        inputs.module, base, lambda names: traced(names, base.conditional_params), hardware, budget, options)
    return PlanningResult(best.plan, best.report, best.variant.profile, hardware, budget, options=options,
                          notes=notes + _notes(hardware, devices, host_bytes, early), variants=variants)


def _ranks_per_machine(hardware: HardwareProfile, devices: int, num_nodes: int = 1) -> int:
    """Ranks that share one machine's host memory, as ``fit`` counts them (its ``local_world_size``, the
    Trainer's ``devices``): the ranks of one of ``num_nodes`` machines, at most one per device of a GPU node."""
    per_machine = -(-devices // max(1, num_nodes))
    return per_machine if hardware.device_name == "cpu" else max(1, min(per_machine, hardware.device_count))


def _budget_bytes(hardware: HardwareProfile, limit: Any, local_world_size: int) -> int:
    """Device memory per rank: the profile's device (a CPU's memory is shared by its ranks), or the limit of it."""
    total = hardware.device_memory_bytes
    if hardware.device_name == "cpu":
        total //= local_world_size
    return total if limit is None else parse_memory_limit(limit, total)


def _host_bytes(limit: Any, local_world_size: int) -> Optional[int]:
    """Host memory per rank for offloaded state; the limit must be a size (the profile has no host total)."""
    if limit is None:
        return None
    nbytes = parse_memory_limit(limit, 1 << 50, "host_memory_limit")
    if nbytes != parse_memory_limit(limit, 1 << 51, "host_memory_limit"):
        raise ValueError(f"host_memory_limit {limit!r} is a fraction, but the hardware profile does not record the "
                         "host's memory; give a size such as '512GiB'")
    return nbytes // local_world_size


def _notes(hardware: HardwareProfile, devices: int, host_bytes: Optional[int], early: bool = False) -> tuple[str, ...]:
    """Caveats about the inputs, for the printed result."""
    notes = [f"hardware: {note}" for note in hardware.notes]
    if early:
        notes.append("offloaded updates priced to start in backward (a callback of the config that overrides "
                     "on_after_backward or on_before_optimizer_step would hold them until the step)")
    if hardware.world_size != devices:
        notes.append(f"the hardware profile's collectives were measured on {hardware.world_size} rank(s), the plan "
                     f"is for {devices}: all-gather and reduce-scatter times may be off")
    if host_bytes is None:
        notes.append("host memory for offloaded state is not limited; pass --host-memory-limit (per machine)")
    return tuple(notes)


def describe(result: PlanningResult, inputs: ConfigInputs, hardware: HardwareProfile, devices: int) -> str:
    """The printed result: what was planned, the plan, the search report and the caveats."""
    plan, report = result.plan, result.report
    placed = {p: sum(c.placement == p for c in plan.chunks) for p in ("device", "cpu", "nvme")}
    shapes = [tuple(t.shape) for t in _tensors(inputs.batch)]
    lines = [
        f"model: {type(inputs.module).__name__}, {result.model_profile.total_numel:,} parameters, precision "
        f"{inputs.precision}, batch {shapes}, {inputs.micro_batches} micro-batch(es) per step",
        f"hardware: {hardware.device_name} x{hardware.device_count} per machine (profiled with "
        f"{hardware.world_size} rank(s)), planning for {devices} rank(s), budget {format_bytes(report.budget_bytes)} "
        "per rank",
        f"plan: chunk_numel={plan.chunk_numel:,}, cache_blocks={plan.cache_blocks}, "
        f"prefetch_depth={plan.prefetch_depth}, {len(plan.chunks)} chunks ({placed['device']} device, "
        f"{placed['cpu']} cpu, {placed['nvme']} nvme)",
        f"predicted step time {format_ms(report.winner.step_s)}, lower bound {format_ms(report.lower_bound_s)} "
        f"({report.lower_bound_reason}): {report.lower_bound_ratio:.2f}x the lower bound; predicted peak "
        f"{format_bytes(report.memory.peak_bytes)} per device",
        "",
        report.summary(),
    ]
    if result.notes:
        lines += ["", "notes:", *(f"  - {note}" for note in result.notes)]
    return "\n".join(lines)


def fit_command(configs: Sequence[str], plan_path: str, strategy_is_class: bool) -> str:
    """The ``lightning-elixir fit`` command line that trains with the written plan."""
    strategy = "" if strategy_is_class else "--trainer.strategy lightning_elixir.ElixirStrategy "
    config = " ".join(f"--config {path}" for path in configs)
    return f"lightning-elixir fit {config} {strategy}--trainer.strategy.init_args.plan {plan_path}"


def _tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) batch, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in _tensors(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in _tensors(value)]
    return []


def main(argv: Sequence[str]) -> None:
    """``lightning-elixir plan ...``: parse, plan, print, and write the plan when ``--out`` is given."""
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    _check_paths(parser, args)
    _check_limits(parser, args)
    hardware = _load_hardware(parser, args.hardware)
    if os.getcwd() not in sys.path:  # class paths such as lightning_elixir.demos.gpt.GPTLightningModule, as for `fit`
        sys.path.insert(0, os.getcwd())
    inputs = read_config(args.config, overrides)
    devices = args.devices or inputs.devices
    if devices is None:
        parser.error("the config's trainer.devices is not a number of devices; pass --devices N")
    strategy = inputs.strategy
    try:
        result = plan_config(inputs, hardware, devices,
                             args.device_memory_limit or strategy.get("device_memory_limit"),
                             args.host_memory_limit or strategy.get("host_memory_limit"),
                             nvme=args.nvme or "nvme_path" in strategy)
    except (NoPlanFitsError, PlanError, ProfileError, ValueError) as err:
        parser.exit(1, f"{PROG}: error: {err}\n")
    print(describe(result, inputs, hardware, devices))
    if args.out:  # named for its file: it runs as a fixed plan, not as plan="auto" (no re-planning)
        dataclasses.replace(result.plan, name=os.path.basename(args.out)).to_json(args.out)
        print(f"\nwrote {args.out}; train with it:\n  {fit_command(args.config, args.out, inputs.strategy_is_class)}")


def _check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail before any work on inputs that are not there."""
    for path in args.config:
        if not os.path.isfile(path):
            parser.error(f"--config {path}: no such file")
    if not os.path.isfile(args.hardware):
        parser.error(f"--hardware {args.hardware}: no such file; write one with `lightning-elixir hardware --out "
                     f"{args.hardware}` on the machine to train on, or use one of configs/hardware/")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"--out {args.out}: its directory does not exist")


def _check_limits(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail before any work on memory limits that cannot be read."""
    try:
        if args.device_memory_limit is not None:
            check_memory_limit(args.device_memory_limit, "--device-memory-limit")
        _host_bytes(args.host_memory_limit, 1)
    except ValueError as err:
        parser.error(str(err))


def _load_hardware(parser: argparse.ArgumentParser, path: str) -> HardwareProfile:
    """The hardware profile at ``path``, or a usage error that says what is wrong with it."""
    try:
        return HardwareProfile.from_json(path)
    except (ProfileError, TypeError, ValueError) as err:
        parser.error(f"--hardware {path} is not a hardware profile: {err}")
