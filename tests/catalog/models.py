"""The catalog: small, ordinary LightningModules as a user would train them with strategy="ddp".

Each ``Case`` names a module factory, its data, what the run does (fit by default; validate, test,
predict, a second Trainer, ...) and the tolerance its comparison with DDP uses. The harness calls
``case.module()`` right after ``L.seed_everything(case.seed)`` and then ``case.run(ctx)`` with a
``Ctx`` (see harness.py) that builds Trainers with the strategy under test and records losses per
step, logged metrics and final weights. ``ctx.extras`` takes anything else a case wants compared
per rank (validation results, predictions, EMA weights, ...).

Data never comes from the global RNG (fixed ``torch.Generator`` seeds), so the only global-RNG
consumers are the modules themselves (init, dropout, noise) and both strategies see the same
sequence. 32 samples, batch 4, 2 ranks: 4 optimizer steps per epoch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, GradientAccumulationScheduler, StochasticWeightAveraging
from lightning.pytorch.utilities import grad_norm
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.optimizers import Lion

# ---------------------------------------------------------------------------------------------------------------------
# case description


@dataclass(frozen=True)
class Tol:
    """How close a result must be to DDP's.

    fp32 default: relative 1e-5 on losses and logged values (absolute floor 1e-7 for values near
    zero), and on weights elementwise with an absolute floor of 1e-6 (1e-5 of a typical weight of
    0.1, for elements that sit near zero). Elixir keeps DDP's arithmetic (64-element aligned
    parameters, a two-rank sum is exact), so anything beyond rounding noise is a real difference.
    """

    loss: float = 1e-5
    """Relative tolerance of losses per step and of logged values (metrics, grad norms, lrs)."""
    weight_rtol: float = 1e-5
    weight_atol: float = 1e-6
    update: Optional[float] = None
    """If set (bf16): compare each parameter's update (final - initial) norm-wise with this relative
    tolerance, ||dW_elixir - dW_ddp|| <= update * ||dW_ddp||, instead of the weights elementwise."""
    why: str = "fp32, same summation order as DDP"


BF16 = Tol(loss=2e-2, weight_rtol=2e-2, weight_atol=1e-2, update=5e-2, why=(
    "bf16-mixed: bf16 keeps 8 mantissa bits (rounding 2^-9 = 2e-3 per op); DDP runs fp32 weights under "
    "autocast while Elixir gathers bf16 compute copies, so ops outside autocast's lists (bias adds, norms, "
    "BatchNorm on bf16 inputs) round differently and a few steps compound that to ~1e-2 on losses. Weights "
    "are compared by their update (final - initial), norm-wise within 5%: initial weights dominate the "
    "values, so an elementwise check would hide a wrong update. SGD only: Adam would turn bf16 rounding "
    "noise in small gradients into lr-sized steps."))


BF16_TRUE = Tol(loss=1e-3, weight_rtol=8e-3, weight_atol=1e-3, why=(
    "bf16-true: weights, gradients and their reduction are bf16 under both strategies, where one rounding "
    "step is 2^-8 relative and a weight keeps any step it was rounded to. Measured: plan 'auto' matches DDP "
    "within the fp32 tolerance; the one-parameter-per-chunk plan differs by one bf16 step (2.4e-4 at 0.06) "
    "in 2 of 32 biases after 4 steps: it is an explicit layout, run as given, whose shards split each bias "
    "off the 64-element grid, where bf16 kernels round differently ([Note: shards on the vector grid] in "
    "plan.py). Within about 2 steps elementwise; losses within 1e-3."))


ADAM_NEAR_ZERO = Tol(weight_atol=5e-6, why=(
    "AdamW divides each update by the root of the squared-gradient average, so an element whose gradient "
    "is near zero turns a 1-ulp gradient difference into a visible step. Elixir's hooks put identity nodes "
    "on module inputs, which can change the order in which autograd adds a tensor's gradient contributions: "
    "measured on the tiny Llama, losses are equal at every step and 2 of 1024 q_proj elements differ by "
    "2.6e-6 after the last step (swapping two samples inside a batch, a no-op mathematically, moves them by "
    "2.2e-6 under DDP itself). The elementwise floor is raised to 5e-6; the relative tolerance stays 1e-5."))


@dataclass(frozen=True)
class Case:
    name: str
    module: Callable[[], L.LightningModule]
    """Builds the module; called right after ``L.seed_everything(seed)``."""
    data: Callable[[], dict[str, DataLoader]]
    """Loaders by role: "train", "val", "test", "predict"."""
    run: Callable[[Any], None] = None  # type: ignore[assignment]
    """What the run does with ``ctx`` (see harness.Ctx); default: ``fit``."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Trainer kwargs on top of the harness's defaults."""
    ddp: dict[str, Any] = field(default_factory=dict)
    """DDPStrategy kwargs (e.g. find_unused_parameters=True where plain DDP would refuse the module)."""
    tol: Tol = Tol()
    trains: bool = True
    """Whether the run changes trainable weights (the DDP sanity test checks either way)."""
    requires: Optional[str] = None
    """A module that must be importable (the test skips otherwise)."""
    ddp_check: Optional[Callable[[list[dict]], None]] = None
    """An extra assertion on DDP's results (per-rank list): that the case exercises what it claims."""
    private: tuple[str, ...] = ()
    """Parameters an explicit plan gives private chunks (modules that run on some ranks only), as its
    author would; plan "auto" finds them itself."""
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.run is None:
            object.__setattr__(self, "run", fit)


# ---------------------------------------------------------------------------------------------------------------------
# data (fixed generators: independent of the global RNG)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def loader(ds: Dataset, batch_size: int = 4, shuffle: bool = False, **kwargs: Any) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, **kwargs)


def cls_set(n: int = 32, d: int = 8, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = _g(seed)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def seq_set(n: int = 32, t: int = 6, d: int = 8, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = _g(seed)
    x = torch.randn(n, t, d, generator=g)
    y = (x.mean(1) @ torch.randn(d, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def ctc_set(n: int = 32, t: int = 12, d: int = 8, classes: int = 5, longest: int = 4, seed: int = 0) -> TensorDataset:
    """Frame sequences, padded label sequences (labels 1..classes-1; 0 is CTC's blank) and their lengths,
    which vary: the loss's shapes depend on them."""
    g = _g(seed)
    x = torch.randn(n, t, d, generator=g)
    targets = torch.randint(1, classes, (n, longest), generator=g)
    target_lengths = torch.randint(1, longest + 1, (n,), generator=g)
    frame_lengths = torch.randint(t - 3, t + 1, (n,), generator=g)
    return TensorDataset(x, targets, frame_lengths, target_lengths)


def image_set(n: int = 32, c: int = 3, hw: int = 8, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = _g(seed)
    x = torch.randn(n, c, hw, hw, generator=g) * 2 + 0.5
    y = (x.mean((2, 3)) @ torch.randn(c, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def token_set(n: int = 32, t: int = 16, vocab: int = 64, seed: int = 0) -> TensorDataset:
    """Sequences from a fixed random bigram table; (input, next-token target)."""
    g = _g(seed)
    table = torch.randint(vocab, (vocab, 2), generator=g)
    seq = torch.empty(n, t + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab, (n,), generator=g)
    for i in range(t):
        pick = torch.randint(2, (n,), generator=g)
        seq[:, i + 1] = table[seq[:, i], pick]
    return TensorDataset(seq[:, :-1].clone(), seq[:, 1:].clone())


def cls_data(**kw: Any) -> dict[str, DataLoader]:
    return dict(train=loader(cls_set(seed=0, **kw)), val=loader(cls_set(seed=1, **kw)))


def seq_data() -> dict[str, DataLoader]:
    return dict(train=loader(seq_set(seed=0)), val=loader(seq_set(seed=1)))


def image_data() -> dict[str, DataLoader]:
    return dict(train=loader(image_set(seed=0)), val=loader(image_set(seed=1)))


def token_data() -> dict[str, DataLoader]:
    return dict(train=loader(token_set(seed=0)), val=loader(token_set(seed=1)))


# ---------------------------------------------------------------------------------------------------------------------
# runs (ctx: harness.Ctx)


def fit(ctx: Any) -> None:
    ctx.trainer().fit(ctx.model, ctx.data["train"], ctx.data.get("val"))


def fit_then_validate(ctx: Any) -> None:
    """Fit, then validate with the same Trainer: evaluation after training, per rank."""
    fit(ctx)
    ctx.extras["validate"] = ctx.trainers[-1].validate(ctx.model, ctx.data["val"], verbose=False)


def validate_only(ctx: Any) -> None:
    ctx.extras["validate"] = ctx.trainer().validate(ctx.model, ctx.data["val"], verbose=False)


def run_test_only(ctx: Any) -> None:
    ctx.extras["test"] = ctx.trainer().test(ctx.model, ctx.data["test"], verbose=False)


def predict_only(ctx: Any) -> None:
    out = ctx.trainer().predict(ctx.model, ctx.data["predict"])
    ctx.extras["predictions"] = torch.cat([o.detach().float() for o in out])


def second_trainer(ctx: Any) -> None:
    """Fit, then a fresh Trainer (and strategy) on the same module: fit again, then validate."""
    ctx.trainer(max_steps=2).fit(ctx.model, ctx.data["train"])
    second = ctx.trainer()
    second.fit(ctx.model, ctx.data["train"], ctx.data["val"])
    ctx.extras["validate"] = second.validate(ctx.model, ctx.data["val"], verbose=False)


def state_dict_after_fit(ctx: Any) -> None:
    """What a user does after trainer.fit: model.state_dict() on every rank (e.g. to save it)."""
    fit(ctx)
    ctx.extras["module_state"] = {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}


def save_checkpoint_after_fit(ctx: Any) -> None:
    """``trainer.save_checkpoint(path)`` after fit, on every rank (a script's last line): the file rank 0
    wrote, weights and optimizer state, as a plain module and torch optimizer would have them."""
    trainer = ctx.trainer()
    trainer.fit(ctx.model, ctx.data["train"])
    path = ctx.root.parent / "after_fit.ckpt"  # one path on every rank (each has a root of its own)
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()
    saved = torch.load(path, weights_only=False)
    ctx.extras["saved_weights"] = saved["state_dict"]
    ctx.extras["saved_optimizer_state"] = saved["optimizer_states"][0]["state"]


def forward_one_rank_after_fit(ctx: Any) -> None:
    """After fit, rank 0 alone runs the model (e.g. a sample at the end of a script); rank 1 does not."""
    fit(ctx)
    if ctx.rank == 0:
        x = ctx.data["val"].dataset.tensors[0][:4]
        ctx.model.eval()
        with torch.no_grad():
            ctx.extras["forward"] = ctx.model(x).detach().clone()


def after_failed_stages(ctx: Any) -> None:
    """A stage that raised on every rank (a bug in validation_step, caught by the script): the same Trainer then
    fits and the module reads as a plain one; a stage that fails again leaves it to a fresh Trainer, which fits."""
    trainer = ctx.trainer()
    for attempt in (trainer, ctx.trainer()):
        ctx.model.failing = True
        with contextlib.suppress(ValueError):
            attempt.validate(ctx.model, ctx.data["val"], verbose=False)
        ctx.model.failing = False
        if attempt is trainer:
            trainer.fit(ctx.model, ctx.data["train"], ctx.data["val"])
            ctx.extras["after_fit"] = {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}
    ctx.trainer(max_steps=2).fit(ctx.model, ctx.data["train"])


def fit_with(*callbacks: Callable[[], Callback],
             keep: Optional[Callable[[list[Callback]], dict]] = None) -> Callable[[Any], None]:
    """Fit with fresh instances of these callbacks; ``keep`` turns them into extras after fit."""

    def run(ctx: Any) -> None:
        cbs = [make() for make in callbacks]
        ctx.trainer(callbacks=cbs).fit(ctx.model, ctx.data["train"], ctx.data.get("val"))
        if keep is not None:
            ctx.extras.update(keep(cbs))

    return run


# ---------------------------------------------------------------------------------------------------------------------
# base modules


class LossSteps(L.LightningModule):
    """Training and validation steps around ``self.loss(batch)``, logged as train_loss / val_loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))


class Classifier(LossSteps):
    """x: (B, ...) float, y: class in [0, 4). Subclasses set ``self.net`` or override ``forward``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TokenLM(LossSteps):
    """x, y: (B, T) token ids; next-token cross entropy."""

    vocab = 64

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, self.vocab), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def mlp(*sizes: int, act: Callable[[], nn.Module] = nn.ReLU) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------------------------------
# architectures


class SequentialMLP(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 32, 32, 4)


class MHAModel(Classifier):
    """nn.MultiheadAttention: its forward reads ``out_proj.weight``/``bias`` itself (F.multi_head_attention_forward),
    the ``out_proj`` module is never called; in eval without grad it takes the fused fast path."""

    def __init__(self, variant: str = "self") -> None:
        super().__init__()
        self.variant = variant
        self.inp = nn.Linear(8, 16)
        kv = dict(kdim=8, vdim=8) if variant == "cross" else {}
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True, **kv)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.variant == "cross":  # separate q/k/v projection weights
            a, _ = self.attn(h, x, x, need_weights=False)
        elif self.variant == "padding":
            pad = x[..., 0] > 0.8
            pad[:, 0] = False
            a, w = self.attn(h, h, h, key_padding_mask=pad, need_weights=True)
            a = a + w.mean(-1, keepdim=True)
        else:
            a, _ = self.attn(h, h, h, need_weights=False)
        return self.head((h + a).mean(1))


class EncoderLayerModel(Classifier):
    """nn.TransformerEncoderLayer; validation (eval, no grad) runs its fused fast path, which reads
    every parameter directly without calling self_attn/linear1/norm1/... as modules."""

    def __init__(self, stack: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        if stack:
            layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.enc = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(16), enable_nested_tensor=False)
        else:
            self.enc = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x)).mean(1))


class DecoderLayerModel(TokenLM):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.vocab, 16)
        self.memory = nn.Linear(16, 16)
        self.dec = nn.TransformerDecoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, self.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        out = self.dec(h, torch.tanh(self.memory(h)), tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


class RNNModel(Classifier):
    """LSTM/GRU: the module keeps its own list of parameter references (``_flat_weights``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind == "lstm":
            self.rnn = nn.LSTM(8, 16, num_layers=2, batch_first=True)
            self.head = nn.Linear(16, 4)
        else:
            self.rnn = nn.GRU(8, 16, batch_first=True, bidirectional=True)
            self.head = nn.Linear(32, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1] if self.kind == "lstm" else out.mean(1))


class CNN(Classifier):
    def __init__(self, norm: str = "batch") -> None:
        super().__init__()

        def norm_layer(c: int) -> nn.Module:
            return nn.BatchNorm2d(c) if norm == "batch" else nn.GroupNorm(2, c)

        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), norm_layer(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, stride=2), norm_layer(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class BatchNormMLP(Classifier):
    """BatchNorm1d: each rank normalises with its own batch statistics; DDP broadcasts rank 0's running
    stats before every forward (broadcast_buffers=True), so rank 1's eval uses rank 0's stats."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


class TiedHead(nn.Module):
    """An output head that uses the embedding's weight via F.linear; the embedding is not its child."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self._emb = [emb]  # a plain reference: not registered, so not a submodule
        self.bias = nn.Parameter(torch.zeros(emb.num_embeddings))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self._emb[0].weight, self.bias)


class TiedLM(TokenLM):
    def __init__(self, tie: str = "functional") -> None:
        super().__init__()
        self.emb = nn.Embedding(self.vocab, 16)
        self.block = mlp(16, 32, 16, act=nn.GELU)
        self.ln = nn.LayerNorm(16)
        if tie == "functional":
            self.head = TiedHead(self.emb)
        else:  # the classic tie: one Parameter held by two modules
            self.head = nn.Linear(16, self.vocab, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(self.ln(h + self.block(h)))


class TiedRenorm(TiedLM):
    """A tied embedding whose rows are renormalised in place (norm at most 0.5) at the start of each training
    step or before each optimizer step: a chunk held privately, written outside its modules' forwards."""

    def __init__(self, where: str) -> None:
        super().__init__("shared")
        self.where = where

    def _renorm(self) -> None:
        with torch.no_grad():
            w = self.emb.weight
            w.div_(w.norm(dim=1, keepdim=True).clamp(min=0.5) / 0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.where == "step_start":
            self._renorm()
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.where == "before_step":
            self._renorm()


class ConstrainedAfterStep(Classifier):
    """Weights kept in a box after every optimizer step (WGAN's critic clipping, a max-norm or non-negativity
    constraint) after ``super().optimizer_step`` in an ``optimizer_step`` override; or the weight norm logged
    in the hooks between training_step and backward."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.net = mlp(8, 32, 4)
        self.where = where

    def _constrain(self) -> None:
        with torch.no_grad():
            for p in self.net.parameters():
                p.clamp_(-0.05, 0.05)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.where == "optimizer_step":
            self._constrain()

    def _log_norm(self) -> None:
        self.log("weight_norm", sum(p.norm() ** 2 for p in self.net.parameters()).sqrt())

    def on_before_zero_grad(self, optimizer: Any) -> None:
        if self.where == "norm_before_zero_grad":  # Lightning's place to inspect the updated weights
            self._log_norm()

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.where == "norm_before_backward":
            self._log_norm()


class DecayedInStep(Classifier):
    """The first layer's weight decayed by hand (in place, no_grad) at the start of each training step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 32, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.net[0].weight.mul_(0.9)
        return super().training_step(batch, batch_idx)


class ClampedLinear(nn.Linear):
    """Clamps its weight in place (no_grad) at the start of its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.clamp_(-0.15, 0.15)
        return super().forward(x)


class MaskedLinear(nn.Linear):
    """Zeroes a fixed third of its weight in place (no_grad) at the start of its own forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("mask", (torch.arange(self.weight.numel()) % 3 != 0).float().view_as(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.mul_(self.mask)
        return super().forward(x)


class LinearWithConstraint(nn.Linear):
    """Rows renormalised to norm 0.5 by assigning ``.data`` at the start of its own forward, as braindecode's
    ``LinearWithConstraint`` (EEGNet's max-norm constraint) does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.data = torch.renorm(self.weight.data, p=2, dim=0, maxnorm=0.5)
        return super().forward(x)


class WrittenInForward(Classifier):
    def __init__(self, first: type) -> None:
        super().__init__()
        self.net = nn.Sequential(first(8, 32), nn.ReLU(), nn.Linear(32, 4))


class FrozenIndexTable(Classifier):
    """A frozen integer parameter (a permutation of the features) used as an index."""

    def __init__(self) -> None:
        super().__init__()
        self.perm = nn.Parameter(torch.randperm(8), requires_grad=False)
        self.net = mlp(8, 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x[:, self.perm])


class FrozenBf16Table(Classifier):
    """A frozen bf16 parameter used in its own dtype in an fp32 model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.table = nn.Parameter((torch.randn(16, 16) * 0.2).to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((torch.tanh(self.inp(x)).to(self.table.dtype) @ self.table).float())


class TrainableBf16Layer(Classifier):
    """A trainable bf16 layer in an fp32 model: trained in bf16 under SGD, as under DDP. Its private chunk
    (272 elements) is split between the ranks on the 64-element grid; split at element 136, the shards'
    SGD steps rounded a few elements a bf16 step away from DDP's ([Note: shards on the vector grid])."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16).to(torch.bfloat16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(torch.tanh(self.inp(x)).bfloat16()).float())


class Float64Layer(Classifier):
    """A trainable float64 layer in an fp32 model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16).double()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x.double())).float())


def _allreduce_as_real(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default mean all-reduce of a gradient bucket, a complex one as its real and imaginary parts
    (unannotated: register_comm_hook refuses annotations other than dist.GradBucket and Future)."""
    buf = bucket.buffer()
    flat = torch.view_as_real(buf) if buf.is_complex() else buf
    flat.div_(torch.distributed.get_world_size())
    return torch.distributed.all_reduce(flat, async_op=True).get_future().then(lambda _: buf)


# gloo before torch 2.11 has no complex broadcast or all-reduce ("Invalid scalar type" from DDP's initial
# _sync_params_and_buffers, then from its gradient reduction; seen on 2.8, gone by 2.11). There DDP's
# reference skips the initial broadcast (every rank builds the module from the same seed) and reduces
# gradient buckets as real views (ComplexLayer.on_fit_start: Lightning registers ddp_comm_hook on CUDA
# only); from 2.11 on it runs as DDP does by default.
_GLOO_HAS_COMPLEX = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)
_COMPLEX_DDP: dict[str, Any] = {} if _GLOO_HAS_COMPLEX else dict(init_sync=False)


class ComplexLayer(Classifier):
    """A trainable complex parameter (Adam on its real and imaginary parts)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16, dtype=torch.cfloat) * 0.3)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x.to(torch.cfloat) @ self.w).abs())

    def on_fit_start(self) -> None:
        ddp = self.trainer.strategy.model
        if not _GLOO_HAS_COMPLEX and isinstance(ddp, nn.parallel.DistributedDataParallel):
            ddp.register_comm_hook(None, _allreduce_as_real)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class HeadThenBackbone(Classifier):
    """The optimizer starts with the head only; ``AddBackboneGroup`` gives it the backbone at epoch 1."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.head.parameters(), lr=1e-2)


class AddBackboneGroup(Callback):
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters()), "lr": 5e-3})


class WeightOutsideModule(Classifier):
    """``self.proj`` is never called: the parent reads its weight and bias in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.enc(x)) @ self.proj.weight.t() + self.proj.bias


class RootParameters(Classifier):
    """Parameters held by the LightningModule itself (a temperature and an offset), used in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.offset = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) / self.temperature + self.offset


class VmapEnsemble(Classifier):
    """An ensemble of three MLPs evaluated at once: their parameters stacked (``torch.func.stack_module_state``)
    in an ``nn.ParameterList`` that is never called, and ``torch.vmap`` over ``functional_call`` on a meta copy
    of one member. vmap wraps each stacked parameter in C++, which no ``__torch_function__`` sees."""

    def __init__(self) -> None:
        super().__init__()
        members = [mlp(8, 16, 4) for _ in range(3)]
        params, _ = torch.func.stack_module_state(members)
        self.names = list(params)
        self.stacked = nn.ParameterList(nn.Parameter(params[name]) for name in self.names)
        self.skeleton = (members[0].to("meta"),)  # a tuple: not a submodule, holds no parameters of the model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def member(*params: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.skeleton[0], dict(zip(self.names, params)), (x,))

        return torch.vmap(member)(*self.stacked).mean(0)


class VmapEnsembleInStep(VmapEnsemble):
    """The ensemble evaluated in ``training_step`` itself, never through the module's forward: no hook of the
    unit that owns the stacked parameters (the root) runs, and vmap's reads of them are seen by no
    ``__torch_function__``; plan "auto" must find them read in the step and keep them gathered."""

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch

        def member(*params: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.skeleton[0], dict(zip(self.names, params)), (x,))

        return F.cross_entropy(torch.vmap(member)(*self.stacked).mean(0), y)


class SharedTwice(Classifier):
    """One block called twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(self.inp(x))))


class FrozenBackbone(Classifier):
    """A frozen feature extractor (requires_grad=False) and a trainable head; optimizer over trainable ones."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = mlp(8, 32, 16)
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


class FrozenBNBackbone(Classifier):
    """Fine-tuning: a frozen CNN backbone kept in eval mode (BatchNorm running stats fixed) under a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(8, 4)

    def train(self, mode: bool = True) -> "FrozenBNBackbone":
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9)


class UnusedBranch(Classifier):
    """An auxiliary head used on even steps only (the same on every rank: control flow by step)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inp(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.relu(self.inp(x))
        out = self.head(h)
        if batch_idx % 2 == 0:
            out = out + self.aux(h)
        loss = F.cross_entropy(out, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        # plain SGD: an unused parameter's update is zero whether its gradient is None (DDP) or zero
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Checkpointed(Classifier):
    """torch.utils.checkpoint (non-reentrant) around each residual block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                    for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False)
        return self.head(h)


class NormMLP(Classifier):
    def __init__(self, norm: str) -> None:
        super().__init__()
        make = {"layer": lambda: nn.LayerNorm(32), "rms": lambda: nn.RMSNorm(32)}[norm]
        self.net = nn.Sequential(nn.Linear(8, 32), make(), nn.GELU(), nn.Linear(32, 32), make(), nn.GELU(),
                                 nn.Linear(32, 4))


class BufferUpdater(Classifier):
    """Normalises inputs with a running mean it updates in training forward, and counts samples."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(8))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.net = mlp(8, 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.seen += x.shape[0]
        return self.net(x - self.running_mean)


class DropoutMLP(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Dropout(0.3), nn.Linear(32, 4))


class TinyGPT(TokenLM):
    """nanoGPT-shaped: SDPA causal attention, pre-norm blocks, tied embedding, no biases in linears."""

    def __init__(self, n_embd: int = 32, n_head: int = 2, n_layer: int = 2, block: int = 16, optimizer: str = "adamw"):
        super().__init__()
        self.n_head, self.optimizer = n_head, optimizer
        self.wte = nn.Embedding(self.vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(n_embd), qkv=nn.Linear(n_embd, 3 * n_embd, bias=False),
            proj=nn.Linear(n_embd, n_embd, bias=False), ln2=nn.LayerNorm(n_embd),
            fc=nn.Linear(n_embd, 2 * n_embd, bias=False), out=nn.Linear(2 * n_embd, n_embd, bias=False),
        )) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, self.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape
        h = self.wte(x) + self.wpe(torch.arange(T))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](h)).split(h.shape[-1], dim=2)
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + blk["proj"](a.transpose(1, 2).reshape(B, T, -1))
            h = h + blk["out"](F.gelu(blk["fc"](blk["ln2"](h))))
        return self.lm_head(self.ln_f(h))

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5)
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=1e-2)


class _GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.fc, self.out = nn.Linear(n_embd, 2 * n_embd, bias=False), nn.Linear(2 * n_embd, n_embd, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, C = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class CompiledGPT(TokenLM):
    """TinyGPT's shape with torch.compile: each block compiled in place (``block.compile()``, as torchtitan
    does), or the whole forward. "aot_eager" traces through Dynamo and AOTAutograd, where hooks and
    parameters meet the compiler, without the C++ build a CPU inductor kernel costs."""

    def __init__(self, how: str, n_embd: int = 32, n_head: int = 2, n_layer: int = 2, block: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(self.vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.blocks = nn.ModuleList(_GPTBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, self.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        if how == "blocks":
            for blk in self.blocks:
                blk.compile(backend="aot_eager")
        else:
            self._body = torch.compile(self._body, backend="aot_eager")

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for blk in self.blocks:
            h = blk(h)
        return self.lm_head(self.ln_f(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._body(x)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------------------------------------------------------------
# batches and training_step idioms


class DictDataset(Dataset):
    def __init__(self, seed: int) -> None:
        self.x, self.y = cls_set(seed=seed).tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "name": f"sample-{i * 7 % 23}", "pair": (self.x[i] * 2, i)}


class DictBatch(Classifier):
    """Batches are dicts holding tensors, a list of strings and a (tensor, int) tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def loss(self, batch: dict) -> torch.Tensor:
        weight = torch.tensor([1.0 + len(name) % 3 for name in batch["name"]])
        doubled, index = batch["pair"]
        logits = self(batch["x"]) + 0.01 * self(doubled) * index.float().unsqueeze(1)
        return (F.cross_entropy(logits, batch["y"], reduction="none") * weight).mean()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, batch_size=len(batch["name"]))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), batch_size=len(batch["name"]))


class NestedTupleDataset(Dataset):
    def __init__(self, seed: int) -> None:
        self.x, self.y = seq_set(seed=seed).tensors
        self.mask = torch.arange(6).expand(len(self.x), 6) < (torch.arange(len(self.x)) % 5 + 2).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple:
        return (self.x[i], self.mask[i]), self.y[i]


class NestedTupleBatch(Classifier):
    """Batches ((x, bool mask), y): masked mean pooling over a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, inputs: tuple) -> torch.Tensor:
        x, mask = inputs
        h = torch.tanh(self.inp(x)).masked_fill(~mask.unsqueeze(-1), 0.0)
        return self.head(h.sum(1) / mask.sum(1, keepdim=True))


class HostSyncs(Classifier):
    """training_step calls loss.item(), float(loss), ``if torch.isnan(loss)`` and .tolist()."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        if torch.isnan(loss):
            return None
        self.seen.append(loss.item())
        preds = logits.argmax(1).tolist()
        acc = sum(int(p == t) for p, t in zip(preds, y.tolist())) / len(preds)
        self.log("loss_float", float(loss))
        self.log("acc_from_list", acc)
        self.log("mean_seen", sum(self.seen) / len(self.seen))
        return loss


class MasksAndNonzero(Classifier):
    """Boolean masks and torch.nonzero: samples labelled -1 are ignored, a row subset is gathered by index."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        y = torch.where(torch.arange(len(y)) % 3 == 1, -1, y)
        valid = y >= 0
        idx = torch.nonzero(valid).squeeze(1)
        logits = self(x[idx])
        confident = logits.softmax(-1).max(-1).values > 0.3
        extra = logits[confident].pow(2).mean() if bool(confident.any()) else logits.sum() * 0
        return F.cross_entropy(logits, y[valid]) + 0.01 * extra


class WithTorchmetrics(Classifier):
    """torchmetrics updated in training_step, logged on step and epoch (epoch values synced across ranks)."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.net = mlp(8, 16, 4)
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")
        self.train_loss_mean = torchmetrics.MeanMetric()
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.train_loss_mean.update(loss.detach())
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_loss_mean", self.train_loss_mean, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_acc.update(self(x), y)
        self.log("val_acc", self.val_acc)


class LossHistory(Classifier):
    """Keeps the losses in a list on the module and logs statistics of it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)
        self.history: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.history.append(loss.detach())
        self.log("recent_mean", torch.stack(self.history[-2:]).mean())
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("epoch_mean", torch.stack(self.history).mean())


class L2Penalty(Classifier):
    """An explicit L2 penalty over self.parameters() inside training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        l2 = sum(p.pow(2).sum() for p in self.parameters())
        loss = self.loss(batch) + 1e-2 * l2
        self.log("l2", l2)
        return loss


# ---------------------------------------------------------------------------------------------------------------------
# optimization


class ManualMLP(Classifier):
    """Manual optimization of a small MLP of ``sizes``; subclasses write the training step."""

    sizes: tuple[int, ...] = (8, 16, 4)

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = mlp(*self.sizes)


class ManualOptimization(ManualMLP):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = self.loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        self.log("train_loss", loss)
        return loss.detach()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


class ZerothOrderGrads(ManualMLP):
    """Zeroth-order training (SPSA, as MeZO fine-tunes without a backward): the weights are moved along a
    random direction and back under no_grad, and each parameter's ``.grad`` is assigned the estimate
    times the direction. No step ever runs a backward, so every gradient is assigned first."""

    eps = 1e-2

    def _perturb(self, scale: float, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn(p.shape, generator=gen), alpha=scale * self.eps)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        seed = 1000 + self.global_step
        with torch.no_grad():
            self._perturb(1.0, seed)
            plus = self.loss(batch)
            self._perturb(-2.0, seed)
            minus = self.loss(batch)
            self._perturb(1.0, seed)
        estimate = self.all_gather((plus - minus) / (2 * self.eps)).mean()  # the ranks' mean, as a reduction gives
        gen = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            p.grad = estimate * torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad()
        loss = (plus + minus) / 2
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ProjectedTaskGrads(ManualMLP):
    """Gradient surgery (PCGrad): two task losses differentiated apart with ``torch.autograd.grad``,
    averaged over the ranks, the conflicting component projected out, the sum assigned to ``.grad``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        logits = self(x)
        task_a = F.cross_entropy(logits, y)
        task_b = (logits ** 2).mean()
        params = [p for p in self.parameters()]
        grads = []
        for i, task in enumerate((task_a, task_b)):
            gs = torch.autograd.grad(task, params, retain_graph=i == 0)
            flat = torch.cat([g.reshape(-1) for g in gs])
            grads.append(self.trainer.strategy.reduce(flat, reduce_op="mean"))
        ga, gb = grads
        dot = torch.dot(ga, gb)
        if dot < 0:
            ga = ga - dot / gb.pow(2).sum() * gb
        total, offset = ga + gb, 0
        for p in params:
            p.grad = total[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        opt.step()
        opt.zero_grad()
        loss = task_a + task_b
        self.log("train_loss", loss)
        return loss.detach()


class GAN(L.LightningModule):
    """Two optimizers, manual optimization with toggle_optimizer; noise drawn from the global RNG.
    ``zero_after_step``: each optimizer zeroes its gradients after its step rather than before its
    backward, so the discriminator's gradients are right only where the generator's loss computed none
    for it (toggle_optimizer froze it). ``clip``: the generator's gradients are clipped to this norm with
    ``self.clip_gradients`` while the discriminator, frozen by the toggle, holds its own step's gradients."""

    def __init__(self, zero_after_step: bool = False, d_every: int = 1, clip: Optional[float] = None) -> None:
        super().__init__()
        self.zero_after_step = zero_after_step
        self.d_every = d_every
        self.clip = clip
        """The discriminator accumulates over this many batches (the generator steps in between, toggled)."""
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: Any, batch_idx: int) -> dict:
        real = batch[0]
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)) / 2
        self._step(opt_d, d_loss, now=(batch_idx + 1) % self.d_every == 0)
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        if self.zero_after_step:  # what the module's own flags say (logged, so compared with DDP's)
            self.log("discriminator_trains_in_g_step", float(any(p.requires_grad for p in self.discriminator.parameters())))
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
        self._step(opt_g, g_loss)
        self.untoggle_optimizer(opt_g)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})
        return {"loss": (d_loss + g_loss).detach()}

    def _step(self, opt: Any, loss: torch.Tensor, now: bool = True) -> None:
        if not self.zero_after_step:
            opt.zero_grad()
        self.manual_backward(loss)
        if self.clip is not None and opt is self.optimizers()[0]:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        if now:
            opt.step()
            if self.zero_after_step:
                opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-2, betas=(0.5, 0.999)))


class ZeroedByEach(ManualMLP):
    """Two optimizers over one chunk's parameters, no toggling, each zeroing its gradients (to None) after
    its own step: the second loss reaches the head only, so the body's gradients must start from zero."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt_body, opt_head = self.optimizers()
        x, y = batch
        loss = self.loss(batch)
        self.manual_backward(loss)
        opt_body.step()
        opt_body.zero_grad()
        head_loss = F.cross_entropy(self.net[-1](torch.relu(self.net[0](x)).detach()), y)
        self.manual_backward(head_loss)
        opt_head.step()
        opt_head.zero_grad()
        self.log("train_loss", loss)
        return loss.detach()

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.net[0].parameters(), lr=0.1, momentum=0.9),
                torch.optim.SGD(self.net[-1].parameters(), lr=0.1, momentum=0.9))


class GradNormLogging(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 16, 4)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


class FailingValidation(Classifier):
    """``validation_step`` raises while ``failing`` is set (on every rank)."""

    failing = False

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.failing:
            raise ValueError("a bug in validation_step")
        super().validation_step(batch, batch_idx)


class AssignedGrads(Classifier):
    """Gradients replaced by assignment before the optimizer step: the weights' halved, the first layer's
    bias dropped (``None``: not stepped) on odd steps."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 16, 4)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for layer in (self.net[0], self.net[2], self.net[4]):
            layer.weight.grad = layer.weight.grad * 0.5
        if self.trainer.global_step % 2:
            self.net[0].bias.grad = None


class ScaledLoss(Classifier):
    """A three-layer MLP whose loss is scaled so that its gradients' norm is well above 1 (clipping bites)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = 20 * self.loss(batch)
        self.log("train_loss", loss)
        return loss


class ManualClip(ScaledLoss):
    """clip_grad_norm_ by hand in on_before_optimizer_step."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        total = torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)
        self.log("total_norm_before_clip", total)


class HeadOnlyOptimizer(ScaledLoss):
    """The optimizer holds the head only; the body trains too (its gradients exist) but is never stepped.
    Clipping by norm, as the Trainer does it for this optimizer, sees the head's gradients only."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net[-1].parameters(), lr=0.1, momentum=0.9)


class ClipEach(ManualMLP):
    """Manual optimization, two optimizers, one backward reaching both; each clipped (by norm, then by value)
    over its own parameters before its step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt_body, opt_head = self.optimizers()
        opt_body.zero_grad()
        opt_head.zero_grad()
        loss = 20 * self.loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(opt_head, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
        opt_head.step()
        self.clip_gradients(opt_body, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        self.clip_gradients(opt_body, gradient_clip_val=0.02, gradient_clip_algorithm="value")
        opt_body.step()
        self.log("train_loss", loss)
        return loss.detach()

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[-1].parameters(), lr=0.1))


class WithOptimizer(Classifier):
    """Param groups and an LR scheduler, one optimizer family per case."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.body = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16), nn.GELU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        by_dim = [{"params": decay, "weight_decay": 1e-2}, {"params": no_decay, "weight_decay": 0.0}]
        by_module = [{"params": self.body.parameters()}, {"params": self.head.parameters(), "lr": 5e-2}]
        if self.kind == "sgd":
            opt = torch.optim.SGD(by_dim, lr=0.1, momentum=0.9, nesterov=True)
            sched = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "interval": "step"}
        elif self.kind == "adam":
            opt = torch.optim.Adam(by_module, lr=1e-2)
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)  # per epoch (2 epochs)
        elif self.kind == "adamw":
            opt = torch.optim.AdamW(by_dim, lr=1e-2, betas=(0.9, 0.95))
            sched = {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4), "interval": "step"}
        elif self.kind == "adagrad":  # its constructor makes per-element state (the sums) from the parameters
            opt = torch.optim.Adagrad(by_dim, lr=5e-2, initial_accumulator_value=0.1, lr_decay=0.01)
            sched = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), "interval": "step"}
        elif self.kind == "adafactor":  # not element-wise: the runtime's own step ([Note: Adafactor on shards])
            opt = torch.optim.Adafactor(by_dim, lr=2e-2)
            sched = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), "interval": "step"}
        elif self.kind == "trust_ratio":  # declared per-parameter: its step on whole parameters ([Note: per-parameter optimizers])
            from tests.optimizers import TrustRatioAdam

            opt = TrustRatioAdam(by_dim, lr=2e-2)
            sched = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), "interval": "step"}
        elif self.kind == "hf_adafactor":  # Hugging Face's: relative steps scaled by each parameter's RMS
            from transformers.optimization import Adafactor

            return Adafactor(by_module, lr=None, beta1=0.9)  # its own schedule: no lr for a scheduler to scale
        else:
            opt = torch.optim.RMSprop(by_module, lr=1e-2, momentum=0.5, alpha=0.9)
            sched = {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3)),
                     "interval": "step"}
        return {"optimizer": opt, "lr_scheduler": sched}


class MomentumTeacher(Classifier):
    """A student and its momentum teacher (BYOL's, a mean teacher's): the teacher's outputs are a target,
    and the module moves the teacher towards the student in its own ``on_train_batch_end``, in place, with
    no ``gathered_params()`` ([Note: hooks every rank runs])."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 32, 4)
        self.teacher = mlp(8, 32, 4)
        self.teacher.requires_grad_(False)

    def loss(self, batch: Any) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(batch[0]).softmax(-1)
        return super().loss(batch) + F.mse_loss(self(batch[0]).softmax(-1), target)

    @torch.no_grad()
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for teacher, student in zip(self.teacher.parameters(), self.net.parameters()):
            teacher.lerp_(student, 0.3)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)


class NoOptimizer(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def configure_optimizers(self) -> None:
        return None


class MetaInit(Classifier):
    """Layers created in configure_model (the Trainer creates them under its sharded init context)."""

    def __init__(self) -> None:
        super().__init__()
        self.net: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


# ---------------------------------------------------------------------------------------------------------------------
# callbacks written strategy-agnostically


def gathered(trainer: L.Trainer) -> Any:
    """Full parameters outside the training step: the strategy's context if it has one."""
    return getattr(trainer.strategy, "gathered_params", contextlib.nullcontext)()


class EMA(Callback):
    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.ema: Optional[dict[str, torch.Tensor]] = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        with gathered(trainer):
            now = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        if self.ema is None:
            self.ema = now
        else:
            for n, p in now.items():
                self.ema[n].mul_(self.decay).add_(p, alpha=1 - self.decay)


class Prune(Callback):
    """L1 unstructured pruning of every Linear weight after the first epoch, with full weights."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            with gathered(trainer):
                for module in pl_module.modules():
                    if isinstance(module, nn.Linear):
                        torch.nn.utils.prune.l1_unstructured(module, "weight", amount=0.5)


class ReprojectData(Callback):
    """After the second step, gives each Linear weight new values by rebinding ``.data`` (a projection onto
    the unit-norm ball per row, as constrained training does), with full weights."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:
            with gathered(trainer), torch.no_grad():
                for module in pl_module.modules():
                    if isinstance(module, nn.Linear):
                        w = module.weight.data
                        module.weight.data = w / w.norm(dim=1, keepdim=True).clamp(min=1.0)


class WeightNormLogger(Callback):
    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        with gathered(trainer):
            norms = {f"wnorm/{n}": p.detach().norm() for n, p in pl_module.named_parameters()}
        self.history.append({k: float(v) for k, v in norms.items()})
        pl_module.log_dict(norms)


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face transformers, built from tiny configs (no downloads)


_MORE_HF: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "t5": lambda tr: (tr.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                  decoder_start_token_id=0, dropout_rate=0.0), tr.T5ForConditionalGeneration),
    "deepseek_v3": lambda tr: (tr.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=32), tr.DeepseekV3ForCausalLM),
    "gpt_oss": lambda tr: (tr.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        layer_types=["full_attention", "sliding_attention"], sliding_window=8), tr.GptOssForCausalLM),
    "falcon": lambda tr: (tr.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          hidden_dropout=0.0, attention_dropout=0.0), tr.FalconForCausalLM),
    "gemma": lambda tr: (tr.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        max_position_embeddings=32), tr.GemmaForCausalLM),
    "qwen2": lambda tr: (tr.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32),
                         tr.Qwen2ForCausalLM),
    "qwen3_moe": lambda tr: (tr.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                               num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                               max_position_embeddings=32, router_aux_loss_coef=0.0),
                             tr.Qwen3MoeForCausalLM),
    "phi3": lambda tr: (tr.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2), tr.Phi3ForCausalLM),
    "gpt_neox": lambda tr: (tr.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, max_position_embeddings=32, hidden_dropout=0.0,
                                             attention_dropout=0.0), tr.GPTNeoXForCausalLM),
    "opt": lambda tr: (tr.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                                    max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0,
                                    attention_dropout=0.0, pad_token_id=0), tr.OPTForCausalLM),
    "mistral": lambda tr: (tr.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                            sliding_window=8), tr.MistralForCausalLM),
    "olmo2": lambda tr: (tr.Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2), tr.Olmo2ForCausalLM),
    "gemma2": lambda tr: (tr.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          max_position_embeddings=32, sliding_window=8), tr.Gemma2ForCausalLM),
    "bloom": lambda tr: (tr.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=2, hidden_dropout=0.0,
                                        attention_dropout=0.0), tr.BloomForCausalLM),
    "bart": lambda tr: (tr.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
                                      attention_dropout=0.0, activation_dropout=0.0, pad_token_id=63,
                                      decoder_start_token_id=0, bos_token_id=0, eos_token_id=2),
                        tr.BartForConditionalGeneration),
    "mamba": lambda tr: (tr.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                                        expand=2, conv_kernel=4), tr.MambaForCausalLM),
    "granitemoe": lambda tr: (tr.GraniteMoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                  num_local_experts=4, num_experts_per_tok=2,
                                                  max_position_embeddings=32, router_aux_loss_coef=0.0),
                              tr.GraniteMoeForCausalLM),
}
"""More Hugging Face families, tiny: encoder-decoders (T5, BART), latent attention with routed experts,
sinks, ALiBi (BLOOM), parallel residuals (GPT-NeoX), soft-capped and sliding-window attention (Gemma 2,
Mistral), QK norms (OLMo 2), experts in one weight per layer (Qwen3-MoE, Granite-MoE) and a state-space
model (Mamba)."""


class HFModel(TokenLM):
    def __init__(self, kind: str, dropout: bool = False, ckpt: bool = False, in_configure_model: bool = False,
                 compile_blocks: bool = False, lora: bool = False) -> None:
        super().__init__()
        self.kind, self.dropout, self.ckpt, self.compile_blocks = kind, dropout, ckpt, compile_blocks
        self.lora = lora
        self.model: Optional[nn.Module] = None
        if not in_configure_model:
            self._build()

    def configure_model(self) -> None:
        """Built here (``in_configure_model``), the model is created under the strategy's init context:
        the meta device for Elixir, which must start from the weights DDP's real build gives."""
        if self.model is None:
            self._build()

    def _build(self) -> None:
        import transformers as tr

        kind, dropout, ckpt = self.kind, self.dropout, self.ckpt
        p = 0.1 if dropout else 0.0
        if kind == "gpt2":
            config = tr.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
            cls = tr.GPT2LMHeadModel
        elif kind == "llama":
            config = tr.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_dropout=p)
            cls = tr.LlamaForCausalLM
        elif kind == "mixtral":  # 4 experts, top-2: each rank's tokens pick experts of their own
            config = tr.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
                                      num_local_experts=4, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, router_aux_loss_coef=0.0)
            cls = tr.MixtralForCausalLM
        elif kind == "switch":  # separate expert modules; a rank's tokens reach only some of them
            config = tr.SwitchTransformersConfig(
                vocab_size=64, d_model=32, d_kv=16, d_ff=48, expert_capacity=16, num_layers=2,
                num_sparse_encoder_layers=1, num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=2,
                num_experts=4, dropout_rate=0.0, router_jitter_noise=0.0, decoder_start_token_id=0,
                router_z_loss_coef=0.0, router_aux_loss_coef=0.0)
            cls = tr.SwitchTransformersForConditionalGeneration
        elif kind in _MORE_HF:
            config, cls = _MORE_HF[kind](tr)
        else:
            config = tr.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=32, pad_token_id=0,
                                   hidden_dropout_prob=p, attention_probs_dropout_prob=p)
            cls = tr.BertForMaskedLM
        config._attn_implementation = "eager"
        self.model = cls(config)
        if ckpt:
            self.model.gradient_checkpointing_enable()
        if self.lora:  # PEFT's LoRA on the attention projections: the base model frozen, adapters trained
            import peft

            if ckpt:  # what PEFT asks for with checkpointing: the frozen embeddings' output requires grad
                self.model.enable_input_require_grads()
            targets = ["c_attn"] if kind == "gpt2" else ["q_proj", "v_proj"]
            self.model = peft.get_peft_model(self.model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                         target_modules=targets))
        if self.compile_blocks:  # each decoder layer, as torchtitan compiles blocks ("aot_eager": no C++ build)
            for layer in self.model.model.layers:
                layer.compile(backend="aot_eager")

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        if self.kind == "bert":  # mask every 4th position (token 3 = [MASK]); predict the original there
            masked = torch.arange(x.shape[1]) % 4 == 1
            labels = torch.where(masked, x, -100)
            return self.model(input_ids=torch.where(masked, 3, x), labels=labels).loss
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self) -> Any:
        if self.lora:  # the adapters only, as PEFT fine-tuning is run
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        if self.kind in ("llama", "mixtral", "deepseek_v3", "gemma"):  # no biases anywhere: AdamW as users train it
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        # GPT-2/BERT attention has a key bias whose true gradient is exactly zero; Adam would turn its
        # rounding noise into lr-sized steps, so SGD keeps the comparison about real differences.
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class HFPeftVariant(HFModel):
    """Llama under PEFT variants that LoRA's cases do not reach. "dora" (built in configure_model): DoRA's
    magnitude starts as the norm of the base weight, which a deferred build replays, and its forward reads
    the base layer's weight outside that layer's own forward. "adalora": AdaLoRA's rank allocator reads every
    adapter's gradient after the optimizer step and masks ranks in place there (PEFT's update_and_allocate,
    from an optimizer_step override)."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        super().__init__("llama", in_configure_model=variant == "dora")

    def _build(self) -> None:
        import peft

        super()._build()
        if self.variant == "dora":
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True)
        else:
            config = peft.AdaLoraConfig(init_r=6, target_r=2, tinit=1, tfinal=2, deltaT=1, total_step=8,
                                        lora_alpha=8, target_modules=["q_proj", "v_proj"])
        self.model = peft.get_peft_model(self.model, config)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.variant == "adalora":
            self.model.base_model.update_and_allocate(self.global_step)


class HFResized(HFModel):
    """``resize_token_embeddings`` right after the build (in configure_model: assigned ``.data`` on meta tensors)."""

    def __init__(self, kind: str, in_configure_model: bool, mean_resizing: bool) -> None:
        self.mean_resizing = mean_resizing
        super().__init__(kind, in_configure_model=in_configure_model)

    def _build(self) -> None:
        super()._build()
        self.model.resize_token_embeddings(72, mean_resizing=self.mean_resizing)


class HFGenerating(HFModel):
    """Greedy generation of four tokens with the KV cache, as predictions."""

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        prompt = batch[0][:, :4]
        return self.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                   do_sample=False, pad_token_id=0)


class StateBuiltInConfigureModel(Classifier):
    """Built in configure_model: a torchmetrics metric, a mask kept as a plain tensor attribute and the example
    input the model summary runs (all of which a deferred build must give real values, as to parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.net: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.net is None:
            import torchmetrics

            self.net = mlp(8, 16, 4)
            self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")
            self.mask = (torch.arange(8) % 4 != 0).float()
            self.example_input_array = torch.randn(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * self.mask)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.acc(logits, y)
        self.log("train_acc", self.acc, on_step=True, on_epoch=True)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return loss


class DataSwappedInConfigureModel(Classifier):
    """The head's weight given new values by assigning ``.data`` in configure_model (a classifier grown by two
    classes, its first rows kept), as ``resize_token_embeddings`` does to an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.body: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.body is None:
            self.body = nn.Linear(8, 16)
            self.head = nn.Linear(16, 4)
            bigger = nn.Linear(16, 6)
            bigger.weight.data[:4] = self.head.weight.data
            self.head.weight.data = bigger.weight.data[:4].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


_HF_VISION: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "vit": lambda tr: (tr.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, num_labels=4), tr.ViTForImageClassification),
    "convnext": lambda tr: (tr.ConvNextConfig(num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                              num_labels=4, drop_path_rate=0.0), tr.ConvNextForImageClassification),
    "swin": lambda tr: (tr.SwinConfig(image_size=8, patch_size=2, num_channels=3, embed_dim=16, depths=[1, 1],
                                      num_heads=[2, 2], window_size=2, mlp_ratio=2.0, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=4),
                        tr.SwinForImageClassification),
}
"""Hugging Face vision models, tiny, on 8x8 images: patch embeddings with a class token (ViT), layer
scales on depthwise convolutions (ConvNeXt), windows with relative position bias tables (Swin)."""


class HFVision(Classifier):
    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers as tr

        config, cls = _HF_VISION[kind](tr)
        config._attn_implementation = "eager"
        self.model = cls(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)


# ---------------------------------------------------------------------------------------------------------------------
# DDP sanity checks a case adds (that the case exercises what it claims)


def _check_clipping_needed(results: list[dict]) -> None:
    for r in results:
        norms = [m["total_norm_before_clip"] for m in r["step_metrics"]]
        assert norms and min(norms) > 1.0, f"clip_grad_norm_(1.0) must clip on every step, norms were {norms}"


def _check_ranks_differ_in_bn_stats(results: list[dict]) -> None:
    losses = [r["extras"]["validate"][0]["val_loss"] for r in results]
    assert len(set(losses)) > 1, "ranks should see different validation data"


def _check_lrs_change(results: list[dict]) -> None:
    lrs = [tuple(map(tuple, step)) for step in results[0]["lrs"]]
    assert len(set(lrs)) > 1, f"the LR scheduler should change the learning rate, got {lrs}"


def _check_only_adapters_train(results: list[dict]) -> None:
    weights, init = results[0]["weights"], results[0]["init"]
    changed = {k for k in init if not torch.equal(init[k], weights[k])}
    adapters = {k for k in init if ".lora_A." in k or ".lora_B." in k}
    assert adapters and changed == adapters, f"LoRA must train every adapter and nothing else: changed {sorted(changed)}"


def _check_unused_steps(results: list[dict]) -> None:
    assert len(results[0]["steps"]) >= 3  # both used and unused steps happened


# ---------------------------------------------------------------------------------------------------------------------
# more architectures and training-step idioms


class WeightNormParam(Classifier):
    """torch.nn.utils.parametrizations.weight_norm: the layer's weight is computed from two parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.utils.parametrizations.weight_norm(nn.Linear(8, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x)))


class SparseEmb(TokenLM):
    """nn.Embedding(sparse=True): its gradient is a sparse tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.vocab, 16, sparse=True)
        self.head = nn.Linear(16, self.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


class FeatureHook(Classifier):
    """A forward hook captures hidden features; the loss adds a penalty on them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 16, 4)
        self.feats: list[torch.Tensor] = []
        self.net[1].register_forward_hook(lambda m, i, o: self.feats.append(o))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.feats.clear()
        loss = self.loss(batch) + 1e-2 * self.feats[0].pow(2).mean()
        self.log("train_loss", loss)
        return loss


class TwoViews(Classifier):
    """The whole model twice per step (two augmented views), a consistency loss between them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        a, b = self(x), self(x.flip(-1))
        loss = F.cross_entropy(a, y) + F.mse_loss(a.softmax(-1), b.softmax(-1))
        self.log("train_loss", loss)
        return loss


class GradPenalty(Classifier):
    """WGAN-GP style: a gradient penalty through torch.autograd.grad(create_graph=True) w.r.t. inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x.clone().requires_grad_(True)
        out = self(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = F.cross_entropy(out, y) + 0.1 * (g.norm(dim=1) - 1).pow(2).mean()
        self.log("train_loss", loss)
        return loss


class TwoBackwards(ManualMLP):
    """Manual optimization: two manual_backward calls (two losses) before one step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        l1 = F.cross_entropy(self(x[:2]), y[:2])
        self.manual_backward(l1)
        l2 = F.cross_entropy(self(x[2:]), y[2:])
        self.manual_backward(l2)
        opt.step()
        self.log("train_loss", l1 + l2)
        return (l1 + l2).detach()


class ManualAccum(ManualMLP):
    """Manual optimization stepping every second batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(loss / 2)
        if (batch_idx + 1) % 2 == 0:
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss)
        return loss.detach()


class FusedAdamW(Classifier):
    """AdamW with an implementation flag the user set (``fused`` or ``foreach``)."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag
        self.net = mlp(8, 16, 4)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, **{self.flag: True})


class ParamContainers(Classifier):
    """Parameters in nn.ParameterList / nn.ParameterDict and directly on the module, one of them empty."""

    def __init__(self) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(8, 8) * 0.3) for _ in range(2)])
        self.bs = nn.ParameterDict({"a": nn.Parameter(torch.zeros(8)), "b": nn.Parameter(torch.zeros(4))})
        self.out = nn.Parameter(torch.randn(8, 4) * 0.3)
        self.empty = nn.Parameter(torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.ws:
            x = torch.tanh(x @ w + self.bs["a"])
        return x @ self.out + self.bs["b"] + self.empty.sum()


class SubmoduleEvalInStep(Classifier):
    """A dropout submodule switched to eval inside training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.net[1].eval()
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss


class TeacherStudent(Classifier):
    """Distillation: a frozen teacher under no_grad, a student trained on its soft labels."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = mlp(8, 32, 4).requires_grad_(False)
        self.net = mlp(8, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            t = self.teacher(x).softmax(-1)
        s = self(x)
        loss = F.cross_entropy(s, y) + F.kl_div(s.log_softmax(-1), t, reduction="batchmean")
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)


class UnusedAdamW(UnusedBranch):
    """UnusedBranch under AdamW with weight decay: a step on a parameter without gradient would move it."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class FreezeAtBatch2(Callback):
    """Freezes ``pl_module.toggled`` at batch 2, leaving the optimizer as it is (it keeps the parameters)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            pl_module.toggled.requires_grad_(False)


class ToggleModel(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.toggled = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.toggled(torch.relu(self.inp(x)))))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class ReentrantCheckpointed(Classifier):
    """torch.utils.checkpoint with use_reentrant=True (Hugging Face's default) around each residual block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=True)
        return self.head(h)


class OddParameters(Classifier):
    """A frozen integer parameter, a frozen bf16 parameter in an fp32 model, a non-contiguous parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.w = nn.Parameter(torch.randn(4, 16).t() * 0.2)  # a transposed view: not contiguous
        self.count = nn.Parameter(torch.ones(3, dtype=torch.long), requires_grad=False)
        self.table = nn.Parameter(torch.randn(4, 4).to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.inp(x)) @ self.w) @ self.table.float() * self.count.sum() / 3


class WithLR(SequentialMLP):
    """A learning rate attribute for Lightning's learning-rate finder."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.1

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def lr_find_then_fit(ctx: Any) -> None:
    """Tuner.lr_find (a short fit, a checkpoint saved and restored), then fit with the learning rate it set."""
    from lightning.pytorch.tuner import Tuner

    trainer = ctx.trainer()
    Tuner(trainer).lr_find(ctx.model, ctx.data["train"], num_training=4, min_lr=1e-3, max_lr=1e-1)
    ctx.extras["lr"] = ctx.model.lr
    trainer.fit(ctx.model, ctx.data["train"])


class HookNormalized(Classifier):
    """The hook-based torch.nn.utils.spectral_norm and weight_norm: a forward pre-hook recomputes ``weight``
    from ``weight_orig`` / ``weight_g``, ``weight_v`` (spectral norm also updates its ``u`` buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.utils.spectral_norm(nn.Linear(8, 16))
        self.mid = nn.utils.weight_norm(nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


class FullBackwardHook(Classifier):
    """A user's register_full_backward_hook on a layer, its gradient norm logged."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 16, 4)
        self.seen: list[float] = []
        self.net[2].register_full_backward_hook(lambda m, gi, go: self.seen.append(go[0].norm().item()))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("grad_out_norm", self.seen[-1])


class AllGatherInStep(Classifier):
    """self.all_gather and self.log(sync_dist=True) inside training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("gathered_mean", self.all_gather(loss.detach()).mean())
        self.log("train_loss", loss, sync_dist=True)
        return loss


class SAM(ManualMLP):
    """Sharpness-aware minimization: ascend along the gradient, take the gradient there, step from the start."""

    sizes = (8, 16, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        params = [p for p in self.parameters() if p.grad is not None]
        with torch.no_grad():
            norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
            eps = [0.05 * p.grad / (norm + 1e-12) for p in params]
            for p, e in zip(params, eps):
                p.add_(e)
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.sub_(e)
        opt.step()
        self.log("train_loss", loss)
        return loss.detach()


class SelfTarget(Classifier):
    """The same network under no_grad (a target) and with grad (a prediction) in one step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            target = self(x.flip(0)).softmax(-1)
        out = self(x)
        loss = F.cross_entropy(out, y) + F.mse_loss(out.softmax(-1), target)
        self.log("train_loss", loss)
        return loss


class ParamGradPenalty(Classifier):
    """A penalty on the gradient norm w.r.t. the parameters (torch.autograd.grad, create_graph=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4, act=nn.Tanh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        grads = torch.autograd.grad(loss, list(self.parameters()), create_graph=True)
        total = loss + 0.1 * sum(g.pow(2).sum() for g in grads)
        self.log("train_loss", total)
        return total


class RetainGraph(ManualMLP):
    """Two losses through one graph: backward(retain_graph=True) on the first, then backward on the second."""

    sizes = (8, 16, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        out = self(x)
        l1 = F.cross_entropy(out, y)
        l2 = out.pow(2).mean()
        self.manual_backward(l1, retain_graph=True)
        self.manual_backward(0.1 * l2)
        opt.step()
        self.log("train_loss", l1)
        return l1.detach()


class TwoNames(Classifier):
    """One layer registered under two attribute names, called through both."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.Linear(16, 16)
        self.inp = nn.Linear(8, 16)
        self.a = layer
        self.b = layer
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(self.inp(x))))))


class DictReturn(Classifier):
    """training_step returns a dict with the loss and detached outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> dict:
        x, y = batch
        out = self(x)
        loss = F.cross_entropy(out, y)
        self.log("train_loss", loss)
        return {"loss": loss, "logits": out.detach()}


class ValOnlyParam(Classifier):
    """A temperature used only in validation: under AdamW with weight decay it must never move."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x) / self.temperature, y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class MultiVal(Classifier):
    """Two validation dataloaders."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log(f"val_loss_{dataloader_idx}", self.loss(batch), add_dataloader_idx=False)


class SkippingMoE(Classifier):
    """Top-1 mixture of experts that skips the experts no sample chose: each rank runs the experts its
    own batch routes to, so the ranks run different modules in the same step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.gate = nn.Linear(16, 4)
        self.experts = nn.ModuleList(mlp(16, 16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        probs = self.gate(h).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(h[rows]) * probs[rows, e:e + 1])
        if self.training:
            self.log("routing", float(sum(2 ** e for e in choice.unique().tolist())))
        return self.head(h + out)


def _check_ranks_route_differently(results: list[dict]) -> None:
    routes = [[m["routing"] for m in r["step_metrics"]] for r in results]
    assert any(len(set(map(repr, step))) > 1 for step in zip(*routes)), routes


class InplaceResNet(Classifier):
    """Residual blocks with in-place activations and adds (torchvision's ResNet style): in-place ops
    on the outputs of modules that hold parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            out = block(h)
            out += h
            h = F.relu_(out)
        return self.head(h.mean(dim=(2, 3)))


class _ReverseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -0.5 * grad


class DomainAdversarial(Classifier):
    """A custom autograd.Function (gradient reversal, DANN) between a feature net and a domain head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = mlp(8, 16, 16)
        self.label = nn.Linear(16, 4)
        self.domain = mlp(16, 8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.label(torch.relu(self.features(x)))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        h = torch.relu(self.features(x))
        domain = (x[:, 0] > 0).long()
        return F.cross_entropy(self.label(h), y) + F.cross_entropy(self.domain(_ReverseGrad.apply(h)), domain)


class Contrastive(Classifier):
    """SimCLR-style: embeddings gathered from every rank with gradients (self.all_gather(sync_grads=True))."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 8)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        a = F.normalize(self.net(x), dim=-1)
        b = F.normalize(self.net(x + 0.1 * torch.sin(x)), dim=-1)
        everyone = self.all_gather(b, sync_grads=True).reshape(-1, b.shape[-1])
        logits = a @ everyone.t() / 0.5
        target = torch.arange(a.shape[0]) + self.global_rank * a.shape[0]
        loss = F.cross_entropy(logits, target)
        self.log("train_loss", loss)
        return loss


class PackedLSTM(Classifier):
    """Variable-length sequences through pack_padded_sequence (lengths from the data, on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = (x.abs().sum(-1) > 0).sum(-1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.rnn(packed)
        return self.head(h[-1])


def _padded_seq_data() -> dict[str, DataLoader]:
    def padded(seed: int) -> TensorDataset:
        x, y = seq_set(seed=seed).tensors
        keep = torch.arange(x.shape[1]) < torch.randint(1, x.shape[1] + 1, (x.shape[0], 1), generator=_g(seed + 7))
        return TensorDataset(x * keep.unsqueeze(-1), y)

    return dict(train=loader(padded(0)), val=loader(padded(1)))


class SequentialCheckpointed(Classifier):
    """torch.utils.checkpoint.checkpoint_sequential over a deep Sequential (two segments)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                                 nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.net(x)
        return torch.utils.checkpoint.checkpoint_sequential(self.net, 2, x.requires_grad_(), use_reentrant=False)


class Reloadable(Classifier):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = mlp(8, width, 4)


def fit_then_load_from_checkpoint(ctx: Any) -> None:
    """ModelCheckpoint(save_last=True) during fit; then, on every rank, the class's load_from_checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=str(ctx.root / "ckpt"), save_last=True)
    ctx.trainer(callbacks=[checkpoint], enable_checkpointing=True).fit(ctx.model, ctx.data["train"])
    loaded = type(ctx.model).load_from_checkpoint(checkpoint.last_model_path)
    ctx.extras["loaded"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    ctx.extras["width"] = loaded.hparams.width


def _multi_val_data() -> dict[str, Any]:
    return dict(train=loader(cls_set(seed=0)), val=[loader(cls_set(seed=1)), loader(cls_set(seed=2))])


class WithLion(Classifier):
    """An optimizer torch does not ship (Lion), declared element-wise, with weight decay."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def configure_optimizers(self) -> Any:
        return Lion(self.parameters(), lr=1e-2, weight_decay=0.1)


class OneCycle(Classifier):
    """OneCycleLR cycling AdamW's betas per step, or ReduceLROnPlateau on a loss averaged over ranks."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = mlp(8, 16, 4)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.kind == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=8, base_momentum=0.5,
                                                        max_momentum=0.95)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.1)  # any world size
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "mean_loss", "interval": "step"}}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("mean_loss", loss, sync_dist=True)  # the plateau decision must agree across ranks
        return loss


class BuiltInSetup(Classifier):
    """The head is built in ``setup`` (its size known from the data only then)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(8, 16)
        self.head: Optional[nn.Module] = None

    def setup(self, stage: str) -> None:
        if self.head is None:
            self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


class LayerDrop(Classifier):
    """Stochastic depth decided from the step number (the same on every rank): the layers run change per step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        g = torch.Generator().manual_seed(self.global_step if self.training else 0)
        keep = torch.rand(len(self.blocks), generator=g) > 0.5
        for block, k in zip(self.blocks, keep.tolist()):
            if k or not self.training:
                h = h + torch.tanh(block(h))
        return self.head(h)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)  # a skipped block's zero or None gradient: same update


class CTCModel(LossSteps):
    """A GRU over frames and a per-frame classifier trained with CTC (``aten._ctc_loss`` has no fake
    kernel: its output shape depends on the lengths)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def loss(self, batch: Any) -> torch.Tensor:
        x, targets, frame_lengths, target_lengths = batch
        log_probs = self.head(self.rnn(x)[0]).log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(log_probs, targets, frame_lengths, target_lengths)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class FunctionalCall(Classifier):
    """torch.func.functional_call over the module's own parameters plus a perturbation (MAML-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        params = {k: v * 1.01 for k, v in self.net.named_parameters()}
        out = torch.func.functional_call(self.net, params, (x,))
        return F.cross_entropy(out, y)


# ---------------------------------------------------------------------------------------------------------------------
# the catalog


def _hf(kind: str, dropout: bool = False, ckpt: bool = False, in_configure_model: bool = False,
        compile_blocks: bool = False, lora: bool = False) -> Callable[[], L.LightningModule]:
    return lambda: HFModel(kind, dropout, ckpt, in_configure_model, compile_blocks, lora)


def _ema_extras(cbs: list[Callback]) -> dict:
    return {"ema": cbs[0].ema}


def _norm_extras(cbs: list[Callback]) -> dict:
    return {"weight_norms": cbs[0].history}


def _dict_data() -> dict[str, DataLoader]:
    return dict(train=loader(DictDataset(0)), val=loader(DictDataset(1)))


def _tuple_data() -> dict[str, DataLoader]:
    return dict(train=loader(NestedTupleDataset(0)), val=loader(NestedTupleDataset(1)))


def _shuffled_cls_data() -> dict[str, DataLoader]:
    return dict(train=loader(cls_set(seed=0), shuffle=True), val=loader(cls_set(seed=1)))


def _eval_data(role: str, make: Callable[..., TensorDataset]) -> Callable[[], dict[str, DataLoader]]:
    return lambda: {role: loader(make(seed=2)), "val": loader(make(seed=1))}


DEEPSEEK_V3_ADAMW = Tol(weight_atol=1.2e-4, why=(
    "AdamW's first step moves an element by lr*g/(|g|+eps) (there m_hat = g, sqrt(v_hat) = |g|), whose slope in g "
    "is eps/(|g|+eps)^2: where a first gradient lies within a few eps of zero, a rounding difference d in it moves "
    "the weight by lr*eps*d/(|g|+eps)^2, and the difference stays (later steps divide by a root mean square that "
    "holds larger gradients). What rounds differently: Elixir's hooks put an identity node on the input of every "
    "module with parameters, so at an RMSNorm input the norm's two gradient contributions (pow and mul) are added "
    "together before the residual branch's, not in autograd's arrival order; from layer 1's attention down, "
    "gradients differ in the last bits (the MoE routing and every layer-1 MLP gradient are bitwise DDP's). A Linear "
    "weight's gradient adds K = 64 token terms per rank; with S the sum of their magnitudes, two orders differ by "
    "about sqrt(K)*u*S (u = 2^-24; measured at most 4.3 u*S, Elixir against DDP, over every Linear weight element "
    "under AVX-512, AVX2 and SSE kernels and with each batch's samples reversed). lr*eps/(|g|+eps)^2 * sqrt(K)*u*S "
    "over the Linear weights of this case's first step is largest at layer 0's mlp.gate_proj[47, 20] (g = 2.7e-8 = "
    "2.7 eps, S = 3.4e-3, lr = 1e-2, eps = 1e-8): 1.2e-4, the elementwise floor. A wrong update or a flipped routing "
    "decision moves weights by a step (lr = 1e-2); losses and the relative tolerance stay 1e-5."))


CASES: list[Case] = [
    # architectures
    Case("sequential_mlp", SequentialMLP, cls_data),
    Case("sequential_mlp_shuffled", SequentialMLP, _shuffled_cls_data),
    Case("mha_self_attention", lambda: MHAModel("self"), seq_data),
    Case("mha_padding_mask_weights", lambda: MHAModel("padding"), seq_data),
    Case("mha_cross_kdim_vdim", lambda: MHAModel("cross"), seq_data),
    Case("transformer_encoder_layer", EncoderLayerModel, seq_data, run=fit_then_validate),
    Case("transformer_encoder_stack", lambda: EncoderLayerModel(stack=True), seq_data, run=fit_then_validate),
    Case("transformer_decoder_layer", DecoderLayerModel, token_data),
    Case("lstm", lambda: RNNModel("lstm"), seq_data),
    Case("gru_bidirectional", lambda: RNNModel("gru"), seq_data),
    Case("cnn_batchnorm", CNN, image_data, run=fit_then_validate, ddp_check=_check_ranks_differ_in_bn_stats),
    Case("cnn_groupnorm", lambda: CNN("group"), image_data),
    Case("batchnorm_mlp_eval_per_rank", BatchNormMLP, cls_data, run=fit_then_validate,
         ddp_check=_check_ranks_differ_in_bn_stats),
    Case("layernorm_mlp", lambda: NormMLP("layer"), cls_data),
    Case("rmsnorm_mlp", lambda: NormMLP("rms"), cls_data),
    Case("tied_embedding_functional_head", TiedLM, token_data),
    Case("tied_embedding_shared_parameter", lambda: TiedLM("shared"), token_data),
    Case("weight_used_outside_module", WeightOutsideModule, cls_data),
    Case("parameters_on_root_module", RootParameters, cls_data),
    Case("vmap_ensemble_stacked_parameter_list", VmapEnsemble, cls_data),
    Case("vmap_ensemble_in_training_step", VmapEnsembleInStep, cls_data,
         private=("stacked.0", "stacked.1", "stacked.2", "stacked.3")),
    Case("shared_module_called_twice", SharedTwice, cls_data),
    Case("frozen_submodule", FrozenBackbone, cls_data),
    Case("frozen_batchnorm_backbone_in_eval", FrozenBNBackbone, image_data),
    Case("unused_branch_on_some_steps", UnusedBranch, cls_data, ddp=dict(find_unused_parameters=True),
         ddp_check=_check_unused_steps),
    Case("activation_checkpointing", Checkpointed, cls_data),
    Case("buffer_updated_in_forward", BufferUpdater, cls_data),
    Case("dropout", DropoutMLP, cls_data),
    Case("tiny_gpt_adamw", TinyGPT, token_data),
    # batches and training_step idioms
    Case("dict_batch_with_strings", DictBatch, _dict_data),
    Case("nested_tuple_batch_bool_mask", NestedTupleBatch, _tuple_data),
    Case("item_float_isnan_tolist", HostSyncs, cls_data),
    Case("bool_mask_and_nonzero", MasksAndNonzero, cls_data),
    Case("torchmetrics_logged", WithTorchmetrics, cls_data),
    Case("losses_kept_in_list", LossHistory, cls_data),
    Case("l2_penalty_over_parameters", L2Penalty, cls_data),
    # optimization
    Case("manual_optimization", ManualOptimization, cls_data, ddp_check=_check_lrs_change),
    Case("manual_gan_two_optimizers", GAN, cls_data, ddp=dict(find_unused_parameters=True)),
    Case("manual_gan_toggled_zeroed_after_each_step", lambda: GAN(zero_after_step=True), cls_data,
         ddp=dict(find_unused_parameters=True)),
    Case("manual_gan_discriminator_accumulating_across_generator_steps", lambda: GAN(zero_after_step=True, d_every=2),
         cls_data, ddp=dict(find_unused_parameters=True)),
    Case("manual_gan_toggled_generator_clipped", lambda: GAN(clip=0.05), cls_data, ddp=dict(find_unused_parameters=True)),
    Case("two_optimizers_each_zeroing_after_its_step", ZeroedByEach, cls_data, ddp=dict(find_unused_parameters=True)),
    Case("grad_norm_logged", GradNormLogging, cls_data),
    Case("manual_clip_grad_norm", ManualClip, cls_data, ddp_check=_check_clipping_needed),
    Case("grads_assigned_before_the_step", AssignedGrads, cls_data),
    Case("zeroth_order_grads_assigned_without_backward", ZerothOrderGrads, cls_data),
    Case("fit_after_failed_stages", FailingValidation, cls_data, run=after_failed_stages),
    Case("tied_embedding_renormed_before_optimizer_step", lambda: TiedRenorm("before_step"), token_data),
    Case("tied_embedding_renormed_at_step_start", lambda: TiedRenorm("step_start"), token_data),
    Case("weight_decayed_by_hand_in_training_step", DecayedInStep, cls_data),
    Case("weights_clipped_after_the_step_in_optimizer_step", lambda: ConstrainedAfterStep("optimizer_step"), cls_data),
    Case("weight_norm_logged_in_on_before_zero_grad", lambda: ConstrainedAfterStep("norm_before_zero_grad"), cls_data),
    Case("weight_norm_logged_in_on_before_backward_accumulating", lambda: ConstrainedAfterStep("norm_before_backward"),
         cls_data, trainer=dict(accumulate_grad_batches=2)),
    Case("weight_clamped_in_its_forward", lambda: WrittenInForward(ClampedLinear), cls_data),
    Case("weight_masked_in_its_forward", lambda: WrittenInForward(MaskedLinear), cls_data),
    Case("weight_data_assigned_in_its_forward_max_norm", lambda: WrittenInForward(LinearWithConstraint), cls_data),
    Case("frozen_integer_index_parameter", FrozenIndexTable, cls_data),
    Case("frozen_bf16_parameter_in_its_dtype", FrozenBf16Table, cls_data),
    Case("trainable_bf16_layer_in_its_dtype", TrainableBf16Layer, cls_data),
    Case("float64_layer", Float64Layer, cls_data),
    Case("complex_parameter", ComplexLayer, cls_data, ddp=_COMPLEX_DDP),
    Case("data_assigned_in_configure_model", DataSwappedInConfigureModel, cls_data),
    Case("metric_mask_and_example_input_built_in_configure_model", StateBuiltInConfigureModel, cls_data,
         trainer=dict(enable_model_summary=True)),
    Case("hf_llama_resized_embeddings_configure_model", lambda: HFResized("llama", True, True), token_data,
         requires="transformers", tol=ADAM_NEAR_ZERO),
    Case("hf_gpt2_resized_tied_embeddings_configure_model", lambda: HFResized("gpt2", True, False), token_data,
         requires="transformers"),
    Case("hf_llama_generate_in_predict_without_fit", lambda: HFGenerating("llama"),
         lambda: dict(predict=loader(token_set(seed=2))), run=predict_only, requires="transformers", trains=False),
    Case("predict_with_uneven_batches_per_rank", lambda: EncoderLayerModel(stack=True),
         lambda: dict(predict=loader(seq_set(n=9))),
         run=predict_only, trains=False),
    Case("param_group_added_at_epoch_1", HeadThenBackbone, cls_data, trainer=dict(max_epochs=2),
         run=fit_with(AddBackboneGroup)),
    Case("projected_task_grads_from_autograd_grad", ProjectedTaskGrads, cls_data),
    Case("data_rebound_in_gathered_params", SequentialMLP, cls_data, run=fit_with(ReprojectData)),
    Case("clip_norm_of_a_head_only_optimizer", HeadOnlyOptimizer, cls_data, trainer=dict(gradient_clip_val=0.05)),
    Case("manual_clip_each_optimizer_apart", ClipEach, cls_data),
    # the gradient norm of these steps is 0.46-0.79 and max |grad| 0.14-0.43 (checked once): both always clip
    Case("trainer_gradient_clip_norm", SequentialMLP, cls_data, trainer=dict(gradient_clip_val=0.05)),
    Case("trainer_gradient_clip_value", SequentialMLP, cls_data,
         trainer=dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")),
    # DDP sums micro-batch gradients locally and all-reduces once; ZeRO reduce-scatters every micro-batch.
    # With two ranks and SGD the orders differ by at most 4e-9 in the weights after these two steps (measured by
    # emulating both summation orders in one process), far inside the default tolerance: no looser one needed.
    Case("gradient_accumulation", SequentialMLP, cls_data, trainer=dict(accumulate_grad_batches=2)),
    Case("sgd_nesterov_groups_steplr", lambda: WithOptimizer("sgd"), cls_data, ddp_check=_check_lrs_change),
    Case("adam_module_groups_exponentiallr", lambda: WithOptimizer("adam"), lambda: cls_data(n=16),
         trainer=dict(max_epochs=2), ddp_check=_check_lrs_change),
    Case("adamw_decay_groups_cosine", lambda: WithOptimizer("adamw"), cls_data, ddp_check=_check_lrs_change),
    Case("rmsprop_groups_lambdalr", lambda: WithOptimizer("rmsprop"), cls_data, ddp_check=_check_lrs_change),
    Case("adagrad_state_from_its_constructor", lambda: WithOptimizer("adagrad"), cls_data, ddp_check=_check_lrs_change),
    Case("adafactor_groups_steplr", lambda: WithOptimizer("adafactor"), cls_data, ddp_check=_check_lrs_change),
    Case("hf_adafactor_relative_steps", lambda: WithOptimizer("hf_adafactor"), cls_data),
    Case("per_parameter_trust_ratio_steplr", lambda: WithOptimizer("trust_ratio"), cls_data, ddp_check=_check_lrs_change),
    Case("configure_optimizers_returns_none", NoOptimizer, cls_data, trains=False),
    Case("meta_init_configure_model", MetaInit, cls_data),
    # callbacks
    Case("ema_callback", SequentialMLP, cls_data, run=fit_with(EMA, keep=_ema_extras)),
    Case("momentum_teacher_in_batch_end", MomentumTeacher, cls_data),
    Case("weight_norm_callback", SequentialMLP, cls_data, run=fit_with(WeightNormLogger, keep=_norm_extras)),
    # entry points
    Case("validate_without_fit", lambda: NormMLP("layer"), _eval_data("val", cls_set), run=validate_only, trains=False),
    Case("test_without_fit", CNN, _eval_data("test", image_set), run=run_test_only, trains=False),
    Case("predict_without_fit", lambda: EncoderLayerModel(stack=True), _eval_data("predict", seq_set),
         run=predict_only, trains=False),
    Case("second_trainer_after_fit", SequentialMLP, cls_data, run=second_trainer),
    Case("module_state_dict_after_fit", lambda: TiedLM("shared"), token_data, run=state_dict_after_fit),
    Case("forward_on_one_rank_after_fit", SequentialMLP, cls_data, run=forward_one_rank_after_fit),
    Case("save_checkpoint_after_fit", lambda: WithOptimizer("adamw"), cls_data, run=save_checkpoint_after_fit),
    # Hugging Face transformers
    Case("hf_gpt2", _hf("gpt2"), token_data, requires="transformers"),
    Case("hf_gpt2_dropout", _hf("gpt2", dropout=True), token_data, requires="transformers"),
    Case("hf_llama", _hf("llama"), token_data, requires="transformers", tol=ADAM_NEAR_ZERO),
    Case("hf_bert_mlm", _hf("bert"), token_data, requires="transformers"),
    Case("hf_mixtral_moe", _hf("mixtral"), token_data, requires="transformers", tol=ADAM_NEAR_ZERO),
    *(Case(f"hf_{kind}", _hf(kind), token_data, requires="transformers",
           tol=DEEPSEEK_V3_ADAMW if kind == "deepseek_v3" else ADAM_NEAR_ZERO) for kind in _MORE_HF),
    # bf16-mixed
    Case("bf16_tiny_gpt", lambda: TinyGPT(optimizer="sgd"), token_data, trainer=dict(precision="bf16-mixed"), tol=BF16),
    Case("bf16_hf_llama_lora", _hf("llama", lora=True), token_data, requires="peft", trainer=dict(precision="bf16-mixed"),
         tol=BF16),
    Case("bf16_hf_qwen3_moe", _hf("qwen3_moe"), token_data, requires="transformers", trainer=dict(precision="bf16-mixed"),
         tol=BF16),
    # torch.compile ([Note: compiled models] in runtime/hotpath.py)
    Case("compiled_blocks_gpt", lambda: CompiledGPT("blocks"), token_data),
    Case("compiled_forward_gpt", lambda: CompiledGPT("forward"), token_data),
    Case("bf16_mlp", SequentialMLP, cls_data, trainer=dict(precision="bf16-mixed"), tol=BF16),
    Case("bf16_cnn_batchnorm", CNN, image_data, trainer=dict(precision="bf16-mixed"), tol=BF16,
         run=fit_then_validate),
    # more architectures and idioms
    Case("weight_norm_parametrization", WeightNormParam, cls_data),
    Case("sparse_embedding_gradients", SparseEmb, token_data),
    Case("forward_hook_features_in_loss", FeatureHook, cls_data),
    Case("model_called_twice_per_step", TwoViews, cls_data),
    Case("gradient_penalty_create_graph", GradPenalty, cls_data),
    Case("manual_two_backwards_one_step", TwoBackwards, cls_data),
    Case("manual_accumulation_every_second_batch", ManualAccum, cls_data),
    Case("adamw_fused", lambda: FusedAdamW("fused"), cls_data),
    Case("adamw_foreach", lambda: FusedAdamW("foreach"), cls_data),
    Case("parameter_list_dict_and_empty", ParamContainers, cls_data),
    Case("submodule_eval_in_training_step", SubmoduleEvalInStep, cls_data),
    Case("frozen_teacher_under_no_grad", TeacherStudent, cls_data),
    Case("accumulation_with_norm_clipping", SequentialMLP, cls_data,
         trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05)),
    Case("bf16_true_mlp", SequentialMLP, cls_data, trainer=dict(precision="bf16-true"), tol=BF16_TRUE),
    Case("unused_branch_adamw", UnusedAdamW, cls_data, ddp=dict(find_unused_parameters=True)),
    Case("frozen_mid_training", ToggleModel, cls_data, run=fit_with(FreezeAtBatch2),
         ddp=dict(find_unused_parameters=True)),
    Case("activation_checkpointing_reentrant", ReentrantCheckpointed, cls_data),
    Case("integer_bf16_and_non_contiguous_parameters", OddParameters, cls_data),
    Case("model_summary_enabled", SequentialMLP, cls_data, trainer=dict(enable_model_summary=True)),
    Case("val_check_interval_mid_epoch", SequentialMLP, cls_data, trainer=dict(val_check_interval=2, max_epochs=2)),
    Case("lr_finder_then_fit", WithLR, cls_data, run=lr_find_then_fit),
    Case("hook_based_spectral_and_weight_norm", HookNormalized, cls_data),
    Case("full_backward_hook", FullBackwardHook, cls_data),
    Case("all_gather_and_sync_dist_in_step", AllGatherInStep, cls_data),
    Case("accumulation_uneven_epoch_end", SequentialMLP, lambda: cls_data(n=24), trainer=dict(accumulate_grad_batches=2)),
    Case("fp16_mixed_mlp", SequentialMLP, cls_data, trainer=dict(precision="16-mixed")),
    Case("hf_gpt2_gradient_checkpointing", _hf("gpt2", ckpt=True), token_data, requires="transformers"),
    # built in configure_model: on the meta device under Elixir, materialised with DDP's initial weights
    Case("hf_llama_configure_model", _hf("llama", in_configure_model=True), token_data, requires="transformers",
         tol=ADAM_NEAR_ZERO),
    Case("hf_gpt2_configure_model", _hf("gpt2", in_configure_model=True), token_data, requires="transformers"),
    Case("hf_llama_compiled_blocks_configure_model", _hf("llama", in_configure_model=True, compile_blocks=True),
         token_data, requires="transformers", tol=ADAM_NEAR_ZERO),
    # Switch Transformers: expert modules of their own, a router that converts itself inside forward
    # PEFT's LoRA: the adapters only train (plain, under gradient checkpointing, built in configure_model)
    *(Case(f"hf_{kind}_lora{suffix}", _hf(kind, lora=True, **flags), token_data, requires="peft", tol=ADAM_NEAR_ZERO,
           ddp_check=None if flags.get("in_configure_model") else _check_only_adapters_train)  # no weights before
      for kind, suffix, flags in (("gpt2", "", {}), ("llama", "", {}), ("llama", "_gradient_checkpointing", {"ckpt": True}),
                                  ("llama", "_configure_model", {"in_configure_model": True}))),
    Case("hf_llama_dora_configure_model", lambda: HFPeftVariant("dora"), token_data, requires="peft",
         tol=ADAM_NEAR_ZERO),
    Case("hf_llama_adalora_rank_allocation", lambda: HFPeftVariant("adalora"), token_data, requires="peft",
         tol=ADAM_NEAR_ZERO),
    *(Case(f"hf_{kind}", lambda kind=kind: HFVision(kind), image_data, requires="transformers", tol=ADAM_NEAR_ZERO)
      for kind in _HF_VISION),
    Case("hf_switch_moe", _hf("switch"), token_data, requires="transformers", ddp=dict(find_unused_parameters=True)),
    Case("sharpness_aware_minimization", SAM, cls_data),
    Case("same_network_under_no_grad_and_grad", SelfTarget, cls_data),
    Case("gradient_norm_penalty_on_parameters", ParamGradPenalty, cls_data),
    Case("retain_graph_two_backwards", RetainGraph, cls_data),
    Case("one_layer_under_two_names", TwoNames, cls_data),
    Case("training_step_returns_a_dict", DictReturn, cls_data),
    Case("parameter_used_only_in_validation", ValOnlyParam, cls_data, ddp=dict(find_unused_parameters=True),
         run=fit_then_validate),
    Case("two_validation_dataloaders", MultiVal, _multi_val_data),
    Case("declared_elementwise_optimizer_lion", WithLion, cls_data),
    Case("moe_skipping_unchosen_experts_per_rank", SkippingMoE, cls_data, run=fit_then_validate,
         ddp=dict(find_unused_parameters=True), ddp_check=_check_ranks_route_differently),
    Case("detect_anomaly", SequentialMLP, cls_data, trainer=dict(detect_anomaly=True)),
    Case("pruning_in_gathered_params", SequentialMLP, cls_data, trainer=dict(max_epochs=2), run=fit_with(Prune)),
    Case("gradient_accumulation_scheduler", SequentialMLP, cls_data, trainer=dict(max_epochs=2),
         run=fit_with(lambda: GradientAccumulationScheduler({0: 1, 1: 2}))),
    Case("inplace_residual_cnn", InplaceResNet, image_data, run=fit_then_validate),
    Case("custom_autograd_function_gradient_reversal", DomainAdversarial, cls_data),
    Case("contrastive_all_gather_sync_grads", Contrastive, cls_data),
    Case("packed_variable_length_lstm", PackedLSTM, _padded_seq_data, run=fit_then_validate),
    Case("checkpoint_sequential", SequentialCheckpointed, cls_data),
    Case("load_from_checkpoint_after_fit", Reloadable, cls_data, run=fit_then_load_from_checkpoint),
    Case("onecycle_cycling_betas", lambda: OneCycle("onecycle"), cls_data),
    Case("reduce_lr_on_plateau", lambda: OneCycle("plateau"), cls_data, ddp_check=_check_lrs_change),
    Case("layers_built_in_setup", BuiltInSetup, cls_data),
    Case("layerdrop_by_step", LayerDrop, cls_data, ddp=dict(find_unused_parameters=True)),
    Case("functional_call_over_own_parameters", FunctionalCall, cls_data),
    Case("ctc_loss_recognizer", CTCModel, lambda: dict(train=loader(ctc_set(seed=0)), val=loader(ctc_set(seed=1)))),
    # Lightning's weight averaging: the average held sharded, swapped in for validation, copied in at the end
    Case("lightning_ema_weight_averaging", BatchNormMLP, cls_data, trainer=dict(max_epochs=2),
         run=fit_with(lambda: EMAWeightAveraging(decay=0.7))),
    Case("lightning_ema_without_buffers_every_2_steps", SequentialMLP, cls_data, trainer=dict(max_epochs=2),
         run=fit_with(lambda: EMAWeightAveraging(decay=0.5, use_buffers=False, update_every_n_steps=2))),
    Case("lightning_stochastic_weight_averaging", SequentialMLP, cls_data, trainer=dict(max_epochs=3),
         run=fit_with(lambda: StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1))),
    Case("lightning_swa_with_batchnorm_update", BatchNormMLP, cls_data, trainer=dict(max_epochs=3),
         run=fit_with(lambda: StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1))),
    Case("fp16_true_mlp", SequentialMLP, cls_data, trainer=dict(precision="16-true"), tol=BF16_TRUE),
    Case("fp64_true_mlp", SequentialMLP, cls_data, trainer=dict(precision="64-true")),
]


# ---------------------------------------------------------------------------------------------------------------------
# Loops, stopping and the data pipeline


class _Uint8Images(Dataset):
    """uint8 images (0..255) and labels: the module converts them in on_after_batch_transfer."""

    def __init__(self, seed: int) -> None:
        g = _g(seed)
        self.x = torch.randint(0, 256, (32, 3, 8, 8), generator=g, dtype=torch.uint8)
        self.y = torch.randint(0, 4, (32,), generator=g)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> Any:
        return {"pixels": self.x[i], "label": self.y[i]}


class TransferHooks(Classifier):
    """on_before_batch_transfer (dict -> tuple) and on_after_batch_transfer (uint8 -> normalised float)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(8, 4))

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch["pixels"], batch["label"]

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return (x.float() / 255.0 - 0.5) / 0.25, y


def _uint8_data() -> dict[str, DataLoader]:
    return dict(train=loader(_Uint8Images(0)), val=loader(_Uint8Images(1)))


@dataclass
class _Sample:
    x: torch.Tensor
    y: torch.Tensor


class _DataclassSet(Dataset):
    def __init__(self, seed: int) -> None:
        self.base = cls_set(seed=seed)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        x, y = self.base[i]
        return _Sample(x, y)


def _collate_dataclass(items: list) -> _Sample:
    return _Sample(torch.stack([s.x for s in items]), torch.stack([s.y for s in items]))


class _Wrapped:
    """A batch type Lightning cannot move: the module's transfer_batch_to_device does."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.payload = {"x": x, "y": y}


def _collate_wrapped(items: list) -> _Wrapped:
    return _Wrapped(torch.stack([s.x for s in items]), torch.stack([s.y for s in items]))


class DataclassBatch(Classifier):
    def __init__(self, wrapped: bool = False) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)
        self.wrapped = wrapped

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, _Wrapped):
            return (batch.payload["x"].to(device), batch.payload["y"].to(device))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def loss(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, _Sample):
            return F.cross_entropy(self(batch.x), batch.y)
        x, y = batch
        return F.cross_entropy(self(x), y)


def _dataclass_data(wrapped: bool = False) -> Callable[[], dict[str, DataLoader]]:
    collate = _collate_wrapped if wrapped else _collate_dataclass
    return lambda: dict(train=loader(_DataclassSet(0), collate_fn=collate), val=loader(_DataclassSet(1), collate_fn=collate))


class _Stream(torch.utils.data.IterableDataset):
    """An iterable dataset, split by rank by hand."""

    def __init__(self, seed: int, n: int = 32) -> None:
        self.base = cls_set(n=n, seed=seed)

    def __iter__(self) -> Any:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        for i in range(rank, len(self.base), world):
            yield self.base[i]


class _OneShotStream(torch.utils.data.IterableDataset):
    """A stream that can be read once (a queue, a socket, a generator handed in): every iterator continues it."""

    def __init__(self, seed: int, n: int = 32) -> None:
        self.base = cls_set(n=n, seed=seed)
        self.it: Any = None

    def __iter__(self) -> Any:
        import torch.distributed as dist

        if self.it is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            self.it = (self.base[i] for i in range(rank, len(self.base), world))
        return self.it


def _stream_data(one_shot: bool = False) -> Callable[[], dict[str, DataLoader]]:
    make = _OneShotStream if one_shot else _Stream
    return lambda: dict(train=loader(make(0)), val=loader(_Stream(1)))


def _generator_data() -> dict[str, Any]:
    """A generator of this rank's batches handed to fit (Lightning takes any iterable): it can be read once."""
    import torch.distributed as dist

    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    batches = list(loader(cls_set(seed=0)))
    batches = batches[:len(batches) // world_size * world_size][rank::world_size]  # as many on every rank
    return dict(train=(b for b in batches), val=loader(cls_set(seed=1)))


class TwoTrainLoaders(Classifier):
    """Several training dataloaders, as a dict (CombinedLoader modes) or a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def training_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        if isinstance(batch, dict):
            parts = [self.loss(b) for b in batch.values() if b is not None]
            loss = sum(parts) / len(parts)
        else:
            loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss


def _combined_data(mode: str) -> Callable[[], dict[str, Any]]:
    from lightning.pytorch.utilities import CombinedLoader

    def make() -> dict[str, Any]:
        train = {"a": loader(cls_set(seed=0)), "b": loader(cls_set(n=16, seed=3))}
        return dict(train=CombinedLoader(train, mode=mode), val=loader(cls_set(seed=1)))

    return make


def traced(run: Callable[[Any], None]) -> Callable[[Any], None]:
    """``run``, then whether plan="auto" traced the step rather than falling back (True under DDP and
    explicit plans): a plan searched for another batch than the step's would be sized wrongly."""

    def wrapped(ctx: Any) -> None:
        run(ctx)
        ctx.extras["traced"] = [getattr(getattr(t.strategy, "planning", None), "fallback_reason", None) is None
                                for t in ctx.trainers]

    return wrapped


def backward_before_fit(ctx: Any) -> None:
    """A backward of the user's own before fit (a look at the loss) leaves gradients in the parameters' ``.grad``,
    as the last step of a fit under another strategy does: the first ``zero_grad`` drops them (automatic
    optimization), and a first step before any ``zero_grad`` adds them (manual, zeroing after its step)."""
    x, y = next(iter(ctx.data["val"]))
    F.cross_entropy(ctx.model(x), y).backward()
    fit(ctx)


def fit_twice_raising_max_epochs(ctx: Any) -> None:
    trainer = ctx.trainer(max_epochs=1)
    trainer.fit(ctx.model, ctx.data["train"], ctx.data["val"])
    trainer.fit_loop.max_epochs = 2
    trainer.fit(ctx.model, ctx.data["train"], ctx.data["val"])


def fit_validate_test_predict(ctx: Any) -> None:
    trainer = ctx.trainer()
    trainer.fit(ctx.model, ctx.data["train"], ctx.data["val"])
    ctx.extras["validate"] = trainer.validate(ctx.model, ctx.data["val"], verbose=False)
    ctx.extras["test"] = trainer.test(ctx.model, ctx.data["val"], verbose=False)
    out = trainer.predict(ctx.model, ctx.data["val"])
    ctx.extras["predictions"] = torch.cat([o.detach().float() for o in out])


def resume_from_last(ctx: Any) -> None:
    """ModelCheckpoint(save_last=True, every 1 step, top 2 by train_loss); a second Trainer resumes from "last"."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    dirpath = str(ctx.root.parent / "ckpt")  # one directory for every rank
    cb = ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=1, save_top_k=2, monitor="train_loss")
    ctx.trainer(callbacks=[cb], enable_checkpointing=True, max_steps=3).fit(ctx.model, ctx.data["train"])
    ctx.extras["best_k"] = sorted(float(v) for v in cb.best_k_models.values())
    cb2 = ModelCheckpoint(dirpath=dirpath, save_last=True)
    ctx.trainer(callbacks=[cb2], enable_checkpointing=True, max_epochs=2).fit(
        ctx.model, ctx.data["train"], ckpt_path="last")


class SyncLogged(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)


def _early_stopping(on_train_epoch_end: bool) -> Callable[[], Callback]:
    from lightning.pytorch.callbacks import EarlyStopping

    monitor = "train_loss_epoch" if on_train_epoch_end else "val_loss"
    return lambda: EarlyStopping(monitor=monitor, patience=0, min_delta=10.0, check_on_train_epoch_end=on_train_epoch_end)


def _uneven_val_data() -> dict[str, Any]:
    """Validation from an iterable dataset split by rank: 33 samples, so rank 0 runs 5 batches and rank 1 4."""
    return dict(train=loader(cls_set(seed=0)), val=loader(_Stream(1, n=33)))


def fit_then_validate_uneven(ctx: Any) -> None:
    fit(ctx)
    ctx.extras["validate"] = ctx.trainers[-1].validate(ctx.model, ctx.data["val"], verbose=False)


CASES += [
    Case("uneven_validation_batches_per_rank", SequentialMLP, _uneven_val_data, run=fit_then_validate_uneven,
         trainer=dict(limit_val_batches=1.0)),
    Case("uneven_validation_batches_per_rank_sync_dist", SyncLogged, _uneven_val_data, run=fit_then_validate_uneven,
         trainer=dict(limit_val_batches=1.0)),
    Case("uneven_test_batches_per_rank", SequentialMLP, lambda: dict(test=loader(_Stream(2, n=33))),
         run=run_test_only, trains=False, trainer=dict(limit_test_batches=1.0)),
    Case("batch_transfer_hooks_uint8", TransferHooks, _uint8_data, run=traced(fit_validate_test_predict)),
    Case("dataclass_batch", DataclassBatch, _dataclass_data()),
    Case("transfer_batch_to_device_override", lambda: DataclassBatch(True), _dataclass_data(True), run=traced(fit)),
    Case("iterable_dataset", SequentialMLP, _stream_data()),
    Case("generator_as_train_data", SequentialMLP, _generator_data),
    Case("combined_max_size_cycle", TwoTrainLoaders, _combined_data("max_size_cycle")),
    Case("fit_twice_raising_max_epochs", SequentialMLP, cls_data, run=fit_twice_raising_max_epochs),
    Case("gradients_held_before_fit", SequentialMLP, cls_data, run=backward_before_fit),
    Case("gradients_held_before_fit_manual_step_first", ManualAccum, cls_data, run=backward_before_fit),
    Case("resume_from_last", lambda: WithOptimizer("adamw"), cls_data, run=resume_from_last),
    Case("early_stopping_validation_end", SyncLogged, cls_data, trainer=dict(max_epochs=4),
         run=fit_with(_early_stopping(False))),
]

BY_NAME: dict[str, Case] = {case.name: case for case in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"
