"""trainer.max_time as a time budget that the schedule fits (docs/training.md, time budgets).

A schedule sized in updates for a faster machine is cut wherever the clock stops it (on a CPU without AVX-512 the
Multi30k recipe stopped at its peak learning rate, 10 BLEU below a faster CPU). Budgeted training (Li, Yumer and
Ramanan, ICLR 2020) ends the schedule with the budget instead: a run measures its speed over its first updates, fixes
its horizon once (the updates that fit the rest of the budget, less a margin, at most trainer.max_steps) and follows
objective.budget_lr to it; where the cool-down begins, the horizon is corrected once with the speed since (a machine
that slows down), so that the cool-down ends with the budget. Every decision is taken at an update's end, on the
update clock (training/update.py: rank 0's seconds of training, validations left out) and the update count, the same
on every rank; the budget travels in checkpoints (checkpoint["budget"]), so a resumed run follows the same schedule.
Lightning-free: make finish reads a checkpoint's budget.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from transformer_mt.errors import InputError
from transformer_mt.objective import budget_lr
from transformer_mt.runtime import duration

if TYPE_CHECKING:
    import lightning as L

    from transformer_mt.training.update import Update

log = logging.getLogger(__name__)

MEASURE_FROM = 10  # updates: the first ones pay for allocations, caches and warm-up, not for training
MEASURE_UPDATES = 20  # the horizon is fixed after at least this many measured updates ...
MEASURE_SHARE = 0.03  # ... and at least this share of the budget (a CPU still speeds up over its first minute)
STATE = ("measured_from", "fixed", "fixed_rate", "horizon", "peak_at", "cool_from")  # what a resume continues


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


def horizon(step: int, clock: float, rate: float, budget: float, margin: float, ceiling: int) -> int:
    """The last update of the schedule: those that fit the rest of the budget at `rate` updates per second, less
    `margin` of that time, after update `step` at `clock` seconds of training; at most `ceiling` (max_steps, if > 0)."""
    fits = step + math.floor(max(budget - clock, 0.0) * (1 - margin) * rate)
    return min(fits, ceiling) if ceiling > 0 else fits


@dataclass
class TimeBudget:
    """The budget, one object: the learning rate (`lr`, LambdaLR's multiplier of the module's lr = 1), the loop's step
    limit (`horizon`) and the periodic checkpoints' spacing (`every`) read it. Until the horizon is fixed the warmup
    climbs as for the longest horizon (`provisional` updates); once fixed after update fixed[0], objective.budget_lr."""

    seconds: float  # of training, on the update clock
    margin: float  # budget.margin: the share of the time left that the horizon leaves unplanned
    warmup_share: float  # budget.warmup: the warmup's share of the horizon
    cooldown_share: float  # budget.cooldown: the cool-down's share, at the horizon's end
    average_span: float  # budget.average_span: the last keep_last periodic checkpoints span this share of it
    keep_last: int
    peak: float = 0.0  # the rate at the warmup's end (the module's: Noam's peak at optim.warmup_steps)
    ceiling: int = 0  # trainer.max_steps as configured: the horizon never passes it
    provisional: int = 1  # warmup updates before the horizon is fixed
    measured_from: tuple[int, float] | None = None  # (update, clock) where the speed's measurement began
    fixed: tuple[int, float] | None = None  # (update, clock) where the horizon was fixed
    fixed_rate: float = 0.0  # the rate of update fixed[0]
    horizon: int | None = None  # the schedule's last update
    peak_at: int | None = None  # the warmup's end, a share of the horizon as first fixed (a refit leaves it)
    cool_from: int | None = None  # where the cool-down began, once the horizon was corrected there (refit)
    clock = 0.0  # not fields, not kept: the update clock at the latest update (the totals hold it), and ...
    ran_out = None  # ... the update at which the budget ran out before the horizon

    @classmethod
    def of(cls, checkpoint: dict) -> TimeBudget | None:
        return cls(**checkpoint["budget"]) if checkpoint.get("budget") else None

    def state(self) -> dict:
        return asdict(self)

    def resume(self, state: dict) -> None:
        """The schedule of the checkpoint's run, continued; the settings stay as configured now."""
        for name in STATE:
            setattr(self, name, state[name])

    def lr(self, done: int) -> float:
        """The rate of update done + 1 (LambdaLR counts the updates done)."""
        step = done + 1
        if self.horizon is None or step <= self.fixed[0]:
            return self.peak * min(step / self.provisional, 1.0)
        start, top = (self.fixed[0], self.fixed_rate), (self.peak_at, self.peak)
        return budget_lr(step, start, top, self.horizon, self.cooldown_start)

    def fix(self, step: int, clock: float, horizon: int) -> None:
        """The horizon, fixed after update `step`: the updates after it follow objective.budget_lr, without a jump."""
        self.fixed_rate, self.fixed, self.horizon = self.lr(step - 1), (step, clock), horizon
        self.peak_at = max(1, round(self.warmup_share * horizon))

    def refit(self, step: int, horizon: int) -> None:
        """The horizon, corrected where the cool-down begins: from this update's rate down to 0 one update after it."""
        self.cool_from, self.horizon = step, max(horizon, step + 1)

    @property
    def cooldown_start(self) -> int:
        return self.cool_from or self.horizon - round(self.cooldown_share * self.horizon)

    @property
    def every(self) -> int:
        """The periodic checkpoints' spacing once the horizon is fixed: the last keep_last span average_span of it."""
        return max(1, round(self.average_span * self.horizon / max(self.keep_last, 1)))

    def begin(self, trainer: L.Trainer, clock: float) -> None:
        """At the start of training: a resumed run's horizon becomes the loop's step limit again."""
        self.clock = clock
        if self.horizon is not None:
            trainer.fit_loop.epoch_loop.max_steps = self.horizon
        if trainer.is_global_zero:
            used = f", {duration(clock)} used" if clock else ""
            fixed = (
                f"the schedule ends at update {self.horizon:,} (fixed at update {self.fixed[0]:,})"
                if self.horizon is not None
                else f"its end is fixed once {MEASURE_FROM + MEASURE_UPDATES} updates have measured the speed"
            )
            log.info("time budget: %s of training (trainer.max_time; validations not counted)%s; %s",
                     duration(self.seconds), used, fixed)  # fmt: skip

    def after_update(self, trainer: L.Trainer, update: Update) -> bool:
        """Measures the speed, fixes the horizon, corrects it where the cool-down begins; True where the budget ran out
        before the horizon (the run stops at this update)."""
        self.clock = update.clock
        if self.horizon is None:
            self.measure(trainer, update)
        elif self.cool_from is None and update.step >= self.cooldown_start:
            self.correct(trainer, update)
        if update.clock >= self.seconds and update.step < trainer.max_steps:
            self.ran_out = update.step
        return self.ran_out is not None

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
        self.fix(update.step, update.clock, end)
        self.apply(trainer)
        if trainer.is_global_zero:
            tokens = update.tokens / max(update.seconds, 1e-9)
            limit = " (trainer.max_steps)" if end == self.ceiling else ""
            log.info(
                "time budget %s: ~%s updates at %s updates/min (%s target tok/s at update %s), %s of it left; "
                "schedule: warmup %s to %.3g, Noam's decay, from update %s a linear cool-down to 0 at update %s%s; "
                "checkpoints every %s updates",
                duration(self.seconds), f"{end:,}", f"{60 * rate:,.1f}", f"{tokens:,.0f}", f"{update.step:,}",
                duration(self.seconds - update.clock), f"{self.peak_at:,}", self.peak,
                f"{self.cooldown_start:,}", f"{end:,}", limit, self.every,
            )  # fmt: skip

    def correct(self, trainer: L.Trainer, update: Update) -> None:
        """The horizon again, from the speed since it was fixed (all that runs at each update counted: checkpoints,
        logs, the machine's own drift), so that the cool-down ends inside the budget."""
        (start, began), planned = self.fixed, self.horizon
        rate = (update.step - start) / max(update.clock - began, 1e-9)
        self.refit(update.step, horizon(update.step, update.clock, rate, self.seconds, self.margin, self.ceiling))
        self.apply(trainer)
        if trainer.is_global_zero and self.horizon != planned:
            log.info(
                "time budget %s: %s updates/min since update %s, so the cool-down from update %s ends at update %s "
                "(planned: %s), %s of the budget left",
                duration(self.seconds), f"{60 * rate:,.1f}", f"{start:,}", f"{update.step:,}", f"{self.horizon:,}",
                f"{planned:,}", duration(self.seconds - update.clock),
            )  # fmt: skip

    def apply(self, trainer: L.Trainer) -> None:
        """The horizon becomes the loop's max_steps; the next update's rate is the schedule's as now fixed (the
        scheduler stepped before this update's end, by the schedule before)."""
        trainer.fit_loop.epoch_loop.max_steps = self.horizon
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base * self.lr(scheduler.last_epoch)

    def remaining(self) -> float:
        return max(self.seconds - self.clock, 0.0)

    def advice(self, trainer: L.Trainer) -> str | None:
        """Why the run ended before its schedule, and what to change; None if the budget did not run out."""
        if self.ran_out is None:
            return None
        done, end = self.ran_out, self.horizon or trainer.max_steps
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        return (
            f"the time budget ({duration(self.seconds)} of training) ran out at update {done:,}, {done / end:.0%} of "
            f"the schedule's {end:,}: the learning rate is {lr:.3g} (peak {self.peak:.3g}), not near 0. The "
            "machine trained slower than at the start (other work on it?); on a quiet machine, or in a new run with a "
            "larger trainer.max_time or budget.margin, the schedule ends inside the budget"
        )
