"""Launch-bound model shapes other than the GPT for host_overhead.py (``--model``).

Each is a ``CausalLM`` (lightning_elixir/demos/lm.py) whose ``model`` maps token ids to logits, so DDP,
FSDP2 and Elixir drive it the same way. Plain PyTorch, except the Hugging Face ones (built from a
config, never downloaded).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_elixir.demos.lm import CausalLM


class _Stack(nn.Module):
    """Embedding, blocks (optionally checkpointed), final LayerNorm, untied head."""

    def __init__(self, args: argparse.Namespace, block: Callable[[], nn.Module], checkpointing: bool) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.wte = nn.Embedding(args.vocab_size, args.n_embd)
        self.wpe = nn.Embedding(args.block_size, args.n_embd)
        self.h = nn.ModuleList(block() for _ in range(args.n_layer))
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.head = nn.Linear(args.n_embd, args.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        return self.head(self.ln_f(x))


class MoEBlock(nn.Module):
    """Pre-norm attention, then ``experts`` MLPs with top-2 routing (each expert runs on the tokens that chose it)."""

    def __init__(self, d: int, n_head: int, experts: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = self.ln_2(x).flatten(0, 1)
        weights, chosen = self.router(h).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]) * weights[rows, slot, None])
        return x + out.view_as(x)


class TinyParamsBlock(nn.Module):
    """Many small parameters: four LayerNorms, biased Linears, a depthwise causal conv, per-channel scales."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(4))
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.conv = nn.Conv1d(d, d, kernel_size=3, groups=d, padding=2)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(d)) for _ in range(3))
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(self.norms[0](x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.scales[0] * self.proj(y)
        x = x + self.scales[1] * self.conv(self.norms[1](x).transpose(1, 2))[..., :T].transpose(1, 2)
        x = x + self.scales[2] * self.norms[3](self.out(F.gelu(self.fc(self.norms[2](x)))))
        return x


class _Logits(nn.Module):
    """A Hugging Face causal LM that returns its logits only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=idx).logits


def _hf(kind: str, args: argparse.Namespace) -> nn.Module:
    import transformers as tr

    common = dict(vocab_size=args.vocab_size, bos_token_id=0, eos_token_id=0)
    if kind == "hf_gpt2":
        config = tr.GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                               n_positions=args.block_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return _Logits(tr.GPT2LMHeadModel(config))
    config = tr.LlamaConfig(hidden_size=args.n_embd, intermediate_size=2 * args.n_embd, num_hidden_layers=args.n_layer,
                            num_attention_heads=args.n_head, num_key_value_heads=args.n_head,
                            max_position_embeddings=args.block_size, tie_word_embeddings=False, **common)
    import peft

    model = peft.get_peft_model(tr.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    return _Logits(model)


class ShapeLM(CausalLM):
    def __init__(self, build_fn: Callable[[], nn.Module], learning_rate: float = 1e-3, weight_decay: float = 0.1,
                 meta_init: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["build_fn"])
        self._build_fn = build_fn
        self.config = None
        self._init_model()

    def build_model(self) -> nn.Module:
        return self._build_fn()

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
                  {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.hparams.learning_rate, betas=(0.9, 0.95))


def build_shape(name: str, args: argparse.Namespace, checkpointing: bool) -> CausalLM:
    d, heads = args.n_embd, args.n_head
    if name == "moe":
        return ShapeLM(lambda: _Stack(args, lambda: MoEBlock(d, heads, args.experts), checkpointing))
    if name == "tiny_params":
        return ShapeLM(lambda: _Stack(args, lambda: TinyParamsBlock(d, heads), checkpointing))
    if checkpointing:
        raise SystemExit(f"--model {name} runs with --checkpointing off only")
    return ShapeLM(lambda: _hf(name, args))
