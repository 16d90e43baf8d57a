"""The ``lightning-elixir`` console script: LightningCLI with the Elixir strategies registered.

Class paths in configs resolve from the working directory too (as with ``python -m``), so a
project's own modules, such as ``examples.gpt.GPTLightningModule``, can be named in a YAML.

``lightning-elixir convert <sharded_dir> <out.ckpt>`` turns a sharded checkpoint directory into
one full Lightning checkpoint file, in one process on the CPU, without the model.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from lightning.pytorch.cli import LightningCLI

import lightning_elixir  # noqa: F401  (registers the strategy names)
from lightning_elixir.runtime.sharded import ShardedCheckpointError, convert_sharded_to_full


def main(args: Optional[list[str]] = None) -> None:
    """Run LightningCLI: ``lightning-elixir fit --config configs/gpt_cpu.yaml``; or ``convert``."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["convert"]:
        convert(argv[1:])
        return
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    LightningCLI(subclass_mode_model=True, subclass_mode_data=True, args=args,
                 save_config_kwargs={"overwrite": True})


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


if __name__ == "__main__":
    main()
