"""trainer.max_time as a time budget that the schedule fits (Li, Yumer and Ramanan, ICLR 2020; docs/training.md):
the horizon fixed once from a measured speed, corrected once where the cool-down begins. Lightning-free."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from transformer_mt.errors import InputError
from transformer_mt.objective import budget_lr
from transformer_mt.runtime import duration
from transformer_mt.stops import end_after

if TYPE_CHECKING:
    import lightning as L

    from transformer_mt.training.update import Update

log = logging.getLogger(__name__)

MEASURE_FROM = 10  # updates: the first ones pay for allocations, caches and warm-up, not for training
MEASURE_UPDATES = 20  # the horizon is fixed after at least this many measured updates ...
MEASURE_SHARE = 0.03  # ... and at least this share of the budget (a CPU still speeds up over its first minute)
LAST_RAMP = 10  # updates: a horizon whose warmup would end before its fix still rises to the peak, over up to this many
STATE = ("measured_from", "fixed", "fixed_rate", "horizon", "peak_at", "cool_from")  # what a resume continues


def budget_seconds(max_time) -> float | None:
    """trainer.max_time ("DD:HH:MM:SS", or {days:, hours:, minutes:, seconds:}) -> seconds."""
    if max_time is None:
        return None
    units = ("days", "hours", "minutes", "seconds")
    try:
        parts = dict(zip(units, map(int, max_time.split(":")), strict=True)) if isinstance(max_time, str) else max_time
        seconds = timedelta(**parts).total_seconds()
    except (ValueError, TypeError):
        seconds = 0
    if seconds <= 0:
        raise InputError(f"trainer.max_time={max_time!r}: a time budget is DD:HH:MM:SS (e.g. 00:00:26:00), or null")
    return seconds


def horizon(step: int, clock: float, rate: float, budget: float, margin: float, ceiling: int) -> int:
    """The last update that fits the rest of the budget at `rate` updates/s, less `margin` of it; at most `ceiling`."""
    fits = step + math.floor(max(budget - clock, 0.0) * (1 - margin) * rate)
    return min(fits, ceiling) if ceiling > 0 else fits


@dataclass
class TimeBudget:
    """The budget, one object: the learning rate (`lr`), the loop's step limit (`horizon`) and the periodic
    checkpoints' spacing (`every`) read it; it travels in checkpoint["budget"]."""

    seconds: float  # of training, on the update clock
    margin: float  # budget.margin: the share of the time left that the horizon leaves unplanned
    warmup: float  # budget.warmup: the warmup's share of the horizon
    cooldown: float  # budget.cooldown: the cool-down's share, at the horizon's end
    average_span: float  # budget.average_span: the last keep_last periodic checkpoints span this share of it
    keep_last: int  # checkpoint.keep_last
    peak: float = 0.0  # the rate at the warmup's end (the module's: Noam's peak at optim.warmup_steps)
    ceiling: int = 0  # trainer.max_steps as configured: the horizon never passes it
    provisional: int = 1  # until the horizon is fixed, Noam's own warmup (optim.warmup_steps), whatever max_steps is
    measured_from: tuple[int, float, int] | None = None  # (update, clock, target tokens) where measuring began
    fixed: tuple[int, float] | None = None  # (update, clock) where the horizon was fixed
    fixed_rate: float = 0.0  # the rate of update fixed[0]
    horizon: int | None = None  # the schedule's last update
    peak_at: int | None = None  # the warmup's end, a share of the horizon as first fixed (a refit leaves it)
    cool_from: int | None = None  # where the cool-down began, once the horizon was corrected there (refit)
    clock = 0.0  # not fields, not kept: the update clock at the latest update, and ...
    ran_out = None  # ... the update at which the budget ran out before the horizon

    def resume(self, state: dict) -> None:
        """The schedule of the checkpoint's run, continued; the settings stay as configured now."""
        for name in STATE:
            setattr(self, name, state[name])

    def lr(self, done: int) -> float:
        """LambdaLR's multiplier for update done + 1: the provisional warmup until the horizon is fixed."""
        step = done + 1
        if self.horizon is None or step <= self.fixed[0]:
            return self.peak * min(step / self.provisional, 1.0)
        start, top = (self.fixed[0], self.fixed_rate), (self.peak_at, self.peak)
        return budget_lr(step, start, top, self.horizon, self.cooldown_start)

    def fix(self, step: int, clock: float, horizon: int) -> None:
        """The horizon, fixed after update `step`: the updates after it follow objective.budget_lr from its rate. A
        warmup that would have ended by then (a horizon under ~5x the fix) rises to the peak over the next updates."""
        self.fixed_rate, self.fixed, self.horizon = self.lr(step - 1), (step, clock), horizon
        ramp = max(1, min(LAST_RAMP, round(self.warmup * (horizon - step))))
        self.peak_at = max(self.planned_peak, step + ramp) if self.fixed_rate < self.peak else self.planned_peak

    @property
    def planned_peak(self) -> int:
        """The warmup's end, budget.warmup's share of the horizon."""
        return max(1, round(self.warmup * self.horizon))

    def refit(self, step: int, horizon: int) -> None:
        """The horizon, corrected where the cool-down begins: from this update's rate down to 0 one update after it."""
        self.cool_from, self.horizon = step, max(horizon, step + 1)

    @property
    def cooldown_start(self) -> int:
        return self.cool_from or self.horizon - round(self.cooldown * self.horizon)

    @property
    def every(self) -> int:
        """The periodic checkpoints' spacing: the last keep_last span average_span of the horizon."""
        return max(1, round(self.average_span * self.horizon / max(self.keep_last, 1)))

    def begin(self, trainer: L.Trainer, clock: float) -> None:
        """At the start of training: a resumed run's horizon becomes the loop's step limit again."""
        self.clock = clock
        if self.horizon is not None:
            end_after(trainer, self.horizon)
            end = f"the schedule ends at update {self.horizon:,} (fixed at update {self.fixed[0]:,})"
        else:
            end = f"its end is fixed once {MEASURE_FROM + MEASURE_UPDATES} updates have measured the speed"
        if trainer.is_global_zero:
            used = f", {duration(clock)} used" if clock else ""
            log.info(
                f"time budget: {duration(self.seconds)} of training (trainer.max_time; validations not counted)"
                f"{used}; {end}"
            )

    def after_update(self, trainer: L.Trainer, update: Update, tokens: int) -> bool:
        """Measures the speed (`tokens`: the run's target tokens so far), fixes the horizon, corrects it where the
        cool-down begins; True: the budget ran out."""
        self.clock = update.clock
        if self.horizon is None:
            self.measure(trainer, update, tokens)
        elif self.cool_from is None and update.step >= self.cooldown_start:
            self.correct(trainer, update)
        if update.clock >= self.seconds and update.step < trainer.max_steps:
            self.ran_out = update.step
        return self.ran_out is not None

    def measure(self, trainer: L.Trainer, update: Update, tokens: int) -> None:
        if self.measured_from is None:
            if update.step >= MEASURE_FROM:
                self.measured_from = (update.step, update.clock, tokens)
            return
        start, began, tokens_before = self.measured_from
        measured = update.clock - began
        if update.step - start < MEASURE_UPDATES or measured < MEASURE_SHARE * self.seconds:
            return
        rate = (update.step - start) / measured
        end = horizon(update.step, update.clock, rate, self.seconds, self.margin, self.ceiling)
        self.fix(update.step, update.clock, end)
        self.apply(trainer)
        if not trainer.is_global_zero:
            return
        speed, left = (tokens - tokens_before) / max(measured, 1e-9), duration(self.seconds - update.clock)
        log.info(
            f"time budget {duration(self.seconds)}: ~{end:,} updates at {60 * rate:,.1f} updates/min ({speed:,.0f} "
            f"target tok/s, both over updates {start:,}-{update.step:,}), {left} of it left; schedule: warmup to "
            f"{self.peak:.3g} at update {self.peak_at:,}, Noam's decay, from update {self.cooldown_start:,} a linear "
            f"cool-down to 0 at update {end:,}{' (trainer.max_steps)' if end == self.ceiling else ''}; "
            f"checkpoints every {self.every} updates"
        )
        if self.planned_peak <= update.step < self.peak_at:
            log.warning(
                f"time budget: a horizon of {end:,} updates is too short for its warmup (budget.warmup="
                f"{self.warmup:g}: {self.planned_peak:,} updates, over by the fix at update "
                f"{update.step:,}): the rate rises from {self.fixed_rate:.3g} to the peak by update {self.peak_at:,}; "
                "a longer trainer.max_time gives a gradual warmup"
            )

    def correct(self, trainer: L.Trainer, update: Update) -> None:
        """The horizon again, from the speed since it was fixed, so that the cool-down ends inside the budget."""
        (start, began), planned = self.fixed, self.horizon
        rate = (update.step - start) / max(update.clock - began, 1e-9)
        self.refit(update.step, horizon(update.step, update.clock, rate, self.seconds, self.margin, self.ceiling))
        self.apply(trainer)
        if trainer.is_global_zero and self.horizon != planned:
            log.info(
                f"time budget {duration(self.seconds)}: {60 * rate:,.1f} updates/min since update {start:,}, so the "
                f"cool-down from update {update.step:,} ends at update {self.horizon:,} (planned: {planned:,}), "
                f"{duration(self.seconds - update.clock)} of the budget left"
            )

    def apply(self, trainer: L.Trainer) -> None:
        """The horizon becomes the loop's max_steps; the next update's rate the schedule's as now fixed."""
        end_after(trainer, self.horizon)
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base * self.lr(scheduler.last_epoch)

    def advice(self, trainer: L.Trainer) -> str:
        """Why the run ended before its schedule (the budget ran out), and what to change."""
        done, end = self.ran_out, self.horizon or trainer.max_steps
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        return (
            f"the time budget ({duration(self.seconds)} of training) ran out at update {done:,}, {done / end:.0%} of "
            f"the schedule's {end:,}: the learning rate is {lr:.3g} (peak {self.peak:.3g}), not near 0. The machine "
            "slowed down (other work on it?); a larger trainer.max_time or budget.margin ends the schedule inside it"
        )
