"""A small Llama-shaped causal LM as a LightningModule, and a generated-data module to train it on.

The model follows Llama's recipe: RMSNorm before each sub-layer, rotary position embeddings on
queries and keys, SwiGLU feed-forward, no biases, optionally grouped-query attention (fewer
key/value heads than query heads) and optionally an output head tied to the input embedding
(Llama keeps them apart, which is the default here). Plain PyTorch throughout.

Data is generated on the fly, no download: each sequence is a short random segment repeated to
the block length, its tokens drawn from a fixed Zipf-like distribution. Early steps learn the
token frequencies; later ones learn to copy from one period back, which needs attention and
positions. Every rank generates the same data from the seed.

    lightning-elixir fit --model lightning_elixir.demos.llama.LlamaLightningModule \\
        --data lightning_elixir.demos.llama.RepeatDataModule --trainer.strategy elixir_zero2 \\
        --trainer.accelerator cpu --trainer.devices 2 --trainer.max_steps 20
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

from lightning_elixir.demos.lm import CausalLM, TokenDataModule


@dataclass
class LlamaConfig:
    """Shape and options of the model; the defaults are CPU-test sized."""

    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_kv_head: Optional[int] = None
    """Key/value heads; None: one per query head (multi-head). Fewer: grouped-query attention."""
    intermediate_size: Optional[int] = None
    """SwiGLU hidden width; None: Llama's 2/3 of 4 * n_embd, rounded up to ``multiple_of``."""
    multiple_of: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"the head size n_embd / n_head = {self.n_embd // self.n_head} must be even for rotary "
                             "embeddings; change n_embd or n_head")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.intermediate_size is None:
            hidden = 2 * 4 * self.n_embd // 3
            self.intermediate_size = self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    """Scale by the inverse root mean square (no centring, no bias), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_angles(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, (seq_len, head_dim / 2), in fp32.

    Computed per forward rather than kept as buffers: it is tiny, and buffers would be cast to the
    compute dtype by half-precision runs and left uninitialised by meta-device construction.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim / 2) of ``x`` (batch, heads, seq, head_dim) by each position's angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary positions; grouped-query when n_kv_head < n_head."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.wq = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, n, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rotary(self._heads(self.wq(x), self.n_head), cos, sin)
        k = apply_rotary(self._heads(self.wk(x), self.n_kv_head), cos, sin)
        v = self._heads(self.wv(x), self.n_kv_head)
        if self.n_kv_head != self.n_head:  # grouped-query: each key/value head serves a group of query heads
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.n_embd, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: attention, then the feed-forward."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # N(0, 0.02) as GPT-2; the projections back into the residual stream scaled by 1/sqrt(2 * n_layer)
        # so that the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            else:
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_angles(idx.size(1), self.config.head_dim, self.config.rope_theta, idx.device)
        x = self.tok_embeddings(idx)
        for block in self.layers:
            if self.config.activation_checkpointing and self.training:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.output(self.norm(x))


class LlamaLightningModule(CausalLM):
    """Llama language model: next-token cross-entropy, AdamW with decay on matrices only (lightning_elixir/demos/lm.py).

    With ``meta_init=True`` the model is built in ``configure_model`` (on the meta device under a
    sharding strategy); the parameters then take their modules' own ``reset_parameters`` init.
    """

    def __init__(
        self,
        vocab_size: int = 512,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        n_kv_head: Optional[int] = None,
        intermediate_size: Optional[int] = None,
        tie_embeddings: bool = False,
        rope_theta: float = 10000.0,
        activation_checkpointing: bool = False,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        meta_init: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = LlamaConfig(vocab_size, block_size, n_layer, n_head, n_embd, n_kv_head=n_kv_head,
                                  intermediate_size=intermediate_size, rope_theta=rope_theta,
                                  tie_embeddings=tie_embeddings, activation_checkpointing=activation_checkpointing)
        self._init_model()

    def build_model(self) -> Llama:
        return Llama(self.config)


class RepeatTokens(Dataset):
    """Sequences of a random segment repeated to the block length (seeded, so every rank agrees).

    Segment lengths are drawn from [min_period, max_period]; tokens from a Zipf-like distribution
    (probability ~ 1 / rank), so that the first period is far from uniform too.
    """

    def __init__(self, vocab_size: int, block_size: int, num_samples: int, seed: int = 0,
                 min_period: int = 4, max_period: int = 16) -> None:
        g = torch.Generator().manual_seed(seed)
        zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
        zipf = zipf[torch.randperm(vocab_size, generator=g)]  # frequent tokens spread over the vocabulary
        periods = torch.randint(min_period, max_period + 1, (num_samples,), generator=g)
        segments = torch.multinomial(zipf.float(), num_samples * max_period, replacement=True, generator=g)
        segments = segments.view(num_samples, max_period)
        positions = torch.arange(block_size + 1)
        index = positions.unsqueeze(0) % periods.unsqueeze(1)  # (num_samples, block_size + 1)
        self.data = segments.gather(1, index)

    def __len__(self) -> int:
        return self.data.size(0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class RepeatDataModule(TokenDataModule):
    """Train/val loaders over generated repeated-segment sequences."""

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        self.train_set = RepeatTokens(h.vocab_size, h.block_size, h.num_samples, h.seed)
        self.val_set = RepeatTokens(h.vocab_size, h.block_size, max(h.num_samples // 8, h.batch_size), h.seed + 1)
