"""What a training run tells a person and how it ends: progress lines, the start-up line, the update bar,
and a summary of what to do next, or, stopped by a signal, how to continue."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_only

from transformer_mt.files import RunFolder
from transformer_mt.runtime import Peak, device_peak, duration, flops_text
from transformer_mt.training import update as bookkeeping
from transformer_mt.training.budget import schedule_cut, time_budget
from transformer_mt.training.saving import UpdateCheckpoint, stop_after_this_update

log = logging.getLogger(__name__)


WINDOW_LOSS = "train/loss_window"  # the mean loss per target token of each progress line's window (every rank's)
THROUGHPUT = "train/tgt_tok_per_s"  # target tokens per second of training over each progress line's window


class ProgressLog(L.Callback):
    """A line every `every` updates or `every_seconds` of training, whichever comes first (a slow machine
    shows life within a minute), and after each validation, readable in a file or a cluster log:
    update/max, mean loss since the last line (logged too, as train/loss_window), learning rate, target
    tokens/s, model FLOP/s and MFU (their share of the devices' peak: runtime.device_peak, named once at the
    start; raised to what training reached if that is more: MFU never reads above 100%), elapsed and ETA.
    At the start, a warning names the validations and checkpoints that will not come before max_steps.

    A finite divergence (the loss of a line RISE times its best so far) is warned about once, with the
    update and the likely causes; training goes on (a non-finite gradient stops it, update.py)."""

    RISE = 3.0
    NEAR, REPROBES = 0.9, 3  # a CPU's peak is measured again when training reaches NEAR x it, at most REPROBES times

    def __init__(self, every: int, every_seconds: float = 0.0):
        self.every, self.every_seconds = every, every_seconds
        self.reprobes = self.REPROBES
        self.best_loss, self.warned = float("inf"), False
        self.peak: Peak | None = None  # rank 0's, found when training starts (None in ddp_spawn's main process)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.peak = device_peak(trainer.strategy.root_device, trainer.precision)
            log.info("MFU: model FLOP/s (model.training_flops) per device over %s", self.peak.source)
            if self.peak.disturbed:
                log.warning(
                    "the peak FLOP/s probe looked disturbed (its products took up to %.1fx the fastest: other work "
                    "on the CPU?); MFU may read high, and the peak is raised if training runs faster than it",
                    self.peak.spread,
                )
            for warning in unreached(trainer):
                log.warning("%s", warning)
        self.start = self.since = bookkeeping.clock()  # the update's clock (tests drive it)
        self.first_step = self.since_step = trainer.global_step
        self.loss_sum, self.tokens, self.flops, self.paused = 0.0, 0, 0.0, 0.0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        update = module.updates.finished(trainer)  # host numbers of every rank, read at the update's one wait
        if update is None:
            return
        self.loss_sum += update.loss_sum
        self.tokens += update.tokens
        self.flops += update.flops
        due = self.every_seconds and bookkeeping.clock() - self.since >= self.every_seconds
        if (self.every and update.step % self.every == 0) or due:
            self.report(trainer)

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.validation_start = bookkeeping.clock()

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self.paused += bookkeeping.clock() - self.validation_start  # tokens/s counts training time only
        if trainer.global_step != self.since_step:
            self.report(trainer)

    @rank_zero_only
    def report(self, trainer: L.Trainer) -> None:
        now, step = bookkeeping.clock(), trainer.global_step
        elapsed, rate = now - self.start, (step - self.first_step) / max(now - self.start, 1e-9)
        parts = [
            f"update {step:,}"
            + (f"/{trainer.max_steps:,} ({step / trainer.max_steps:.0%})" if trainer.max_steps > 0 else "")
        ]
        seconds = max(now - self.since - self.paused, 1e-9)
        metrics = {}
        if self.tokens:
            loss = self.loss_sum / self.tokens
            parts.append(f"loss {loss:.3f}")
            self.check_divergence(loss, step)
            metrics[WINDOW_LOSS] = loss  # make plot's training curve: this mean, not one micro-batch's loss
        parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.3g}")
        metrics[THROUGHPUT] = self.tokens / seconds  # every rank's tokens
        parts.append(f"{metrics[THROUGHPUT]:,.0f} target tok/s")
        mfu = self.utilisation(self.flops / trainer.world_size / seconds)
        parts.append(flops_text(self.flops / seconds) + (f", MFU {mfu:.1%}" if mfu else ""))
        if mfu:
            metrics["train/mfu"] = mfu
        for logger in trainer.loggers:  # throughput reaches the loggers here only, at the lines' pace
            logger.log_metrics(metrics, step=step - 1)  # Lightning's step: updates before this one
        parts.append(f"elapsed {duration(elapsed)}")
        eta = eta_seconds(trainer, step, rate)
        if eta is not None:
            parts.append(f"ETA {duration(eta)}")
        log.info(" | ".join(parts))
        self.since, self.since_step = now, step
        self.loss_sum, self.tokens, self.flops, self.paused = 0.0, 0, 0.0, 0.0

    def utilisation(self, flops_per_second: float) -> float | None:
        """MFU of one device's model FLOP/s. A CPU's peak is measured again when training comes near it (a start
        disturbed by other work measures it too low; at most REPROBES times, ~1 s each), and the better kept;
        above the peak even then, the peak was too low: raised to them, said once."""
        near = self.peak and self.peak.fmt and self.peak.flops and flops_per_second > self.NEAR * self.peak.flops
        if near and self.reprobes:
            self.reprobes -= 1
            before, self.peak = self.peak, self.peak.remeasured()
            if self.peak is not before:
                log.info("the peak FLOP/s measured again: %s (was %s: other work on the CPU at the start?)",
                         flops_text(self.peak.flops), flops_text(before.flops))  # fmt: skip
        if self.peak and self.peak.flops and flops_per_second > self.peak.flops:
            if not self.peak.source.endswith("training reached"):
                log.warning(
                    "model FLOP/s per device (%s) above the peak (%s): that peak is too low (a CPU's probe disturbed "
                    "by other work?); MFU is measured against the most training reached from here on",
                    flops_text(flops_per_second),
                    self.peak.source,
                )
            self.peak = self.peak.raised(flops_per_second)
        return self.peak.utilisation(flops_per_second) if self.peak else None

    def check_divergence(self, loss: float, step: int) -> None:
        self.best_loss = min(self.best_loss, loss)
        if loss > self.RISE * self.best_loss and not self.warned:
            self.warned = True
            log.warning(
                "the training loss (%.3f at update %s) is %.1fx its best so far (%.3f): the run may be diverging. "
                "Likely causes: a learning rate too high (optim.lr_factor, optim.warmup_steps), fp16 overflow "
                "(trainer.precision=bf16-mixed), or corrupt data. Training goes on; this warning comes once",
                loss,
                f"{step:,}",
                loss / self.best_loss,
                self.best_loss,
            )


class StartupLog(L.Callback):
    """One line when this process's first update is done: how long the start took, and where it went
    (building the data, then the model, trainer and first batches). At WMT14 scale a cold start spends
    minutes on SentencePiece and tokenization; a cached one should reach its first update in seconds."""

    def __init__(self, started: float):
        self.started, self.marks, self.first_step = started, {}, None

    def mark(self, event: str) -> None:
        self.marks[event] = time.monotonic() - self.started

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.mark("training loop started")
        self.first_step = trainer.global_step

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.first_step is not None and trainer.global_step > self.first_step:
            self.first_step = None
            since = ", ".join(f"{event} at {seconds:.1f} s" for event, seconds in self.marks.items())
            log.info("first update done %.1f s after the start (%s)", time.monotonic() - self.started, since)


def eta_seconds(trainer: L.Trainer, step: int, updates_per_second: float) -> float | None:
    """Time left until max_steps (a budget's horizon, once fixed) at the rate so far, or until the time budget
    runs out if that comes first."""
    candidates = []
    if trainer.max_steps > 0 and updates_per_second > 0:
        candidates.append((trainer.max_steps - step) / updates_per_second)
    budget = time_budget(trainer)
    if budget is not None:
        candidates.append(budget.remaining())
    return min(candidates) if candidates else None


def unreached(trainer: L.Trainer) -> list[str]:
    """Warnings for what will not come between this run's first update and max_steps: a validation (no val/
    curves to plot, no best.ckpt), a periodic checkpoint by update count (only last.ckpt, nothing to average)."""
    step, last = trainer.global_step, trainer.max_steps
    if last <= 0:
        return []
    found, suggest = [], max(1, (last - step) // 2)
    if isinstance(trainer.val_check_interval, int) and trainer.limit_val_batches:
        every = trainer.val_check_interval // trainer.accumulate_grad_batches  # micro-batches -> updates
        if last // every == step // every:
            found.append(
                f"no validation before trainer.max_steps={last} (trainer.val_check_interval={every} updates): no "
                f"validation curves for make plot, no best.ckpt; to validate, add trainer.val_check_interval={suggest}"
            )
    periodic = [c for c in trainer.checkpoint_callbacks if isinstance(c, UpdateCheckpoint)]
    if periodic and all(c.every and last // c.every == step // c.every for c in periodic):
        found.append(
            f"no periodic checkpoint before trainer.max_steps={last} (checkpoint.every_n_train_steps="
            f"{periodic[0].every}): only last.ckpt, nothing to average; add checkpoint.every_n_train_steps={suggest}"
        )
    return found


class UpdateProgressBar(TQDMProgressBar):
    """One bar over the whole run, counted in optimizer updates (max_steps), not one per epoch.

    Only on a terminal: written to a file, a bar is noise; ProgressLog's lines say the same there.
    """

    def __init__(self):
        super().__init__()
        if not sys.stdout.isatty():
            self.disable()

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_train_start(trainer, module)
        bar = self.train_progress_bar
        bar.total = trainer.max_steps if trainer.max_steps > 0 else None
        bar.n = bar.initial = trainer.global_step  # a resumed run starts where it stopped
        bar.unit = "update"

    def on_train_epoch_start(self, trainer: L.Trainer, *_) -> None:
        self.train_progress_bar.set_description(f"training (epoch {trainer.current_epoch})")

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        update = module.updates.finished(trainer)
        if update is not None and self._should_update(update.step, self.train_progress_bar.total or 0):
            self.train_progress_bar.n = update.step
            rate = update.tokens / max(update.seconds, 1e-9)  # host numbers: no metric of Lightning's is converted
            self.train_progress_bar.set_postfix({**self.get_metrics(trainer, module), "loss": f"{update.loss:.3f}",
                                                 "tok/s": f"{rate:,.0f}"})  # fmt: skip

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        pass  # the bar spans epochs

    def get_metrics(self, trainer: L.Trainer, module: L.LightningModule) -> dict:
        metrics = super().get_metrics(trainer, module)
        metrics.pop("v_num", None)
        return metrics  # validation's (val/loss, val/bleu)


def shown(path: Path) -> str:
    """A path relative to the working directory when it is below it (what a user types)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class RunEnd(L.Callback):
    """How a run ends, in every process that trained (also ddp_spawn's workers): on rank 0 a summary of the
    checkpoints with the commands that use them (last.ckpt, the final state, is saving.py's).

    A stop signal (SIGTERM from a scheduler, `timeout` or `kill`; SIGINT from Ctrl+C; under SLURM the
    requeue signal, SIGUSR1) ends the run at the end of the update in progress: last.ckpt is written at
    that update boundary, the log says how to continue, and the signal goes to train() through
    callback_metrics["stopped_by_signal"] (which ddp_spawn's workers hand back too), so that it exits
    with 128 + its number (143, 130), never 0. All ranks stop at the same update: with several processes,
    the signal is reduced with the update's token count and read at the update's one wait (update.py), so a
    signal noted after that is acted on an update later (or at the end of training). A second Ctrl+C stops
    at once.

    summary_later: the end-of-run protocol follows training (fit.after_fit), which gives the summary after it,
    so that the run's last lines are its results and the commands (no `make average` before its averaging)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, checkpoint_dir: Path, keep_last: int, summary_later: bool = False):
        self.checkpoint_dir, self.keep_last, self.summary_later = checkpoint_dir, keep_last, summary_later
        self.received: int = 0  # the stop signal's number, on this rank
        self.stopped_by: signal.Signals | None = None  # the signal every rank stopped for
        self._handlers: dict = {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # Replaces Lightning's own SIGTERM/SIGUSR1 handlers (registered when fit starts), which stop inside
        # an accumulation window and exit 0, or save mid-update: one handler that only takes note.
        self.module = module
        self._handlers = {signum: signal.signal(signum, self._note) for signum in self.SIGNALS}
        # Lightning's own check (a broadcast and a device sync before every micro-batch under DDP) looks for
        # the SIGTERM its replaced handler would have noted: never, here.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
        if trainer.received_sigterm:  # came while the run started (restore, sanity check): Lightning's handler
            trainer._signal_connector.received_sigterm = False  # would exit 0 at the first batch
            self._note(signal.SIGTERM, None)

    def _note(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:  # a second Ctrl+C: now, still 128 + SIGINT
            log.warning("received SIGINT again: stopping now, inside the update; the newest checkpoint holds the run")
            raise SystemExit(128 + signal.SIGINT)
        if not self.received:
            log.warning(
                "received %s: stopping at the end of the update in progress (last.ckpt is written there)%s",
                signal.Signals(signum).name,
                "; press Ctrl+C again to stop at once" if signum == signal.SIGINT else "",
            )
        self.received = signum
        self.module.updates.signal = signum

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        update = module.updates.finished(trainer)
        if update is None:  # inside an accumulation window: no signal to act on yet
            return
        if self._stop_signal(trainer, module, update.signal):
            stop_after_this_update(trainer)  # last.ckpt is written at this update; no validation that was not due

    def _stop_signal(self, trainer: L.Trainer, module: L.LightningModule, received: int | None = None) -> bool:
        """Whether any rank received a stop signal; every rank gets the same answer: the update's (its one
        wait carries it), or with received=None this rank's, all-reduced once more (at the end of training)."""
        if received is None:
            received = self.received
            if trainer.world_size > 1:
                flag = torch.tensor([received], device=module.device)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
                received = int(flag.item())
        if received:
            self.stopped_by = signal.Signals(received)
            # for train(), also when this runs in ddp_spawn's workers (their callback_metrics come back)
            trainer.callback_metrics["stopped_by_signal"] = torch.tensor(float(received))
        return bool(received)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.teardown(trainer, module, "fit")  # the handlers from before the run
        if self.stopped_by is None:  # a signal noted after the last update's decision
            self._stop_signal(trainer, module)
        if not trainer.is_global_zero:
            return
        if self.stopped_by is not None:
            log.warning(
                "stopped by %s after update %s; last.ckpt holds it. Continue with the same CONFIG and ARGS plus: "
                "ckpt_path=last hydra.run.dir=%s",
                self.stopped_by.name,
                f"{trainer.global_step:,}",
                self.checkpoint_dir.parent,
            )
            return
        if cut := schedule_cut(trainer):
            log.warning("%s", cut)
        if not self.summary_later:
            self.log_summary(trainer, trainer.global_step)

    def log_summary(self, trainer: L.Trainer, updates: int) -> None:
        """Where the checkpoints are and the commands that use them (rank 0)."""
        # best.ckpt of this run only: a resumed run restores the best path of the run it came from
        best = next((c for c in trainer.checkpoint_callbacks if getattr(c, "filename", None) == "best"), None)
        if best is None or best.best_model_score is None or Path(best.best_model_path).parent != self.checkpoint_dir:
            best = None
        summary = next_steps(
            self.checkpoint_dir.parent,
            self.checkpoint_dir,
            self.keep_last,
            (best.monitor, float(best.best_model_score)) if best else None,
        )
        log.info("finished after %s updates; next:\n%s", f"{updates:,}", summary)

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers = {}


def requeue_slurm_job() -> None:
    """`scontrol requeue <job>`: SLURM starts the job again later, with the same job id, hence the same
    run folder (outputs/slurm-<job>-<step>), and train.py continues it from last.ckpt by itself. Called
    last, once the run has ended (SLURM then signals every task of the job)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        log.warning("SIGUSR1 outside a SLURM job: stopped, nothing requeued")
        return
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not requeue SLURM job %s (%s): continue it by hand with ckpt_path=last", job, e)
        return
    if done.returncode == 0:
        log.info("requeued SLURM job %s: it continues from last.ckpt when it starts again", job)
    else:
        log.warning(
            "scontrol requeue %s failed (%s): continue it by hand with ckpt_path=last", job, done.stderr.strip()
        )


def next_steps(run_dir: Path, checkpoint_dir: Path, keep_last: int, best: tuple[str, float] | None) -> str:
    """The end of a run: where its checkpoints are and the commands that use them."""
    periodic = sorted(p.name for p in checkpoint_dir.glob("*step*.ckpt"))
    lines = [
        f"checkpoints in {shown(checkpoint_dir)}: last.ckpt"
        + (f", best.ckpt ({best[0]} {best[1]:.2f})" if best else "")
        + (f", {len(periodic)} periodic ({periodic[0]} ... {periodic[-1]})" if periodic else "")
    ]
    if periodic:
        n = min(keep_last, len(periodic))
        model = checkpoint_dir / RunFolder.average_name(n)
        if not model.is_file():  # the end-of-run protocol wrote it
            lines.append(f"  make average RUN={shown(run_dir)} N={n}")
    else:
        model = checkpoint_dir / (RunFolder.BEST if best else RunFolder.LAST)
    lines.append(f"  make evaluate CKPT={shown(model)}")
    lines.append(f'  echo "A sentence to translate." | make translate CKPT={shown(model)}')
    return "\n".join(lines)
