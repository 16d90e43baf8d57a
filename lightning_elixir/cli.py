"""The ``lightning-elixir`` console script: LightningCLI with the Elixir strategies registered.

Class paths in configs resolve from the working directory too (as with ``python -m``), so a
project's own modules, such as ``examples.gpt.GPTLightningModule``, can be named in a YAML.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from lightning.pytorch.cli import LightningCLI

import lightning_elixir  # noqa: F401  (registers the strategy names)


def main(args: Optional[list[str]] = None) -> None:
    """Run LightningCLI: ``lightning-elixir fit --config configs/gpt_cpu.yaml``."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    LightningCLI(subclass_mode_model=True, subclass_mode_data=True, args=args,
                 save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
