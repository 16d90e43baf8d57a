"""Lightning's multiprocessing launcher (spawn, fork, forkserver), whose rank-0 results carry the gathered
weights, not the chunk placeholders."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override


class ElixirMultiprocessingLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, with the final weights gathered through the strategy."""

    def __init__(self, strategy: Any, start_method: str = "spawn") -> None:
        super().__init__(strategy, start_method=start_method)

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Optional[_WorkerOutput]:
        # Every rank takes part in the gather; a module's own state_dict() would see placeholders.
        state_dict = self._strategy.lightning_module_state_dict()
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".weights.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))
