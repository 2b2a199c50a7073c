"""What a training run tells a person: progress lines, the start-up line, the update bar, and how it ended."""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from transformer_mt.files import RunFolder, next_commands, shown
from transformer_mt.runtime import Peak, device_peak, duration, flops_text
from transformer_mt.training import update as bookkeeping
from transformer_mt.training.update import Update

log = logging.getLogger(__name__)


class StartupLog:
    """How long the start took, and where it went (a cold WMT14 start spends minutes on SentencePiece)."""

    def __init__(self, started: float):
        self.started, self.marks = started, {}

    def mark(self, event: str) -> None:
        self.marks[event] = time.monotonic() - self.started

    def line(self) -> str:
        since = ", ".join(f"{event} at {seconds:.1f} s" for event, seconds in self.marks.items())
        return f"first update done {time.monotonic() - self.started:.1f} s after the start ({since})"


class ProgressLog(L.Callback):
    """A line every `every` updates or `every_seconds` of training, whichever comes first, and after each validation
    (update/max, loss, lr, target tok/s, FLOP/s and MFU, elapsed, ETA)."""

    def __init__(self, every: int, every_seconds: float = 0.0, startup: StartupLog | None = None, bar=None):
        self.every, self.every_seconds, self.startup, self.bar = every, every_seconds, startup, bar
        self.peak: Peak | None = None  # rank 0's, found when training starts (None in ddp_spawn's main process)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.startup is not None:
            self.startup.mark("training loop started")
        if trainer.is_global_zero:
            self.peak = device_peak(trainer.strategy.root_device, trainer.precision)
            if self.peak.flops:
                log.info("MFU: model FLOP/s (model.training_flops) per device over %s", self.peak.source)
            else:
                log.info("MFU: %s", self.peak.source)
        self.start, self.first_step = bookkeeping.clock(), trainer.global_step
        self.since = self.clock = self.clock_start = module.updates.totals["train_seconds"]  # the update clock
        self.since_step, self.loss_sum, self.tokens, self.flops = trainer.global_step, 0.0, 0, 0.0
        self.validations: list[float] = []  # seconds each validation of this attempt took (for the ETA)

    def after_update(self, trainer: L.Trainer, update: Update) -> None:
        if self.startup is not None and trainer.is_global_zero:
            log.info("%s", self.startup.line())
        self.startup = None
        self.loss_sum += update.loss_sum
        self.tokens += update.tokens
        self.flops += update.flops
        self.clock = update.clock
        due = self.every_seconds and update.clock - self.since >= self.every_seconds  # seconds of training
        if due or (self.every and update.step % self.every == 0):
            self.report(trainer)
        if self.bar is not None:
            self.bar.after_update(trainer, update)

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self.validation_began = bookkeeping.clock()
        if trainer.is_global_zero:
            sentences = module.hparams.get("val_bleu_sentences")
            bleu = f" and greedy BLEU of its first {sentences:,} sentences" if sentences else ""
            log.info(f"validating after update {trainer.global_step:,}: the loss on the validation split{bleu}")

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self.validations.append(bookkeeping.clock() - self.validation_began)
        if trainer.global_step != self.since_step:
            self.report(trainer, validated=True)

    def report(self, trainer: L.Trainer, validated: bool = False) -> None:
        step, seconds = trainer.global_step, max(self.clock - self.since, 1e-9)  # of training: validations left out
        if trainer.is_global_zero:
            now = bookkeeping.clock()
            end = f"/{trainer.max_steps:,} ({step / trainer.max_steps:.0%})" if trainer.max_steps > 0 else ""
            speed = self.tokens / seconds  # every rank's target tokens, over the line's window
            parts, metrics = [f"update {step:,}{end}"], {"train/tgt_tok_per_s": speed}
            if self.tokens:  # the window's mean loss: make plot's training curve
                metrics["train/loss_window"] = loss = self.loss_sum / self.tokens
                parts.append(f"loss {loss:.3f}")
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.3g}")
            parts.append(f"{speed:,.0f} target tok/s")
            mfu = self.peak.utilisation(self.flops / trainer.world_size / seconds) if self.peak else None
            parts.append(flops_text(self.flops / seconds) + (f", MFU {mfu:.1%}" if mfu else ""))
            if mfu:
                metrics["train/mfu"] = mfu
            bookkeeping.log_metrics(trainer, metrics, step - 1)  # throughput: here only, at the lines' pace
            parts.append(f"elapsed {duration(now - self.start)}")
            if (eta := self.eta(trainer, validated)) is not None:
                parts.append(f"ETA {duration(eta)}")
            log.info(" | ".join(parts))
        self.since, self.since_step, self.loss_sum, self.tokens, self.flops = self.clock, step, 0.0, 0, 0.0

    def eta(self, trainer: L.Trainer, validated: bool) -> float | None:
        """Seconds of training left (until max_steps at this attempt's training speed, or the time budget's end), and
        the validations still due (this update's too, unless `validated`) at the mean time of this attempt's."""
        step, budget = trainer.global_step, trainer.lightning_module.budget
        rate = (step - self.first_step) / max(self.clock - self.clock_start, 1e-9)  # updates per second of training
        left = [max(budget.seconds - budget.clock, 0.0)] if budget is not None else []
        left += [(trainer.max_steps - step) / rate] if trainer.max_steps > 0 and rate > 0 else []
        if not left:
            return None
        every = trainer.val_check_batch / trainer.lightning_module.accumulation  # updates between validations
        end = trainer.max_steps if trainer.max_steps > 0 else step
        done = step if validated else step - 1
        due = end // every - done // every if trainer.check_val_every_n_epoch is None and every >= 1 else 0
        mean = sum(self.validations) / len(self.validations) if self.validations else 0.0
        return min(left) + due * mean


class UpdateProgressBar(TQDMProgressBar):
    """One bar over the whole run in updates, only on a terminal."""

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

    def on_train_batch_end(self, *args) -> None:  # counted in updates (after_update), over every epoch
        pass

    on_train_epoch_start = on_train_epoch_end = on_train_batch_end

    def after_update(self, trainer: L.Trainer, update: Update) -> None:
        bar = self.train_progress_bar
        if self.is_enabled and (update.step % self.refresh_rate == 0 or update.step == bar.total):
            rate, loss = update.tokens / max(update.seconds, 1e-9), update.loss_sum / max(update.tokens, 1)  # no wait
            bar.n, metrics = update.step, self.get_metrics(trainer, trainer.lightning_module)
            metrics.pop("v_num", None)  # validation's (val/loss, val/bleu) remain
            bar.set_description(f"training (epoch {trainer.current_epoch})")
            bar.set_postfix({**metrics, "loss": f"{loss:.3f}", "tok/s": f"{rate:,.0f}"})


class RunEnd(L.Callback):
    """How a run ended, on rank 0: stopped by a signal, how to continue; else the next commands."""

    def __init__(self, checkpoint_dir: Path, keep_last: int, summary_later: bool = False):
        self.checkpoint_dir, self.keep_last, self.summary_later = checkpoint_dir, keep_last, summary_later

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        done, end, budget = trainer.global_step, trainer.max_steps, getattr(module, "budget", None)
        if not trainer.is_global_zero:
            return
        if (stopped := trainer.callback_metrics.get("stopped_by_signal")) is not None:
            log.warning(
                f"stopped by {signal.Signals(int(stopped)).name} after update {done:,}; last.ckpt holds it. Continue "
                f"with the same CONFIG and ARGS plus: ckpt_path=last hydra.run.dir={self.checkpoint_dir.parent}"
            )
            return
        if budget is not None and budget.ran_out is not None:
            log.warning("%s", budget.advice(trainer))
        elif done < end:  # the schedule did not end: early stopping, max_epochs
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            log.warning(
                f"training ended at update {done:,}, {done / end:.0%} of its schedule's {end:,} (trainer.max_steps), "
                f"at learning rate {lr:.3g} (early stopping, or trainer.max_epochs): the schedule did not end"
            )
        if not self.summary_later:
            self.log_summary(trainer, done)

    def log_summary(self, trainer: L.Trainer, updates: int) -> None:
        """Where the checkpoints are and the commands that use them."""
        folder, periodic = self.checkpoint_dir, sorted(p.name for p in self.checkpoint_dir.glob("*step*.ckpt"))
        # best.ckpt of this run only (a resumed run restores the best path of the run it came from)
        best = next((c for c in trainer.checkpoint_callbacks if getattr(c, "filename", None) == "best"), None)
        if best is None or best.best_model_score is None or Path(best.best_model_path).parent != folder:
            best = None
        lines = [
            f"checkpoints in {shown(folder)}: last.ckpt"
            + (f", best.ckpt ({best.monitor} {float(best.best_model_score):.2f})" if best else "")
            + (f", {len(periodic)} periodic ({periodic[0]} ... {periodic[-1]})" if periodic else "")
        ]
        model = folder / (RunFolder.BEST if best else RunFolder.LAST)
        if periodic:
            n = min(self.keep_last, len(periodic))
            model = folder / RunFolder.average_name(n)
            if not model.is_file():  # the end-of-run protocol wrote it
                lines.append(f"  make average RUN={shown(folder.parent)} N={n}")
        lines += next_commands(model)
        log.info("finished after %s updates; next:\n%s", f"{updates:,}", "\n".join(lines))
