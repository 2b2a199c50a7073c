"""The optimizer update's bookkeeping, in one place, with one wait for the device per update.

Each micro-batch adds its target tokens and model FLOPs (host numbers, from collate's lengths) and its
loss sums (device tensors, never read there). Before the optimizer step the update's gradient is
normalised by its target tokens over every micro-batch and rank, its norm computed, and a non-finite
norm makes fused Adam skip the step on the device (optimizer.found_inf, as torch's GradScaler does), so
no weight and no checkpoint ever holds NaN. With several ranks one all-reduce carries the tokens,
FLOPs, loss sums, stop signals and rank 0's clock (the update clock: seconds of training over every
attempt of the run, validations left out, which time-based checkpoints and the time budget decide on).
After the step, the first part of the run that asks (`finished`) reads it all in one transfer: the
update's `Update` record, which progress lines, the loggers, the stop decision and time-based
checkpoints use, every rank alike.

On a GPU every read of a device value drains the kernel queue, and so does a device tensor built from
Python values (a pageable copy, then a synchronisation): nothing here does either inside an update.
tests/device_waits.py counts them over whole runs.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor

from transformer_mt.errors import UserError
from transformer_mt.model import training_flops
from transformer_mt.training.sharding import is_sharded, local

# The stop signals ranks agree on (RunEnd), highest number first: SIGTERM (15) wins over SIGUSR1 (10), over SIGINT (2).
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
HOST_FIELDS = 3 + len(SIGNALS)  # tokens, FLOPs, rank 0's clock, a count per signal


def clock() -> float:
    """Seconds for durations; a function of this module, so that a test can drive the update's clock."""
    return time.monotonic()


class TrainingDiverged(UserError):
    """A non-finite loss or gradient: the run stops with one line instead of training on NaN."""


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
    clock: float  # seconds of training over every attempt, validations left out, rank 0's: the same on every rank
    seconds: float  # this process's wall time since the previous update ended

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)

    @property
    def nll(self) -> float:
        return self.nll_sum / max(self.tokens, 1)


class UpdateBookkeeping(L.Callback):
    """Attached by TranslationModule.configure_callbacks, so whoever builds the Trainer trains correctly.

    The module hands in each micro-batch (`add`); every other part asks `finished(trainer)`, which reads
    the device once per update and returns the same Update to every caller. `totals` (tokens, FLOPs,
    seconds over every attempt of the run: the update clock) travel in checkpoints, for results.json and the time
    budget of a resumed run."""

    def __init__(self):
        self.totals = {"target_tokens": 0, "model_flops": 0.0, "train_seconds": 0.0}
        self.signal = 0  # a stop signal's number, noted on this rank by RunEnd
        self.current: Update | None = None  # the update that ended with the micro-batch in progress, once read
        self._start = 0.0  # when this attempt's training started (clock())
        self._before = 0.0  # seconds of training of the attempts before this one (from the checkpoint)
        self._paused = 0.0  # seconds of this attempt spent in validations
        self._validation_began: float | None = None
        self._sums: Tensor | None = None  # loss and NLL sums of this update's micro-batches (device)
        self._host = [0, 0.0]  # target tokens and FLOPs of this update's micro-batches, this rank
        self.norm: Tensor | None = None  # the update's gradient norm (device), known before its step
        self._pending: Tensor | None = None  # [grad norm, tokens, FLOPs, clock, signals..., loss, nll] (device)
        self._buffer: Tensor | None = None  # pinned host memory for the values that cross to the device

    # -- micro-batches

    def add(self, module: L.LightningModule, batch: dict, loss_sum: Tensor, nll_sum: Tensor) -> None:
        """A micro-batch's share: its loss sums stay on the device; its counts come from collate (host)."""
        sums = torch.stack([loss_sum.detach(), nll_sum.detach()]).float()
        self._sums = sums if self._sums is None else self._sums + sums
        tokens = sum(batch["tgt_lengths"])
        flops = training_flops(module.model.cfg, batch["src_lengths"], batch["tgt_lengths"])
        self._host = [self._host[0] + tokens, self._host[1] + flops]

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._start = self._last_end = clock()
        self._before, self._paused = self.totals["train_seconds"], 0.0
        device = trainer.strategy.root_device
        buffer = torch.zeros(HOST_FIELDS, dtype=torch.float64)
        self._buffer = buffer.pin_memory() if device.type == "cuda" else buffer

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch, batch_idx: int) -> None:
        self.current = None

    # -- the update: normalised gradient and its norm before the step, one read after it

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer) -> None:
        """Gradient of the update's summed loss / its target tokens over every micro-batch and rank.
        Lightning divided each micro-batch's loss by the accumulation factor and DDP/FSDP average the
        ranks' gradients: undo both, then divide by the tokens (as fairseq: every target token weighs the
        same, whichever micro-batch or rank holds it)."""
        (tokens, flops), self._host = self._host, [0, 0.0]
        device = trainer.strategy.root_device
        counts = [0.0] * len(SIGNALS)
        if self.signal in SIGNALS:
            counts[SIGNALS.index(self.signal)] = 1.0
        elapsed = self.training_clock() if trainer.global_rank == 0 else 0.0
        self._buffer.copy_(torch.tensor([tokens, flops, elapsed, *counts], dtype=torch.float64))
        sums = self._sums if self._sums is not None else torch.zeros(2, device=device)
        self._sums = None
        # float64: token totals exact far past float32's 2^24
        values = torch.cat([self._buffer.to(device, non_blocking=True), sums.double()])
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if trainer.world_size == 1:
            torch._foreach_mul_(grads, trainer.accumulate_grad_batches / max(tokens, 1))  # a host number
        else:
            torch.distributed.all_reduce(values)
            scale = (trainer.accumulate_grad_batches * trainer.world_size / values[0].clamp(min=1)).float()
            torch._foreach_mul_(grads, scale)  # on the gradients' device
        self.norm = norm = gradient_norm(module.parameters(), sharded=is_sharded(trainer.strategy))
        if trainer.precision != "16-mixed":  # fp16's GradScaler skips such steps itself
            optimizer.found_inf = (~norm.isfinite()).float()  # fused Adam leaves weights and moments as they are
        self._pending = torch.cat([norm.reshape(1).double(), values])

    def finished(self, trainer: L.Trainer) -> Update | None:
        """The update that ended with this micro-batch, read from the device at the first call after it
        (the one wait of the update); None inside an accumulation window. Stops a run whose gradient is
        not finite: that update's step was skipped, so the weights and every checkpoint stay finite."""
        if self._pending is None:  # inside an accumulation window, or read already by an earlier caller
            return self.current
        norm, tokens, flops, elapsed, *rest = self._pending.tolist()
        self._pending = None
        counts, (loss_sum, nll_sum) = rest[: len(SIGNALS)], rest[len(SIGNALS) :]
        received = next((int(s) for s, n in zip(SIGNALS, counts) if n), 0)
        now = clock()
        if trainer.world_size == 1:
            received, elapsed = self.signal, self.training_clock()
        update = Update(
            trainer.global_step, int(tokens), flops, loss_sum, nll_sum, norm, received, elapsed, now - self._last_end
        )
        self.current = update
        self._last_end = now
        self.totals["target_tokens"] += int(tokens)
        self.totals["model_flops"] += flops
        self.totals["train_seconds"] = elapsed
        if trainer.precision != "16-mixed" and not math.isfinite(norm):
            raise TrainingDiverged(
                f"training diverged at update {trainer.global_step}: the gradient norm is {norm}. "
                "Likely causes: a learning rate too high (optim.lr_factor, optim.warmup_steps), fp16 overflow "
                "(use trainer.precision=bf16-mixed or 32-true), or corrupt data. The weights were not updated; "
                "the checkpoints written so far are finite"
            )
        if logs_this_update(trainer):
            metrics = {"train/loss": update.loss, "train/nll": update.nll, "train/grad_norm": norm}
            metrics["train/ppl"] = math.exp(min(update.nll, 700.0))
            log_metrics(trainer, {**metrics, **next_rate(trainer)})
        return update

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        self.finished(trainer)  # read even when no other part asked (the divergence stop, the loggers)

    # -- the update clock

    def training_clock(self) -> float:
        """Seconds of training over every attempt of the run, this process's: validations are left out."""
        return self._before + clock() - self._start - self._paused

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validation_began = clock()

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self._validation_began is not None:
            self._paused += clock() - self._validation_began
            self._validation_began = None

    # -- totals in checkpoints (results.json's tokens/s and MFU over every attempt; the clock of a resumed run)

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["totals"] = dict(self.totals)  # as of the update that just ended: saves come right after one

    def on_load_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict) -> None:
        self.totals = {**self.totals, **checkpoint.get("totals", {})}  # older checkpoints lack model_flops


def gradient_norm(parameters, sharded: bool) -> Tensor:
    """The L2 norm of the whole gradient. Sharded (FSDP), each rank holds a part of it: the squares are
    summed across ranks, so that every rank logs and decides on the same norm (a NaN in one shard
    stops every rank alike, instead of one rank while the others wait). DDP's gradients are already
    the same on every rank."""
    grads = [local(p.grad) for p in parameters if p.grad is not None]  # leaves: no detach to launch
    grads = [g for g in grads if g.numel()]  # a rank may hold none of a small parameter
    norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())  # one fused kernel
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        squares = norm.float().square()
        torch.distributed.all_reduce(squares)
        return squares.sqrt()
    return norm.float()


def logs_this_update(trainer: L.Trainer) -> bool:
    """Whether the update that just ended is one whose metrics are logged (trainer.log_every_n_steps)."""
    return bool(trainer.log_every_n_steps) and trainer.global_step % trainer.log_every_n_steps == 0


def next_rate(trainer: L.Trainer) -> dict[str, float]:
    """The rate of the next update, as Lightning's LearningRateMonitor names it (which would also put it in
    callback_metrics as device tensors built from Python floats: a wait each)."""
    optimizer = trainer.optimizers[0]
    return {f"lr-{type(optimizer).__name__}": optimizer.param_groups[0]["lr"]}


def log_metrics(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Host numbers to every logger at the update that just ended (Lightning's step: the updates before it);
    Lightning's self.log would build device tensors."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step - 1)
