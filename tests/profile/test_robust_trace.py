"""profile_model on ordinary LightningModules: host reads, masks, metrics, user state, manual optimization, RNG."""

from __future__ import annotations

import random
from collections import deque

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_elixir.profile.fake import lightning_step
from lightning_elixir.profile.model import profile_model
from lightning_elixir.profile.types import ProfileError
from lightning_elixir.search import SearchOptions, search
from tests.search.profiles import hardware

CLASSES = 4


class Classifier(L.LightningModule):
    """A small classifier whose steps the tests below vary."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        return logits.argmax(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(CLASSES, (n,), generator=g)


def _fakes_in(root: object) -> list[str]:
    """Paths to fake tensors reachable from ``root`` through attributes and containers."""
    found, seen, work = [], set(), [("self", root)]
    while work:
        path, value = work.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, FakeTensor):
            found.append(path)
        elif isinstance(value, dict):
            work.extend((f"{path}[{k!r}]", v) for k, v in value.items())
        elif isinstance(value, (list, tuple, set, deque)):
            work.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.Tensor)):
            work.extend((f"{path}.{k}", v) for k, v in vars(value).items())
    return found


def _check(module: L.LightningModule, backward: bool = True, **kwargs):
    """Profile ``module``; check it recorded forward (and backward) and left no fake tensor behind."""
    before = {k: v for k, v in vars(module).items()}
    profile = profile_model(module, _batch(), backward=backward, **kwargs)
    phases = {a.phase for a in profile.accesses}
    assert "forward" in phases and ("backward" in phases) == backward
    assert not _fakes_in(module)
    assert vars(module).keys() == before.keys() and all(vars(module)[k] is v for k, v in before.items())
    return profile


class ReadsItem(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.threshold = torch.tensor(0.25)  # a real tensor: read for real

    def training_step(self, batch, batch_idx):
        assert self.threshold.item() == 0.25
        loss = self.loss(batch)
        self.log("loss", loss.item())
        self.log("loss_float", float(loss))
        assert f"{loss:.3f}" and math_ok(loss.item())
        return loss


def math_ok(value: float) -> bool:
    import math

    return math.isfinite(math.log(value) + 1 / value)


class SkipsNonFinite(Classifier):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if torch.isnan(loss) or torch.isinf(loss).any():
            return None  # would leave nothing to profile
        if not torch.isfinite(loss).all():
            raise RuntimeError("non-finite loss")
        if (loss != loss).item():
            return None
        return loss


class ReadsList(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        probabilities = logits.softmax(-1).detach().tolist()
        assert len(probabilities) == x.shape[0] and len(probabilities[0]) == CLASSES
        labels = y.cpu().numpy()
        assert labels.shape == (x.shape[0],)
        return F.cross_entropy(logits, y)


class MasksBatch(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        keep = y > 0  # e.g. an ignore label
        loss = F.cross_entropy(logits[keep], y[keep])
        rows = torch.nonzero(keep).squeeze(1)
        picked = torch.masked_select(logits, keep[:, None])
        return loss + logits[rows].mean() + picked.mean() + 0 * torch.unique(y).numel()


class UpdatesMetrics(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.accuracy = MulticlassAccuracy(num_classes=CLASSES)
        self.mean_loss = MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.accuracy.update(logits, y)
        self.log("acc", self.accuracy(logits, y))
        self.mean_loss.update(loss)
        return loss


class KeepsState(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []
        self.history = {"loss": []}
        self.window: deque = deque(maxlen=3)
        self.total = torch.zeros(())
        self.calls = 0

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss)
        self.history["loss"].append(loss.detach())
        self.history["last"] = loss
        self.window.append(loss)
        self.total += 1.0  # in place on a real tensor
        self.total.add_(loss.detach())
        self.calls += 1
        self.last_output = loss
        return loss


class ManualOne(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        assert opt.param_groups[0]["lr"] > 0
        opt.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()
        self.log("loss", loss.item())


class GAN(L.LightningModule):
    """Manual optimization with two optimizers and two forward/backward pairs per step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=2e-4),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-4))

    def training_step(self, batch, batch_idx):
        real, _ = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(real.shape[0], 4, device=real.device)
        self.toggle_optimizer(g_opt)
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(real.shape[0], 1))
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        with self.toggled_optimizer(d_opt):
            d_real = F.binary_cross_entropy_with_logits(self.discriminator(real), torch.ones(real.shape[0], 1))
            d_fake = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()),
                                                        torch.zeros(real.shape[0], 1))
            d_opt.zero_grad()
            self.manual_backward((d_real + d_fake) / 2)
            d_opt.step()
        self.log_dict({"g": g_loss.item(), "d": d_real.item()})


@pytest.mark.parametrize("module_class", [ReadsItem, SkipsNonFinite, ReadsList, MasksBatch, KeepsState, ManualOne])
def test_ordinary_training_steps_profile_and_leave_no_fake_tensor(module_class):
    module = module_class()
    real = {name: p.detach().clone() for name, p in module.named_parameters()}
    profile = _check(module)
    assert {p.name for p in profile.params} == set(real)
    assert all(torch.equal(p, real[name]) for name, p in module.named_parameters())
    assert module.training


def test_masks_select_every_element_for_the_activation_bound():
    everything = profile_model(MasksBatch(), _batch(64))
    nothing_masked = profile_model(Classifier(), _batch(64))
    assert everything.forward_peak_bytes > nothing_masked.forward_peak_bytes


def test_state_the_step_keeps_is_put_back():
    module = KeepsState()
    history, window = module.history, module.window
    _check(module)
    assert module.losses == [] and module.history is history and history == {"loss": []}
    assert len(window) == 0 and module.calls == 0 and not hasattr(module, "last_output")
    assert module.total.item() == 0.0


def test_metric_states_are_unchanged():
    module = UpdatesMetrics()
    module.mean_loss.update(torch.tensor(2.0))  # some real state before planning
    states = {name: {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in m.metric_state.items()}
              for name, m in (("accuracy", module.accuracy), ("mean", module.mean_loss))}
    counts = (module.accuracy._update_count, module.mean_loss._update_count)
    _check(module)
    for name, metric in (("accuracy", module.accuracy), ("mean", module.mean_loss)):
        for key, value in metric.metric_state.items():
            assert not isinstance(value, FakeTensor)
            assert torch.equal(value, states[name][key]), (name, key)
    assert (module.accuracy._update_count, module.mean_loss._update_count) == counts
    assert module.mean_loss.compute().item() == 2.0  # still usable, as before planning


def test_gan_with_two_optimizers_traces_both_forward_backward_pairs():
    module = GAN()
    profile = _check(module)
    phases = [a.phase for a in profile.accesses]
    pairs = sum(1 for before, now in zip(phases, phases[1:]) if before == "backward" and now == "forward")
    assert pairs == 1, phases  # generator step, then discriminator step
    forward_modules = [a.module for a in profile.accesses if a.phase == "forward"]
    assert forward_modules.count("discriminator.0") == 3  # on fake (G step), then on real and fake (D step)
    assert module.automatic_optimization is False


def test_manual_optimization_without_backward_is_explained():
    class NoBackward(ManualOne):
        def training_step(self, batch, batch_idx):
            self.optimizers().step()

    with pytest.raises(ProfileError, match="manual_backward"):
        profile_model(NoBackward(), _batch())


def test_forward_only_profile_plans():
    module = Classifier()
    module.eval()
    profile = _check(module, backward=False, step_fn=lightning_step("validation_step"))
    assert profile.backward_peak_bytes == 0 and profile.backward_compute_s == 0
    assert not module.training  # its mode is restored (validation runs it in eval mode)
    options = SearchOptions(world_size=2, micro_batches=1, allow_cpu=False, nvme_available=False)
    plan, report = search(profile, hardware(world_size=2), 1 << 30, options)
    assert plan.chunks and report.summary()


def test_forward_only_step_may_return_anything_and_read_values_on_the_host():
    class Predicts(Classifier):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            x, _ = batch
            return {"labels": self(x).argmax(-1).cpu().numpy(), "dataloader": dataloader_idx}

    profile = _check(Predicts(), backward=False, step_fn=lightning_step("predict_step", dataloader_idx=1))
    assert profile.accesses


def test_profiling_consumes_no_random_numbers():
    gan, classifier, batch = GAN(), Classifier(), _batch()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    state = torch.get_rng_state()
    profile_model(gan, batch)  # randn in the step
    profile_model(classifier, batch)  # dropout
    assert torch.equal(torch.get_rng_state(), state)
    after = (random.random(), np.random.rand())
    random.seed(0)
    np.random.seed(0)
    assert after == (random.random(), np.random.rand())


def test_a_failing_trace_still_restores_state_and_rng():
    class Fails(KeepsState):
        def training_step(self, batch, batch_idx):
            self.losses.append(self.loss(batch))
            torch.manual_seed(123)  # real effects on the global generators
            random.random()
            raise RuntimeError("user bug")

    module, batch = Fails(), _batch()
    state = torch.get_rng_state()
    python_state = random.getstate()
    with pytest.raises(RuntimeError, match="user bug"):
        profile_model(module, batch)
    assert module.losses == [] and not _fakes_in(module)
    assert torch.equal(torch.get_rng_state(), state) and random.getstate() == python_state


def test_assumed_values_read_finite_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_elixir.profile.assumed import AssumedValues, host_conversions

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        x, loss, labels = torch.empty(4, 3), torch.empty(()), torch.empty(5, dtype=torch.long)
        values = AssumedValues(mode)
        with values, host_conversions(values):
            assert not torch.isnan(loss) and not torch.isinf(x).any() and torch.isfinite(x).all()
            assert (~torch.isnan(loss)).item() and not (loss != loss).item() and (x == x).all()
            assert torch.isnan(x).sum().item() == 0 and not (loss == float("inf"))
            assert loss.item() == 1.0 and int(labels.sum()) == 1 and not (loss > 0)  # unknown: 1, 1.0, False
            assert x[x > 0].shape == (12,) and x[torch.isnan(x)].shape == (0,)  # all selected; known none
            assert torch.nonzero(labels).shape == (5, 1) and torch.masked_select(x, x > 0).shape == (12,)
            assert torch.unique(labels).shape == (1,) and torch.bincount(labels, minlength=7).shape == (7,)
            assert torch.tensor(7).item() == 7  # constants keep their value
            assert x.numpy().shape == (4, 3) and labels.tolist() == [1] * 5 and f"{loss:.2f}" == "1.00"


class Experts(Classifier):
    """Experts a top-1 gate chose; the rest are skipped, by a nonzero count or by a boolean read."""

    def __init__(self, test: str) -> None:
        super().__init__()
        self.test = test
        self.gate = nn.Linear(16, 3)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        choice = self.gate(h).argmax(-1)
        for e, expert in enumerate(self.experts):
            if self.test == "nonzero":
                rows = (choice == e).nonzero(as_tuple=True)[0]
                if rows.numel():
                    h = h.index_add(0, rows, expert(h[rows]))
            elif (choice == e).any():
                h = h + expert(h) * (choice == e).unsqueeze(-1)
        return self.head(h)


@pytest.mark.parametrize("test", ["nonzero", "any"])
def test_modules_whose_calls_depend_on_values_get_private_chunks(test):
    profile = profile_model(Experts(test), _batch())
    experts = {f"experts.{e}.{k}" for e in range(3) for k in ("weight", "bias")}
    assert set(profile.conditional_params) == experts
    assert experts <= set(profile.shared_params)
    assert type(profile).from_json(profile.to_json()).conditional_params == profile.conditional_params
    options = SearchOptions(world_size=2, micro_batches=1, allow_cpu=False, nvme_available=False)
    plan, _ = search(profile, hardware(world_size=2), 1 << 30, options)
    private = {name for chunk in plan.chunks if chunk.private for name in chunk.params}
    assert experts <= private


@pytest.mark.parametrize("module_class", [ReadsItem, SkipsNonFinite, ReadsList, MasksBatch])
def test_value_reads_that_change_no_module_call_find_no_conditional_modules(module_class):
    assert profile_model(module_class(), _batch()).conditional_params == ()


class ChecksItsData(Classifier):
    """A check of the data on a value the trace cannot know (ProphetNet's shift asserts its labels are
    non-negative), and a step that cannot run when the check fails the other way."""

    def __init__(self, check: str) -> None:
        super().__init__()
        self.check = check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check == "assert":
            assert torch.all(x > -1e4).item(), "inputs out of range"
        elif self.check == "raise":
            if not torch.isfinite(x).all():
                raise ValueError("non-finite inputs")
        elif self.check == "both ways":  # fails whatever the trace assumes: the first failure is reported
            if (x.sum() > 0).item():
                raise RuntimeError("read True")
            raise ValueError("read False")
        return super().forward(x)


@pytest.mark.parametrize("check", ["assert", "raise"])
def test_a_check_of_the_data_that_fails_on_an_assumed_answer_is_traced_with_the_opposite_one(check):
    profile = _check(ChecksItsData(check))
    assert any("head.weight" in a.params for a in profile.accesses if a.phase == "backward")
    assert profile.conditional_params == ()


def test_a_step_that_fails_on_either_answer_raises_its_first_failure():
    with pytest.raises(ValueError, match="read False"):
        profile_model(ChecksItsData("both ways"), _batch())


class GroupedExperts(Classifier):
    """Experts as one 3-D parameter multiplied with torch's grouped matmul, in fp32 (Hugging Face's
    mixture-of-experts layers on a CPU): torch's meta kernel of the operator accepts bf16 only."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(2, 16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        offs = torch.tensor([h.shape[0] // 2, h.shape[0]], dtype=torch.int32)
        return self.head(torch.nn.functional.grouped_mm(h, self.experts, offs=offs))


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="this torch has no grouped_mm")
def test_grouped_matmul_in_fp32_profiles():
    module = GroupedExperts()
    x, y = _batch()
    F.cross_entropy(module(x), y).backward()  # the real kernel runs fp32 on this machine
    module.zero_grad()
    profile = _check(module)
    assert any("experts" in a.params for a in profile.accesses if a.phase == "backward")


class Packed(Classifier):
    """Padded sequences packed with their lengths (read from the data) before an LSTM."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.unsqueeze(1).expand(-1, 5, -1)
        lengths = (seq.abs().sum(-1) > 0).sum(-1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(seq, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.rnn(packed)
        return self.head(h[-1])


def test_packed_sequences_profile_at_full_length():
    profile = _check(Packed())
    assert profile.conditional_params == ()
    assert any("rnn.weight_ih_l0" in a.params for a in profile.accesses if a.phase == "backward")


class SparseEmbedding(Classifier):
    """nn.Embedding(sparse=True): its gradient is a sparse tensor, with no storage of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(32, 8, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.table((x.abs() * 10).long() % 32).mean(1))


def test_sparse_gradients_profile():
    profile = _check(SparseEmbedding())
    assert any("table.weight" in a.params for a in profile.accesses if a.phase == "backward")


class Generates(Classifier):
    """A step that extends its input until a stopping mask says every row is done, as text generation does."""

    def __init__(self, until_end_token: bool) -> None:
        super().__init__()
        self.until_end_token = until_end_token

    def training_step(self, batch, batch_idx):
        x, y = batch
        unfinished = torch.ones(x.shape[0], dtype=torch.long)
        steps = 0
        while True:
            x = x + self(x).sum(-1, keepdim=True) * 0.0  # one forward per generated token
            steps += 1
            done = torch.full((x.shape[0],), steps >= 3, dtype=torch.bool)  # a maximum length
            if self.until_end_token:  # ... or an end token, which only values can say
                done = x[:, 0] > 1e6
            unfinished = unfinished & ~done
            if unfinished.max() == 0:
                break
        self.steps = steps
        return F.cross_entropy(self(x), y)


def test_a_loop_that_ends_on_constant_fills_ends_in_the_trace():
    module = Generates(until_end_token=False)
    profile = profile_model(module, _batch())
    assert len(profile.accesses) > 0 and not _fakes_in(module)


def test_a_loop_that_ends_only_on_unknown_values_is_given_up(monkeypatch):
    from lightning_elixir.profile.assumed import AssumedValues

    monkeypatch.setattr(AssumedValues, "max_ops", 20_000)
    with pytest.raises(ProfileError, match="more than 20,000 operators"):
        profile_model(Generates(until_end_token=True), _batch())


def test_the_operator_cap_is_not_raised_from_a_metadata_query():
    # torch 2.8 asks prim.device from C++ that cannot pass an exception on: raised there, the process aborted
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_elixir.profile.assumed import AssumedValues

    fake = FakeTensorMode()
    values = AssumedValues(fake)
    values.ops = values.max_ops
    x = fake.from_tensor(torch.ones(2))
    assert values.__torch_dispatch__(torch.ops.prim.device.default, (), (x,)) == x.device
    with pytest.raises(ProfileError, match="operators on fake tensors"):
        values.__torch_dispatch__(torch.ops.aten.add.Tensor, (), (x, x))
