"""Small models that exercise the profiler: plain, tied, used outside their owner, checkpointed."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_elixir.demos.gpt import BigramTokens, GPTLightningModule


class MLP(nn.Module):
    """Three linear layers with GELU."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, 4 * width)
        self.fc3 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


class TiedLM(nn.Module):
    """Tied embedding/head (same Parameter under two modules) plus a use outside its owner.

    ``head.weight is emb.weight`` (module-level tie), and ``forward`` of the root also reads
    ``emb.weight`` directly through ``F.linear`` (a use outside the owner, seen only at op level).
    """

    def __init__(self, vocab: int = 96, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.body = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(idx)))
        return self.head(self.norm(h)) + F.linear(h, self.emb.weight)


class CheckpointedStack(nn.Module):
    """Blocks run under torch.utils.checkpoint (non-reentrant), with a plain head."""

    def __init__(self, width: int = 48, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def mse_step(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Regression loss of ``module(x)`` against ``y``."""
    x, y = batch
    return F.mse_loss(module(x), y)


def lm_step(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of a module that maps tokens to logits."""
    x, y = batch
    logits = module(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def gpt_case(activation_checkpointing: bool = False, batch_size: int = 4):
    """The example GPT LightningModule (tied wte/lm_head) and one batch of bigram tokens."""
    torch.manual_seed(0)
    module = GPTLightningModule(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256,
                                activation_checkpointing=activation_checkpointing)
    data = BigramTokens(256, 32, batch_size)
    x, y = zip(*(data[i] for i in range(batch_size)))
    return module, (torch.stack(x), torch.stack(y))


def mlp_case(batch_size: int = 16):
    """An MLP and one regression batch."""
    torch.manual_seed(0)
    return MLP(), (torch.randn(batch_size, 64), torch.randn(batch_size, 64))


def tied_case(batch_size: int = 8):
    """TiedLM and one token batch."""
    torch.manual_seed(0)
    return TiedLM(), (torch.randint(96, (batch_size, 16)), torch.randint(96, (batch_size, 16)))


def checkpoint_case(batch_size: int = 16):
    """CheckpointedStack and one regression batch."""
    torch.manual_seed(0)
    return CheckpointedStack(), (torch.randn(batch_size, 48), torch.randn(batch_size, 1))


class CTCRecognizer(nn.Module):
    """A small recognizer: a Linear encoder over frames and a per-frame classifier, trained with CTC."""

    def __init__(self, features: int = 32, hidden: int = 128, classes: int = 24) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(frames))


def ctc_step(module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """CTC loss with the lengths as tensors (``aten._ctc_loss.Tensor``, whose output shape depends on
    the lengths' values: FakeTensorMode cannot run it, the profile bounds it)."""
    frames, targets, frame_lengths, target_lengths = batch
    log_probs = module(frames).float().log_softmax(-1).transpose(0, 1)
    return F.ctc_loss(log_probs, targets, frame_lengths, target_lengths)


def ctc_case(batch_size: int = 8, frames: int = 64, target: int = 24):
    """CTCRecognizer and one batch whose targets are all of the padded width (the profile's bound)."""
    torch.manual_seed(0)
    batch = (torch.randn(batch_size, frames, 32), torch.randint(1, 24, (batch_size, target)),
             torch.full((batch_size,), frames), torch.full((batch_size,), target))
    return CTCRecognizer(), batch
