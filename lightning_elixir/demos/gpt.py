"""A small GPT (nanoGPT-shaped) LightningModule and a synthetic token data module.

The model ties its input embedding to its output head, as GPT-2 does, so it exercises Elixir's
private chunks. Data is generated on the fly from a fixed random bigram table: no download, and
the loss has real structure to learn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

from lightning_elixir.demos.lm import CausalLM, TokenDataModule


@dataclass
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # 0 keeps runs comparable across strategies
    bias: bool = True
    activation_checkpointing: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            if self.config.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTLightningModule(CausalLM):
    """GPT language model: next-token cross-entropy, AdamW with decay on matrices only (lightning_elixir/demos/lm.py)."""

    def __init__(
        self,
        vocab_size: int = 512,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        activation_checkpointing: bool = False,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        meta_init: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd,
                                activation_checkpointing=activation_checkpointing)
        self._init_model()

    def build_model(self) -> GPT:
        return GPT(self.config)


class BigramTokens(Dataset):
    """Token sequences sampled from a fixed random bigram table (seeded, so every rank agrees)."""

    def __init__(self, vocab_size: int, block_size: int, num_samples: int, seed: int = 0,
                 sample_seed: int | None = None) -> None:
        """``seed`` draws the table (and the samples, unless ``sample_seed`` is given: a held-out set
        of the same distribution)."""
        g = torch.Generator().manual_seed(seed)
        # Each token has a few likely successors: learnable, far from uniform.
        logits = torch.randn(vocab_size, vocab_size, generator=g) * 3.0
        probs = torch.softmax(logits, dim=-1)
        if sample_seed is not None:
            g = torch.Generator().manual_seed(sample_seed)
        start = torch.randint(vocab_size, (num_samples,), generator=g)
        seqs = [start]
        for _ in range(block_size):
            seqs.append(torch.multinomial(probs[seqs[-1]], 1, generator=g).squeeze(1))
        self.data = torch.stack(seqs, dim=1)

    def __len__(self) -> int:
        return self.data.size(0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class BigramDataModule(TokenDataModule):
    """Train/val loaders over generated bigram sequences."""

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        self.train_set = BigramTokens(h.vocab_size, h.block_size, h.num_samples, h.seed)
        self.val_set = BigramTokens(h.vocab_size, h.block_size, max(h.num_samples // 8, h.batch_size), h.seed,
                                    sample_seed=h.seed + 1)  # the same table: validation measures what training learns
