"""Deferred initialisation: a build recorded on the meta device replays to exactly what a real build makes."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from lightning_elixir.runtime.deferred import record_init


class Schemes(nn.Module):
    """Initialisations that torch.nn.init skips on meta tensors, a value read during the build, a view written."""

    def __init__(self) -> None:
        super().__init__()
        self.ortho = nn.Parameter(torch.empty(6, 4))
        nn.init.orthogonal_(self.ortho)
        self.trunc = nn.Parameter(torch.empty(5))
        nn.init.trunc_normal_(self.trunc, std=0.02)
        self.sparse = nn.Parameter(torch.empty(4, 3))
        nn.init.sparse_(self.sparse, sparsity=0.5)
        self.scale = float(torch.linspace(0, 0.3, 3)[1].item())  # a drop-path schedule read as a number
        self.register_buffer("table", torch.arange(4.0) * self.scale)
        self.emb = nn.Embedding(10, 4, padding_idx=3)  # zeroes a row through a view
        with torch.no_grad():
            self.emb.weight[5].fill_(0.5)


class HostData(nn.Module):
    """Tensors made from host data on the build's device, and rows taken by list and array indices (PEFT's
    trainable tokens copy ``weight[[3, 5, 7]]``): C++ puts that data on the meta device without an operation."""

    def __init__(self) -> None:
        super().__init__()
        import numpy as np

        self.emb = nn.Embedding(10, 4)
        w = self.emb.weight
        self.rows = nn.Parameter(w[[3, 5, 7]].detach().clone())
        self.register_buffer("pairs", w[[1, 2], [0, 3]] * 2)
        self.register_buffer("even", w[[True, False] * 5].sum(0))
        self.register_buffer("picked", w[np.array([9, 0])] + w.new_tensor([1.0, 2.0, 3.0, 4.0]))
        self.register_buffer("shift", torch.tensor([0.5, 1.5, 2.5, 3.5], device=w.device)
                             + torch.as_tensor([1, 2, 3, 4], device=w.device))
        with torch.no_grad():
            w[[4, 6]] = w[[8, 9]] + 1
            w[[0, 1]] = 0.25


BUILDS: dict[str, Callable[[], nn.Module]] = {
    "host_data": HostData,
    "mlp": lambda: nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4)),
    "lstm": lambda: nn.LSTM(4, 8, 2),
    "transformer_layer": lambda: nn.TransformerEncoderLayer(16, 4, 32),
    "conv_bn": lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)),
    "schemes": Schemes,
}


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters()) + list(module.named_buffers())


def _built_twice(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module, Any]:
    """``build`` run for real and recorded, from the same seed: (real, deferred, recording), once the generator
    is checked to have moved as the real build moved it."""
    torch.manual_seed(0)
    real = build()
    next_real = torch.rand(4)
    torch.manual_seed(0)
    with record_init(torch.device("cpu")) as record:
        deferred = build()
    assert torch.equal(torch.rand(4), next_real)
    return real, deferred, record


def _replays_like_a_real_build(build: Callable[[], nn.Module]) -> None:
    real, deferred, record = _built_twice(build)
    for (name, want), (_, made) in zip(_tensors(real), _tensors(deferred)):
        assert type(made) in (torch.Tensor, nn.Parameter), name  # plain again once the build is over
        if made.is_meta:
            assert torch.equal(record.materialize(made), want), name
        else:  # ``torch.tensor(...)`` copies host data: small, and real under the meta device's rules too
            assert torch.equal(made, want), name


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_replay_is_bit_identical_to_a_real_build(name: str) -> None:
    _replays_like_a_real_build(BUILDS[name])


def test_replay_leaves_the_generator_where_it_was() -> None:
    torch.manual_seed(0)
    with record_init(torch.device("cpu")) as record:
        layer = nn.Linear(16, 16)
    state = torch.get_rng_state()
    record.materialize(layer.weight)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_models_replay_their_own_initialisation(family: str) -> None:
    tr = pytest.importorskip("transformers")
    if family == "llama":  # rotary tables are buffers its __init__ computes; post_init draws normal(0, 0.02)
        config = tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2)
        build = lambda: tr.LlamaForCausalLM(config)  # noqa: E731
    else:  # Conv1D has no reset_parameters
        config = tr.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=0,
                               eos_token_id=0)
        build = lambda: tr.GPT2LMHeadModel(config)  # noqa: E731
    _replays_like_a_real_build(build)


@pytest.mark.parametrize("loader", ["torch", "safetensors"])
def test_weights_loaded_during_the_build_replay_as_loaded(tmp_path, loader: str) -> None:
    """A pretrained state dict read from a file in the build (``configure_model``) and loaded into it."""
    torch.manual_seed(1)
    pretrained = BUILDS["mlp"]()
    if loader == "torch":
        torch.save(pretrained.state_dict(), tmp_path / "weights.pt")
        load = lambda: torch.load(tmp_path / "weights.pt")  # noqa: E731
    else:
        st = pytest.importorskip("safetensors.torch")
        st.save_file(pretrained.state_dict(), tmp_path / "weights.safetensors")
        load = lambda: st.load_file(tmp_path / "weights.safetensors")  # noqa: E731
    with record_init(torch.device("cpu")) as record:
        model = BUILDS["mlp"]()
        model.load_state_dict(load())
    for (name, want), (_, made) in zip(_tensors(pretrained), _tensors(model)):
        assert torch.equal(record.materialize(made) if made.is_meta else made, want), name


def test_a_meta_tensor_made_elsewhere_is_not_claimed() -> None:
    with record_init(torch.device("cpu")) as record:
        nn.Linear(2, 2)
    with torch.device("meta"):
        other = nn.Linear(2, 2)
    assert not record.knows(other.weight)
    with pytest.raises(RuntimeError, match="not made by this recording"):
        record.materialize(other.weight)


class MetaSkeleton(nn.Module):
    """Part of the build on the meta device itself, as Hugging Face's ``from_pretrained`` builds before loading: a
    real build draws no random numbers for it, so the layer built after it starts from the same draws."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.skeleton = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)


def test_a_meta_device_build_inside_draws_no_random_numbers() -> None:
    real, deferred, record = _built_twice(MetaSkeleton)
    assert deferred.skeleton.weight.is_meta and not record.knows(deferred.skeleton.weight)  # meta, as built
    for name in ("weight", "bias"):
        assert torch.equal(record.materialize(getattr(deferred.head, name)), getattr(real.head, name)), name


def test_from_pretrained_with_a_new_head_replays_as_loaded(tmp_path) -> None:
    """A checkpoint loaded in the build with a head it lacks: the loaded weights, and the head Hugging Face
    initialises after building on the meta device, are the real build's."""
    tr = pytest.importorskip("transformers")
    config = tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(3)
    tr.LlamaForCausalLM(config).save_pretrained(tmp_path)
    build = lambda: tr.LlamaForSequenceClassification.from_pretrained(tmp_path, num_labels=3)  # noqa: E731
    _replays_like_a_real_build(build)
