"""An optimizer update: its gradient's normalisation, its one wait for the device, and UpdateEnd, its end's owner."""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor

from transformer_mt.errors import UserError
from transformer_mt.model import training_flops
from transformer_mt.training.sharding import LayerFSDP, local

log = logging.getLogger(__name__)

# The stop signals ranks agree on, highest number first: SIGTERM (15) wins over SIGUSR1 (10), over SIGINT (2).
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


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
    """The module's own (any Trainer normalises the gradient so); its totals travel in checkpoints."""

    def __init__(self):
        self.totals = {"target_tokens": 0, "model_flops": 0.0, "train_seconds": 0.0}
        self.signal = 0  # a stop signal's number, noted on this rank by UpdateEnd
        self.current: Update | None = None  # the newest update read
        self.norm: Tensor | None = None  # the update's gradient norm (device), known before its step
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

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer) -> None:
        """Gradient of the update's summed loss / its target tokens over every micro-batch and rank (as fairseq).
        Lightning divided each micro-batch's loss by the accumulation and DDP/FSDP average the ranks: undone here."""
        (tokens, flops), self._host = self._host, [0, 0.0]
        (sums, self._sums), counts = (self._sums, None), [float(self.signal == s) for s in SIGNALS]
        elapsed = self.training_clock() if trainer.global_rank == 0 else 0.0
        self._buffer.copy_(torch.tensor([tokens, flops, elapsed, *counts], dtype=torch.float64))
        # float64: token totals exact far past float32's 2^24; a pinned copy does not wait for the device
        values = torch.cat([self._buffer.to(trainer.strategy.root_device, non_blocking=True), sums.double()])
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        # torch's multi-tensor ops (one kernel for every gradient) have no public name yet; the optimizers use them
        if trainer.world_size == 1:
            torch._foreach_mul_(grads, trainer.accumulate_grad_batches / max(tokens, 1))  # a host number
        else:
            torch.distributed.all_reduce(values)
            scale = (trainer.accumulate_grad_batches * trainer.world_size / values[0].clamp(min=1)).float()
            torch._foreach_mul_(grads, scale)  # on the gradients' device
        self.norm = norm = gradient_norm(module.parameters(), sharded=isinstance(trainer.strategy, LayerFSDP))
        if trainer.precision != "16-mixed":  # fp16's GradScaler skips such steps itself
            optimizer.found_inf = (~norm.isfinite()).float()  # fused Adam leaves weights and moments as they are
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
    """The one owner of an update's end, and of the stop signals (SIGTERM, SIGINT, SLURM's SIGUSR1): a signal is noted,
    the update's reduction carries it to every rank, the run stops after that update (fit.after_fit exits 128 + it)."""

    def __init__(self, progress=None, ema=None, saves=None):
        self.progress, self.ema, self.saves = progress, ema, saves
        self.received, self._handlers = 0, {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.updates, self.budget = module.updates, getattr(module, "budget", None)
        if self.budget is not None:
            self.budget.begin(trainer, module.updates.totals["train_seconds"])
        # Lightning's SIGTERM handler (registered as fit starts) stops inside an accumulation window and exits 0.
        self._handlers = {signum: signal.signal(signum, self.note) for signum in SIGNALS}
        # Stands in for a switch that turns Lightning's SIGTERM check off (there is none): under DDP a broadcast and a
        # wait for the device before every micro-batch, for a SIGTERM that its replaced handler would have noted.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
        if trainer.received_sigterm:  # came as the run started (restoring, the sanity check): Lightning's handler
            # Stands in for a setter of Trainer.received_sigterm: Lightning would exit 0 at the first micro-batch.
            trainer._signal_connector.received_sigterm = False
            self.note(signal.SIGTERM, None)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        update = module.updates.end(trainer)  # the update's one wait for the device
        if update is None:  # inside an accumulation window
            return
        if trainer.precision != "16-mixed" and not math.isfinite(update.grad_norm):
            raise TrainingDiverged(  # its step was skipped on the device: every checkpoint stays finite
                f"training diverged at update {update.step}: the gradient norm is {update.grad_norm} (optim.lr_factor "
                "too high? fp16 overflow: trainer.precision=bf16-mixed?); the checkpoints written so far are finite"
            )
        tokens = self.updates.totals["target_tokens"]
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

    def note(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:  # a second Ctrl+C: now, still 128 + SIGINT
            log.warning("received SIGINT again: stopping now, inside the update; the newest checkpoint holds the run")
            raise SystemExit(128 + signal.SIGINT)
        if not self.received:
            again = "; press Ctrl+C again to stop at once" if signum == signal.SIGINT else ""
            log.warning(f"received {signal.Signals(signum).name}: stopping at the end of the update in progress{again}")
        self.received = self.updates.signal = signum

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.teardown(trainer, module, "fit")
        # a signal noted after the last update's reduction: every rank's, reduced once more
        signum = int(trainer.strategy.reduce(torch.tensor([self.received], device=module.device), reduce_op="max"))
        if signum and "stopped_by_signal" not in trainer.callback_metrics:
            trainer.callback_metrics["stopped_by_signal"] = torch.tensor(float(signum))

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        for signum, handler in self._handlers.items():  # the handlers from before the run
            signal.signal(signum, handler)
        self._handlers = {}

    on_exception = teardown  # Lightning calls no teardown hook then (the exception in `stage`'s place)


def gradient_norm(parameters, sharded: bool) -> Tensor:
    """The L2 norm of the whole gradient; sharded (FSDP), summed over the ranks' parts, so every rank has the same."""
    grads = [local(p.grad) for p in parameters if p.grad is not None]
    grads = [g for g in grads if g.numel()]  # a rank may hold none of a small parameter
    norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())  # one fused kernel
    if sharded:  # LayerFSDP always has a process group
        squares = norm.float().square()
        torch.distributed.all_reduce(squares)
        return squares.sqrt()
    return norm.float()


def log_update(trainer: L.Trainer, update: Update) -> None:
    """Host numbers to every logger at trainer.log_every_n_steps (self.log would build device tensors)."""
    every, tokens = trainer.log_every_n_steps, max(update.tokens, 1)
    if not every or update.step % every:
        return
    optimizer, nll = trainer.optimizers[0], update.nll_sum / tokens
    metrics = {"train/loss": update.loss_sum / tokens, "train/nll": nll, "train/ppl": math.exp(min(nll, 700.0))}
    metrics |= {"train/grad_norm": update.grad_norm, f"lr-{type(optimizer).__name__}": optimizer.param_groups[0]["lr"]}
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=update.step - 1)  # Lightning's step: the updates before this one


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning validates right after this batch: the epoch loop's _should_check_val_fx, from public
    attributes, for validations counted in batches or epochs (check_config refuses a time)."""
    loop, every_epoch = trainer.fit_loop.epoch_loop, trainer.check_val_every_n_epoch
    if not trainer.enable_validation or (every_epoch and (trainer.current_epoch + 1) % every_epoch):
        return False
    if trainer.should_stop or trainer.val_check_batch == float("inf"):
        return trainer.should_stop or loop.batch_progress.is_last_batch
    batches = loop.total_batch_idx if every_epoch is None else loop.batch_idx
    return (batches + 1) % trainer.val_check_batch == 0
