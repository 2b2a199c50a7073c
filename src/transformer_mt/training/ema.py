"""An exponential moving average of the weights (`ema_decay`): Marian's exponential smoothing, Eole's
average_decay. Kept beside the trained weights, not in their place: checkpoints, validation and
`make average` see the trained weights as without it; the end of the run evaluates the average too
(evaluation/protocol.py writes it as ema.ckpt).

Lightning's own EMAWeightAveraging puts the average in the checkpoints' state_dict and validates with it,
so the last-N checkpoint average (§6.1) would average averages: hence this small callback.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from torch import Tensor

from transformer_mt.checkpoint import EMA_KEY

log = logging.getLogger(__name__)


class ExponentialMovingAverage(L.Callback):
    """After every update t (UpdateEnd calls after_update): ema_t = decay * ema_{t-1} + (1 - decay) * weights_t, with
    ema_0 the initial weights, in fp32. It travels in every checkpoint: a resumed run continues it bit for bit."""

    def __init__(self, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"ema_decay={decay}: must be in (0, 1), e.g. 0.9999")
        self.decay = decay
        self.average: dict[str, Tensor] | None = None
        self.updates = 0

    @property
    def state_key(self) -> str:
        return EMA_KEY

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        params = dict(module.model.named_parameters())
        if self.average is None:  # a new run: the average starts at the initial weights
            self.average = {name: p.detach().float().clone() for name, p in params.items()}
            self.updates = trainer.global_step
        else:  # restored from a checkpoint (load_state_dict): onto the weights' device
            self.average = {name: value.to(params[name].device) for name, value in self.average.items()}

    @torch.no_grad()
    def after_update(self, module: L.LightningModule) -> None:
        """ema + (1 - decay) * (weights - ema), every tensor in one call (one fused kernel on CUDA)."""
        self.updates += 1
        names, weights = zip(*((name, p.detach().float()) for name, p in module.model.named_parameters()))
        torch._foreach_lerp_([self.average[name] for name in names], list(weights), 1 - self.decay)

    def state_dict(self) -> dict:
        average = {name: value.cpu() for name, value in (self.average or {}).items()}
        return {"decay": self.decay, "updates": self.updates, "average": average}

    def load_state_dict(self, state: dict) -> None:
        if state["decay"] != self.decay:  # the configured decay applies from here on
            log.warning(
                "ema_decay=%s: the checkpoint's moving average was kept with %s until now", self.decay, state["decay"]
            )
        self.updates, self.average = state["updates"], dict(state["average"])
