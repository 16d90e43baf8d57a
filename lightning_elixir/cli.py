"""The ``lightning-elixir`` console script: LightningCLI with the Elixir strategies registered.

    lightning-elixir fit --config configs/gpt_cpu.yaml          # LightningCLI: fit, validate, test, predict
    lightning-elixir plan --config ... --hardware ... --devices N  # search a plan without the weights
    lightning-elixir hardware --out hardware.json                # measure this machine
    lightning-elixir convert <sharded_dir> <out.ckpt>            # a sharded checkpoint as one file

Class paths in configs resolve from the working directory too (as with ``python -m``), so a
project's own modules, such as ``lightning_elixir.demos.gpt.GPTLightningModule``, can be named in a YAML.

``convert`` turns a sharded checkpoint directory into one full Lightning checkpoint file, in one
process on the CPU, without the model. ``plan`` lives in plan_cli.py.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.cli import LightningCLI

import lightning_elixir  # noqa: F401  (registers the strategy names)
from lightning_elixir import plan_cli
from lightning_elixir.profile import HardwareProfile, profile_hardware
from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.sharded import ShardedCheckpointError, convert_sharded_to_full

HARDWARE_DESCRIPTION = """\
Measure this machine's hardware profile and write it as JSON, for `lightning-elixir plan
--hardware` and ElixirStrategy(hardware_profile=...): matmul speed, device memory and
host<->device bandwidth, all-gather and reduce-scatter bandwidth between the devices, optimizer
speed on the device and on the CPU, NVMe bandwidth. Takes seconds on a CPU, about a minute on GPUs.
"""
HARDWARE_EXAMPLES = """\
examples:
  # this machine's CPU, measured as 2 processes (like configs/gpt_cpu.yaml trains):
  lightning-elixir hardware --device cpu --devices 2 --out my-cpu-x2.json
  # a GPU node, all its GPUs (one process each, NCCL collectives between them):
  lightning-elixir hardware --device cuda --out my-node.json
  # then plan for it:
  lightning-elixir plan --config configs/gpt2_20b.yaml --hardware my-node.json --devices 8

The collectives are measured between the --devices processes: measure with as many devices per
node as you train on. Results are also cached in ~/.cache/lightning_elixir, where plan="auto"
finds them.
"""


def main(args: Optional[list[str]] = None) -> None:
    """LightningCLI (``lightning-elixir fit --config configs/gpt_cpu.yaml``), or ``plan``, ``hardware``, ``convert``."""
    argv = sys.argv[1:] if args is None else args
    commands = {"convert": convert, "plan": plan_cli.main, "hardware": hardware}
    if argv[:1] and argv[0] in commands:
        commands[argv[0]](argv[1:])
        return
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    LightningCLI(subclass_mode_model=True, subclass_mode_data=True, args=args,
                 save_config_kwargs={"overwrite": True},
                 parser_kwargs={"epilog": "Elixir also adds: lightning-elixir plan | hardware | convert (each with "
                                          "--help)."})


def convert(args: list[str]) -> None:
    """``convert <sharded_dir> <out.ckpt>``: a sharded checkpoint as one full checkpoint file."""
    parser = argparse.ArgumentParser(prog="lightning-elixir convert",
                                     description="Write a sharded checkpoint directory as one full checkpoint file.")
    parser.add_argument("sharded_dir", help="the directory a sharded save wrote (it must hold .metadata)")
    parser.add_argument("out", help="the full checkpoint file to write")
    parsed = parser.parse_args(args)
    try:
        convert_sharded_to_full(parsed.sharded_dir, parsed.out)
    except ShardedCheckpointError as err:
        parser.exit(1, f"lightning-elixir convert: error: {err}\n")


def _hardware_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-elixir hardware", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=HARDWARE_EXAMPLES,
        description=HARDWARE_DESCRIPTION)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the device kind to train on (default: cuda when this machine has a GPU, else cpu)")
    parser.add_argument("--devices", type=int, metavar="N",
                        help="processes to measure the collectives between, one per device (default: every GPU "
                             "of this machine; 1 on the CPU)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="the dtype the model computes in (bfloat16 for bf16-mixed); default: bfloat16 on "
                             "cuda, float32 on cpu")
    parser.add_argument("--nvme-path", metavar="DIR", help="a directory on the NVMe drive to measure (default: none)")
    parser.add_argument("--out", metavar="JSON", help="write the profile here (default: print it)")
    return parser


def hardware(args: list[str]) -> None:
    """``hardware [--device cpu|cuda] [--devices N] [--out file.json]``: measure and write this machine's profile."""
    parser = _hardware_parser()
    parsed = parser.parse_args(args)
    available = torch.cuda.device_count() if parsed.device == "cuda" else os.cpu_count() or 1
    if parsed.device == "cuda" and available == 0:
        parser.error("--device cuda: this machine has no GPU that torch can see; use --device cpu")
    devices = parsed.devices or (available if parsed.device == "cuda" else 1)
    if not 1 <= devices <= available:
        parser.error(f"--devices {devices}: use 1 to {available} (the {parsed.device} devices/cores of this machine)")
    if parsed.nvme_path is not None and not os.path.isdir(parsed.nvme_path):
        parser.error(f"--nvme-path {parsed.nvme_path}: not a directory")
    dtype = parsed.dtype or ("bfloat16" if parsed.device == "cuda" else "float32")
    profile = measure(parsed.device, devices, dtype, parsed.nvme_path)
    text = profile.to_json(parsed.out)
    print(f"wrote {parsed.out}" if parsed.out else text)


def measure(device_type: str, devices: int, dtype: str, nvme_path: Optional[str]) -> HardwareProfile:
    """The profile measured by ``devices`` processes (rank 0's, which every rank agrees on)."""
    if devices == 1:
        return profile_hardware(device_type, compute_dtype=getattr(torch, dtype), nvme_path=nvme_path, refresh=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "hardware.json")
        mp.spawn(_measure_rank, args=(devices, _free_port(), device_type, dtype, nvme_path, out), nprocs=devices)
        return HardwareProfile.from_json(out)


def _measure_rank(rank: int, world_size: int, port: int, device_type: str, dtype: str, nvme_path: Optional[str],
                  out: str) -> None:
    """One process of ``measure``: join the group, measure collectively, rank 0 writes."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    else:  # the threads a rank gets when Lightning runs this many processes on the CPU
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        group = Group.default()
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        profile = profile_hardware(
            device, world_size=world_size, compute_dtype=getattr(torch, dtype), nvme_path=nvme_path, refresh=True,
            all_gather=lambda o, i: collectives.all_gather(o, i, group),
            reduce_scatter=lambda o, i: collectives.reduce_scatter(o, i, group))
        if rank == 0:
            profile.to_json(out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    """A TCP port free on this machine now, for the measuring processes to meet on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
