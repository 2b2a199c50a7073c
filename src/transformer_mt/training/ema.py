"""A moving average of the weights (`ema_decay`) beside them, not in the state_dict as Lightning's EMAWeightAveraging
(the last-N average of §6.1 would average averages); the end of the run evaluates it too (ema.ckpt)."""

from __future__ import annotations

import lightning as L
from torch import Tensor
from torch.optim.swa_utils import get_ema_multi_avg_fn


class ExponentialMovingAverage(L.Callback):
    """ema_t = decay * ema_{t-1} + (1 - decay) * weights_t after update t, ema_0 the initial weights, in fp32."""

    def __init__(self, decay: float):
        self.decay = decay  # fit.check_config refuses one outside (0, 1)
        self.average: dict[str, Tensor] | None = None
        self.updates = 0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        params = dict(module.model.named_parameters())
        if self.average is None:  # a new run: the average starts at the initial weights
            self.average = {name: p.detach().float().clone() for name, p in params.items()}
            self.updates = trainer.global_step
        else:  # restored from a checkpoint (load_state_dict): onto the weights' device
            self.average = {name: value.to(params[name].device) for name, value in self.average.items()}

    def after_update(self, module: L.LightningModule) -> None:
        """ema + (1 - decay) * (weights - ema), every tensor in one call (torch's EMA for AveragedModel)."""
        self.updates += 1
        names, weights = zip(*((name, p.detach().float()) for name, p in module.model.named_parameters()))
        get_ema_multi_avg_fn(self.decay)([self.average[name] for name in names], list(weights), self.updates)

    def state_dict(self) -> dict:
        average = {name: value.cpu() for name, value in (self.average or {}).items()}
        return {"decay": self.decay, "updates": self.updates, "average": average}

    def load_state_dict(self, state: dict) -> None:
        self.updates, self.average = state["updates"], dict(state["average"])
