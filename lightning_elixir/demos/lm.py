"""What the example language models share: the LightningModule's training logic and the data module's loaders.

``CausalLM`` trains any ``nn.Module`` that maps token ids to next-token logits (lightning_elixir/demos/gpt.py,
lightning_elixir/demos/llama.py): next-token cross-entropy computed in fp32, AdamW with weight decay on matrices
only. A subclass says how to build its model (``build_model``); with ``meta_init=True`` the model is
built in ``configure_model``, on the meta device under a sharding strategy, and takes its modules'
own ``reset_parameters`` initialisation. ``TokenDataModule`` serves a subclass's train and validation
sets, unshuffled (every rank generates the same data from the seed).
"""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class CausalLM(L.LightningModule):
    """Next-token cross-entropy and AdamW (decay on matrices only) over ``build_model()``'s module.

    A subclass's ``__init__`` calls ``super().__init__()`` and ``save_hyperparameters()`` (its
    arguments include ``learning_rate``, ``weight_decay`` and ``meta_init``), sets ``self.config``,
    then calls ``self._init_model()``.
    """

    model: Optional[nn.Module]

    def build_model(self) -> nn.Module:
        """The model, built from ``self.config``."""
        raise NotImplementedError

    def _init_model(self) -> None:
        self.model = None if self.hparams.meta_init else self.build_model()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build_model()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.learning_rate, betas=(0.9, 0.95))


class TokenDataModule(L.LightningDataModule):
    """Train and validation loaders over the datasets a subclass's ``setup`` assigns to
    ``train_set`` and ``val_set``, in order (every rank generates the same data)."""

    train_set: Dataset
    val_set: Dataset

    def __init__(self, vocab_size: int = 512, block_size: int = 64, batch_size: int = 8,
                 num_samples: int = 2048, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False)
