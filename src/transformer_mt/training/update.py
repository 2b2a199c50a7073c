"""An update's counts and totals, its one wait for the device (TranslationModule.update makes it), and UpdateEnd."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from transformer_mt.errors import UserError
from transformer_mt.model import training_flops
from transformer_mt.stops import SIGNALS, TrainingStops, validation_follows

log = logging.getLogger(__name__)


def clock() -> float:
    """Seconds for durations (a test drives the update clock through it)."""
    return time.monotonic()


class TrainingDiverged(UserError):
    """A non-finite gradient: the run stops with one line."""


@dataclass(frozen=True)
class Update:
    """What the host knows of the update that just ended, the same on every rank."""

    step: int  # updates done, this one included (trainer.global_step)
    tokens: int  # target tokens of the update, every rank's
    flops: float  # model FLOPs of the update (model.training_flops), every rank's
    loss_sum: float  # label-smoothed loss summed over the update's target tokens, every rank's
    nll_sum: float
    grad_norm: float  # of the whole normalised gradient
    signal: int  # the stop signal any rank had received by this update's reduction (0: none)
    clock: float  # seconds of training over every attempt, validations left out, rank 0's
    seconds: float  # this process's wall time since the previous update ended


class UpdateBookkeeping(L.Callback):
    """The module's update's counts (target tokens, FLOPs, the clock, stop signals) and their totals, which travel in
    checkpoints; a callback of the module's own (configure_callbacks), whoever builds the Trainer."""

    def __init__(self):
        self.totals = {"target_tokens": 0, "model_flops": 0.0, "train_seconds": 0.0}
        self.signal = 0  # a stop signal's number, noted on this rank (stops.TrainingStops)
        self.current: Update | None = None  # the newest update read
        self.norm: Tensor | None = None  # the update's gradient norm (device), set by the module before its step
        self._sums: Tensor | None = None  # loss and NLL sums of this update's micro-batches (device)
        self._host = [0, 0.0]  # target tokens and FLOPs of this update's micro-batches, this rank
        self._pending: Tensor | None = None  # [grad norm, tokens, FLOPs, clock, signals..., loss, nll] (device)

    def add(self, module: L.LightningModule, batch: dict, loss_sum: Tensor, nll_sum: Tensor) -> None:
        """A micro-batch's share: its loss sums stay on the device; its counts come from collate (host)."""
        sums = torch.stack([loss_sum.detach(), nll_sum.detach()]).float()
        self._sums = sums if self._sums is None else self._sums + sums
        flops = training_flops(module.model.cfg, batch["src_lengths"], batch["tgt_lengths"])
        self._host = [self._host[0] + sum(batch["tgt_lengths"]), self._host[1] + flops]

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._start = self._last_end = clock()
        self._before, self._paused = self.totals["train_seconds"], 0.0
        buffer = torch.zeros(3 + len(SIGNALS), dtype=torch.float64)  # tokens, FLOPs, rank 0's clock, signals
        self._buffer = buffer.pin_memory() if trainer.strategy.root_device.type == "cuda" else buffer

    def counts(self, trainer: L.Trainer) -> Tensor:
        """This rank's [target tokens, FLOPs, rank 0's clock, a flag per signal, loss sum, NLL sum], on the device."""
        (tokens, flops), self._host = self._host, [0, 0.0]
        (sums, self._sums), flags = (self._sums, None), [float(self.signal == s) for s in SIGNALS]
        elapsed = self.training_clock() if trainer.global_rank == 0 else 0.0
        self._buffer.copy_(torch.tensor([tokens, flops, elapsed, *flags], dtype=torch.float64))
        # float64: token totals exact far past float32's 2^24; a pinned copy does not wait for the device
        return torch.cat([self._buffer.to(trainer.strategy.root_device, non_blocking=True), sums.double()])

    def ended(self, norm: Tensor, values: Tensor) -> None:
        """The update's step is queued: its norm and every rank's counts wait on the device for end()."""
        self._pending = torch.cat([norm.reshape(1).double(), values])

    def end(self, trainer: L.Trainer) -> Update | None:
        """The update that ended with this micro-batch, read in one transfer; None inside an accumulation window."""
        if self._pending is None:
            return None
        norm, tokens, flops, elapsed, *counts, loss_sum, nll_sum = self._pending.tolist()
        self._pending = None
        received = next((int(s) for s, n in zip(SIGNALS, counts) if n), 0)
        if trainer.world_size == 1:
            received, elapsed = self.signal, self.training_clock()
        now = clock()
        self.current = Update(
            trainer.global_step, int(tokens), flops, loss_sum, nll_sum, norm, received, elapsed, now - self._last_end
        )
        self._last_end = now
        self.totals["target_tokens"] += int(tokens)
        self.totals["model_flops"] += flops
        self.totals["train_seconds"] = elapsed
        return self.current

    def training_clock(self) -> float:
        """Seconds of training over every attempt of the run, validations left out."""
        return self._before + clock() - self._start - self._paused

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._validation_began = None if trainer.sanity_checking else clock()

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self._validation_began is not None:
            self._paused += clock() - self._validation_began

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["totals"] = dict(self.totals)  # as of the update that just ended: saves come right after one

    def on_load_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict) -> None:
        self.totals = dict(checkpoint["totals"])


class UpdateEnd(L.Callback):
    """The one owner of an update's end: its read, a non-finite norm, the time budget, the loggers, the moving average,
    the run log, a stop signal noted on any rank (stops.TrainingStops: training ends after that update), checkpoints."""

    def __init__(self, progress=None, ema=None, saves=None):
        self.progress, self.ema, self.saves = progress, ema, saves
        self.stops = TrainingStops()

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.budget = getattr(module, "budget", None)
        if self.budget is not None:
            self.budget.begin(trainer, module.updates.totals["train_seconds"])
        self.stops.begin(trainer, module.updates)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        update = module.updates.end(trainer)  # the update's one wait for the device
        if update is None:  # inside an accumulation window
            return
        if not math.isfinite(update.grad_norm):
            raise TrainingDiverged(  # its step was skipped on the device: every checkpoint stays finite
                f"training diverged at update {update.step}: the gradient norm is {update.grad_norm} (optim.lr_factor "
                "too high?); the checkpoints written so far are finite"
            )
        tokens = module.updates.totals["target_tokens"]
        out_of_time = self.budget is not None and self.budget.after_update(trainer, update, tokens)  # fixes its end
        log_update(trainer, update)  # the loggers: losses, gradient norm, the next update's rate
        if self.ema is not None:
            self.ema.after_update(module)
        if self.progress is not None:
            self.progress.after_update(trainer, update)  # the run log's lines, the bar
        if update.signal:  # any rank's; callback_metrics: ddp_spawn's workers hand it back to train()
            trainer.callback_metrics["stopped_by_signal"] = torch.tensor(float(update.signal))
        if out_of_time or update.signal:  # with no validation that was not due (Lightning validates at any stop)
            if not validation_follows(trainer):
                trainer.limit_val_batches = 0
            trainer.should_stop = True
        if self.saves is not None:
            self.saves.after_update(trainer, update)  # periodic and last.ckpt, after a validation that follows

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.stops.end()
        # a signal noted after the last update's reduction: every rank's, reduced once more
        received = torch.tensor([self.stops.received], device=module.device)
        signum = int(trainer.strategy.reduce(received, reduce_op="max"))
        if signum and "stopped_by_signal" not in trainer.callback_metrics:
            trainer.callback_metrics["stopped_by_signal"] = torch.tensor(float(signum))

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        self.stops.end()

    on_exception = teardown  # Lightning calls no teardown hook then (the exception in `stage`'s place)


def gradient_norm(parameters) -> Tensor:
    """The L2 norm of the whole gradient, the same on every rank: FSDP's sharded gradients (DTensors) give a norm of
    the ranks' parts, which full_tensor() reduces."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], foreach=True)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).float()


def log_update(trainer: L.Trainer, update: Update) -> None:
    """Host numbers to every logger at trainer.log_every_n_steps (self.log would build device tensors)."""
    every, tokens = trainer.log_every_n_steps, max(update.tokens, 1)
    if not every or update.step % every:
        return
    optimizer, nll = trainer.optimizers[0], update.nll_sum / tokens
    metrics = {"train/loss": update.loss_sum / tokens, "train/nll": nll, "train/ppl": math.exp(min(nll, 700.0))}
    metrics |= {"train/grad_norm": update.grad_norm, f"lr-{type(optimizer).__name__}": optimizer.param_groups[0]["lr"]}
    log_metrics(trainer, metrics, update.step - 1)  # Lightning's step: the updates before this one


def log_metrics(trainer: L.Trainer, metrics: dict, step: int) -> None:
    """Numbers (tensors read here) to every logger at `step`."""
    values = {k: v.item() if isinstance(v, Tensor) else v for k, v in metrics.items()}
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)
