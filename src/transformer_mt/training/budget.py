"""trainer.max_time as a time budget that the schedule fits (docs/training.md, time budgets).

A schedule sized in updates for a faster machine is cut wherever the clock stops it: on a CPU without AVX-512 the
Multi30k recipe stopped at its peak learning rate, right after warmup, 10 BLEU below the same recipe on a faster
CPU. Budgeted training (Li, Yumer and Ramanan, ICLR 2020) ends the schedule with the budget instead. So a run with
a budget measures its speed over its first updates, fixes its horizon once (how many updates fit the rest of the
budget, less a margin, at most trainer.max_steps), and then follows objective.budget_lr to that horizon: the
Noam schedule with its warmup a share of the horizon, and a linear cool-down to near zero at its end. Where the
cool-down begins, the horizon is corrected once with the speed since it was fixed (a laptop that throttles, a
machine that other work slows down): the cool-down then ends with the budget. Its
periodic checkpoints are spaced so that the last checkpoint.keep_last of them span the end of the schedule (what
the end-of-run protocol averages).

The budget counts training: the update clock (training/update.py: rank 0's seconds of training over every attempt
of the run, validations left out, carried in checkpoints), never the start-up, validations, a stop, or the
end-of-run protocol. Every decision is taken on that clock and the update count, the same on every rank, at an
update's end: the horizon, and the stop when the budget runs out first. The horizon travels in the checkpoints
(the learning-rate scheduler's state): a resumed run follows the same schedule, bit for bit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import timedelta

import lightning as L

from transformer_mt.errors import InputError
from transformer_mt.objective import budget_lr
from transformer_mt.runtime import duration
from transformer_mt.training import update as bookkeeping
from transformer_mt.training.saving import stop_after_this_update
from transformer_mt.training.update import Update

log = logging.getLogger(__name__)

MEASURE_FROM = 10  # updates: the first ones pay for allocations, caches and warm-up, not for training
MEASURE_UPDATES = 20  # the horizon is fixed after at least this many measured updates ...
MEASURE_SHARE = 0.03  # ... and at least this share of the budget (a CPU still speeds up over its first minute)


def budget_seconds(max_time) -> float | None:
    """trainer.max_time as Lightning takes it ("DD:HH:MM:SS", or {days:, hours:, minutes:, seconds:}) -> seconds."""
    if max_time is None:
        return None
    try:
        if isinstance(max_time, str):
            days, hours, minutes, seconds = (int(part) for part in max_time.strip().split(":"))
            max_time = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        elif isinstance(max_time, dict):
            max_time = timedelta(**max_time)
    except (ValueError, TypeError):
        max_time = None
    if not isinstance(max_time, timedelta) or max_time.total_seconds() <= 0:
        raise InputError(
            f"trainer.max_time={max_time!r}: a time budget is DD:HH:MM:SS (e.g. 00:00:26:00 for 26 minutes of "
            "training), or null for none"
        )
    return max_time.total_seconds()


@dataclass
class BudgetSchedule:
    """The learning rate of a budgeted run, as LambdaLR's multiplier of lr = 1 (the module's). A callable object,
    not a function: LambdaLR keeps its fields in every checkpoint, so a resume continues the same schedule.

    Until the horizon is fixed, the warmup climbs as it would for the longest horizon (`provisional_warmup`
    updates to the peak); once fixed after update `fixed_at`, objective.budget_lr: from that update's rate up to
    the peak at warmup_share x horizon, Noam's decay, and over the last cooldown_share a line to 0 one update after
    the horizon."""

    peak: float
    warmup_share: float
    cooldown_share: float
    provisional_warmup: int
    horizon: int | None = None
    fixed_at: int = 0
    fixed_rate: float = 0.0
    peak_at: int | None = None  # the warmup's end, a share of the horizon as fixed (a refit leaves it)
    cool_from: int | None = None  # where the cool-down began, once the horizon was corrected there (refit)

    def __call__(self, done: int) -> float:
        """The rate of update done + 1 (LambdaLR counts the updates done)."""
        step = done + 1
        if self.horizon is None or step <= self.fixed_at:
            return self.peak * min(step / self.provisional_warmup, 1.0)
        return budget_lr(
            step, (self.fixed_at, self.fixed_rate), (self.warmup, self.peak), self.horizon, self.cooldown_start
        )

    def fix(self, step: int, horizon: int) -> None:
        """The horizon, fixed after update `step`: the updates after it follow the budget's schedule."""
        self.fixed_rate, self.fixed_at, self.horizon = self(step - 1), step, horizon
        self.peak_at = max(1, round(self.warmup_share * horizon))

    def refit(self, step: int, horizon: int) -> None:
        """The horizon, corrected where the cool-down begins (update `step`): the cool-down goes on from this update's
        rate, with no jump, down to 0 one update after the new horizon (at least one update after `step`)."""
        self.cool_from, self.horizon = step, max(horizon, step + 1)

    @property
    def cooldown_start(self) -> int:
        """The update after which the cool-down begins: cooldown_share of the horizon before its end, or where a
        refit began it."""
        return self.cool_from or self.horizon - round(self.cooldown_share * self.horizon)

    @property
    def warmup(self) -> int:
        return (
            (self.peak_at or max(1, round(self.warmup_share * self.horizon)))
            if self.horizon
            else self.provisional_warmup
        )


def horizon(step: int, clock: float, rate: float, budget: float, margin: float, ceiling: int) -> int:
    """The last update of the schedule: those that fit the rest of the budget at `rate` updates per second, less
    `margin` of that time, after update `step` at `clock` seconds of training; at most `ceiling` (max_steps, if > 0)."""
    fits = step + math.floor(max(budget - clock, 0.0) * (1 - margin) * rate)
    return min(fits, ceiling) if ceiling > 0 else fits


class TimeBudget(L.Callback):
    """trainer.max_time: measures the speed, fixes the horizon (the module's BudgetSchedule and the loop's
    max_steps), spaces the periodic checkpoints to span its end, and stops the run if the budget runs out first."""

    def __init__(self, seconds: float, margin: float, average_span: float, keep_last: int):
        self.seconds, self.margin, self.average_span, self.keep_last = seconds, margin, average_span, keep_last
        self.measured_from: tuple[int, float] | None = None  # (update, clock) where the speed's measurement began
        self.fixed: tuple[int, float] | None = None  # (update, clock) where the horizon was fixed
        self.ran_out: Update | None = None  # the update at which the budget ran out before the horizon
        self.clock = 0.0  # the update clock at the latest update (seconds of training, every attempt)

    def state_dict(self) -> dict:
        return {"measured_from": self.measured_from, "fixed": self.fixed}

    def load_state_dict(self, state: dict) -> None:
        self.measured_from, self.fixed = state["measured_from"], state.get("fixed")

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.schedule: BudgetSchedule = module.schedule
        self.ceiling = trainer.max_steps  # the configured max_steps: the horizon never passes it
        self.clock = module.updates.totals["train_seconds"]
        if self.schedule.horizon is not None:  # a resume: the horizon its run fixed
            self.apply(trainer)
        if trainer.is_global_zero:
            used = f", {duration(self.clock)} used" if self.clock else ""
            fixed = (
                f"the schedule ends at update {self.schedule.horizon:,} (fixed at update {self.schedule.fixed_at:,})"
                if self.schedule.horizon is not None
                else f"its end is fixed once {MEASURE_FROM + MEASURE_UPDATES} updates have measured the speed"
            )
            log.info("time budget: %s of training (trainer.max_time; validations not counted)%s; %s",
                     duration(self.seconds), used, fixed)  # fmt: skip

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        update = module.updates.finished(trainer)
        if update is None:  # inside an accumulation window
            return
        self.clock = update.clock
        if self.schedule.horizon is None:
            self.measure(trainer, update)
        elif self.schedule.cool_from is None and update.step >= self.schedule.cooldown_start:
            self.refit(trainer, update)
        if update.clock >= self.seconds and update.step < trainer.max_steps and not trainer.should_stop:
            self.ran_out = update
            stop_after_this_update(trainer)

    def measure(self, trainer: L.Trainer, update: Update) -> None:
        if self.measured_from is None:
            if update.step >= MEASURE_FROM:
                self.measured_from = (update.step, update.clock)
            return
        start, began = self.measured_from
        measured = update.clock - began
        if update.step - start < MEASURE_UPDATES or measured < MEASURE_SHARE * self.seconds or measured <= 0:
            return
        rate = (update.step - start) / measured
        end = horizon(update.step, update.clock, rate, self.seconds, self.margin, self.ceiling)
        self.schedule.fix(update.step, end)
        self.fixed = (update.step, update.clock)
        self.apply(trainer)
        self.log_next_rate(trainer)
        if trainer.is_global_zero:
            tokens = update.tokens / max(update.seconds, 1e-9)
            limit = " (trainer.max_steps)" if end == self.ceiling else ""
            log.info(
                "time budget %s: ~%s updates at %s updates/min (%s target tok/s at update %s), %s of it left; "
                "schedule: warmup %s to %.3g, Noam's decay, from update %s a linear cool-down to 0 at update %s%s; "
                "checkpoints every %s updates",
                duration(self.seconds), f"{end:,}", f"{60 * rate:,.1f}", f"{tokens:,.0f}", f"{update.step:,}",
                duration(self.seconds - update.clock), f"{self.schedule.warmup:,}", self.schedule.peak,
                f"{self.schedule.cooldown_start:,}", f"{end:,}", limit, self.every,
            )  # fmt: skip

    def refit(self, trainer: L.Trainer, update: Update) -> None:
        """Where the cool-down begins: the horizon again, from the speed since it was fixed (all that runs at each
        update counted: checkpoints, logs, the machine's own drift), so that the cool-down ends inside the budget."""
        (start, began), planned = self.fixed or (self.schedule.fixed_at, 0.0), self.schedule.horizon
        rate = (update.step - start) / max(update.clock - began, 1e-9)
        self.schedule.refit(
            update.step, horizon(update.step, update.clock, rate, self.seconds, self.margin, self.ceiling)
        )
        self.apply(trainer)
        self.log_next_rate(trainer)
        end = self.schedule.horizon
        if trainer.is_global_zero and end != planned:
            log.info(
                "time budget %s: %s updates/min since update %s, so the cool-down from update %s ends at update %s "
                "(planned: %s), %s of the budget left",
                duration(self.seconds), f"{60 * rate:,.1f}", f"{start:,}", f"{update.step:,}", f"{end:,}",
                f"{planned:,}", duration(self.seconds - update.clock),
            )  # fmt: skip

    def apply(self, trainer: L.Trainer) -> None:
        """The horizon becomes the loop's max_steps (progress, ETA and the final last.ckpt follow it); the update
        checkpoints come every `every` updates, the last keep_last of them ending at the horizon; the next update's
        rate is the schedule's as now fixed (the scheduler stepped before this update's end, by the old one)."""
        end = self.schedule.horizon
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = base * self.schedule(scheduler.last_epoch)
        trainer.fit_loop.epoch_loop.max_steps = end
        self.every = max(1, round(self.average_span * end / max(self.keep_last, 1)))
        for callback in trainer.checkpoint_callbacks:
            if hasattr(callback, "align"):
                callback.align(self.every, end)

    @staticmethod
    def log_next_rate(trainer: L.Trainer) -> None:
        """This update's logged rate of the next one was the old schedule's (logged as the update ended, before
        this hook): logged again, as applied (a logger keeps the later value of a step)."""
        if bookkeeping.logs_this_update(trainer):
            bookkeeping.log_metrics(trainer, bookkeeping.next_rate(trainer))

    def remaining(self) -> float:
        return max(self.seconds - self.clock, 0.0)

    def advice(self, trainer: L.Trainer) -> str | None:
        """Why the run ended before its schedule, and what to change (RunEnd's warning); None if it did not."""
        if self.ran_out is None:
            return None
        done, end = self.ran_out.step, trainer.max_steps
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        return (
            f"the time budget ({duration(self.seconds)} of training) ran out at update {done:,}, {done / end:.0%} of "
            f"the schedule's {end:,}: the learning rate is {lr:.3g} (peak {self.schedule.peak:.3g}), not near 0. The "
            "machine trained slower than at the start (other work on it?); on a quiet machine, or in a new run with a "
            "larger trainer.max_time or budget.margin, the schedule ends inside the budget"
        )


def time_budget(trainer: L.Trainer) -> TimeBudget | None:
    return next((c for c in trainer.callbacks if isinstance(c, TimeBudget)), None)


def schedule_cut(trainer: L.Trainer) -> str | None:
    """One line when training ended before its schedule did (the time budget ran out first, early stopping,
    max_epochs): how far it got, and what to change; None when the schedule ended."""
    done, end = trainer.global_step, trainer.max_steps
    if end <= 0 or done >= end:
        return None
    budget = time_budget(trainer)
    advice = budget.advice(trainer) if budget is not None else None
    if advice:
        return advice
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    return (
        f"training ended at update {done:,}, {done / end:.0%} of its schedule's {end:,} (trainer.max_steps), at "
        f"learning rate {lr:.3g} (early stopping, or trainer.max_epochs): the schedule did not end"
    )
