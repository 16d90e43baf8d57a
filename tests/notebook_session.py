"""What a Jupyter notebook does, as a script: ``python -m tests.notebook_session OUT.json``.

Lightning takes the session for an interactive one (``sys.ps1`` is set before it is imported) and then
accepts only strategies whose ranks fork; the module is defined here, in ``__main__``, which a spawned
rank could not import. It fits with "elixir_notebook" and with Lightning's "ddp_notebook" on two CPU
ranks, and writes what came back to this process (the trained weights, the logged loss) and the
error "elixir_spawn" got, for tests/test_strategy.py to compare."""

import sys

sys.ps1 = ">>> "  # before Lightning is imported: it reads this once

import json  # noqa: E402
import os  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_elixir  # noqa: E402,F401  (registers the strategies)
from tests.distributed import free_port  # noqa: E402


class NotebookModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)


def trainer(strategy: str) -> L.Trainer:
    os.environ["MASTER_PORT"] = str(free_port())  # a fresh port per fit
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def fit(strategy: str) -> dict:
    model = NotebookModel()
    fitted = trainer(strategy)
    fitted.fit(model, data())
    return {"weights": weights(model), "loss": float(fitted.callback_metrics["loss"])}


def weights(model: torch.nn.Module) -> dict:
    return {k: v.tolist() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    results = {name: fit(name) for name in ("elixir_notebook", "ddp_notebook")}
    results["initial"] = weights(NotebookModel())
    try:
        trainer("elixir_spawn")
        results["elixir_spawn"] = "accepted"
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        results["elixir_spawn"] = f"{type(err).__name__}: {err}"
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
