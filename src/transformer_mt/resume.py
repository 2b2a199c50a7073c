"""What a checkpoint must hold beyond weights and optimizer for a resumed run to continue exactly."""

from __future__ import annotations

import logging
import random

import lightning as L
import numpy as np
import torch

log = logging.getLogger(__name__)


def random_state() -> dict:
    """This process's generators: Python, NumPy, torch CPU and every CUDA device, as values that
    torch.load(weights_only=True) accepts (NumPy's key array becomes a tensor)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_random_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RandomState(L.Callback):
    """Saves every rank's random-number generators in checkpoints and restores them on resume, so
    that dropout draws the same masks as in the uninterrupted run.

    They are restored at the first training batch after resuming, not when the checkpoint is
    loaded: creating the data loaders' iterators (and a sanity check) draws from the generator
    in between, which the uninterrupted run did before it saved its state.
    """

    def __init__(self):
        self._restore: list[dict] | None = None

    def state_dict(self) -> dict:
        state = random_state()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, state)  # rank 0 writes the checkpoint: all ranks' states
            return {"ranks": ranks}
        return {"ranks": [state]}

    def load_state_dict(self, state: dict) -> None:
        self._restore = state["ranks"]

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._restore is not None:
            if len(self._restore) == trainer.world_size:
                set_random_state(self._restore[trainer.global_rank])
            else:
                log.warning(
                    "resuming on %d device(s) from a checkpoint written by %d: dropout continues with "
                    "fresh random states, so the run is not bit-identical to an uninterrupted one",
                    trainer.world_size,
                    len(self._restore),
                )
            self._restore = None
