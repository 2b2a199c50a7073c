"""How a command stops: the signals, their handlers (outside training Stopped is raised where the command is; inside,
training stops after the update in progress), the exit status, SLURM's requeue; Lightning's loop state, only here."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
from typing import NoReturn

log = logging.getLogger(__name__)

# Ranks that received different signals agree on the first of these: SIGTERM over SLURM's SIGUSR1 over Ctrl+C.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Stopped(BaseException):
    """A stop signal outside a training's own handling: a BaseException, so that no `except Exception` takes it; the
    command ends in one line saying what was kept (`kept`), with status 128 + the signal."""

    def __init__(self, signum: int, kept: str | None = None):
        super().__init__(signum, kept)
        self.signum, self.kept = signum, kept


def raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


def stop_quietly() -> None:
    """For a command (transformer_mt/__init__.py): until it sets its own handler, a stop signal while its imports load
    ends the process in one line, with 128 + the signal, not an import's traceback (nothing was written yet)."""
    for signum in SIGNALS:
        signal.signal(signum, lambda received, frame: exit_stopped(received))


def exit_stopped(signum: int, kept: str | None = None) -> NoReturn:
    """A stop's one line (what was kept and how to go on), and its exit status: 128 + the signal."""
    print(f"stopped by {signal.Signals(signum).name}: {kept or 'nothing was written'}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def peer_ended(error: BaseException) -> str | None:
    """What a rank says when its collective failed because another rank's process ended (killed, out of memory): a
    lost connection (gloo: "Connection reset by peer"); None for any other error."""
    distributed = sys.modules.get("torch.distributed")
    lost = re.search(r"Connection (reset|closed) by peer|Broken pipe", str(error))
    if distributed is None or not isinstance(error, RuntimeError) or not lost:
        return None
    rank = distributed.get_rank() if distributed.is_initialized() else os.environ.get("LOCAL_RANK", "?")
    first = str(error).strip().splitlines()[0]
    cause = re.sub(r"^\[\S+\] ", "", first).split(". This ")[0]  # gloo's "[<file>:<line>] Read error ...: <why>. This"
    return f"rank {rank}: another rank's process ended ({cause}); this one stops too"


def die_with_parent(worker_id: int = 0) -> None:
    """A loader's worker_init_fn: die with the training process (SIGKILL too), leave the stop signals to it."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG, <linux/prctl.h>


class TrainingStops:
    """Training's handler: a signal is noted (the update in progress ends first); a second Ctrl+C stops at once."""

    def __init__(self):
        self.received, self.handlers, self.bookkeeping = 0, {}, None

    def begin(self, trainer, bookkeeping) -> None:
        """Signals go to note(), which tells the update's bookkeeping: its reduction carries them to every rank."""
        self.bookkeeping = bookkeeping
        # Lightning's SIGTERM handler (registered as fit starts) stops inside an accumulation window and exits 0.
        self.handlers = {signum: signal.signal(signum, self.note) for signum in SIGNALS}
        # Stands in for a switch that turns Lightning's SIGTERM check off (there is none): under DDP a broadcast and a
        # wait for the device before every micro-batch, for a SIGTERM that its replaced handler would have noted.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
        if trainer.received_sigterm:  # came as the run started (restoring, the sanity check): Lightning's handler
            # Stands in for a setter of Trainer.received_sigterm: Lightning would exit 0 at the first micro-batch.
            trainer._signal_connector.received_sigterm = False
            self.note(signal.SIGTERM, None)

    def note(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:  # a second Ctrl+C: now, still 128 + SIGINT
            log.warning("received SIGINT again: stopping now, inside the update; the newest checkpoint holds the run")
            raise SystemExit(128 + signal.SIGINT)
        if not self.received:
            again = "; press Ctrl+C again to stop at once" if signum == signal.SIGINT else ""
            log.warning(f"received {signal.Signals(signum).name}: stopping at the end of the update in progress{again}")
        self.received = self.bookkeeping.signal = signum

    def end(self) -> None:
        """The handlers from before training, back."""
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        self.handlers = {}


def end_after(trainer, update: int) -> None:
    """Training ends after `update` (a time budget's horizon; trainer.max_steps has no setter)."""
    trainer.fit_loop.epoch_loop.max_steps = update


def epoch_ends(trainer) -> bool:
    """Whether the micro-batch in progress is the epoch's last (Lightning's fetcher looks one batch ahead)."""
    return trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


def batches_done(trainer) -> int:
    """Micro-batches of this epoch that training processed (a resumed epoch's sampler starts after them)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


def validation_follows(trainer) -> bool:
    """Whether Lightning validates right after this batch: the epoch loop's _should_check_val_fx, from public
    attributes, for validations counted in batches or epochs (check_config refuses a time)."""
    loop, every_epoch = trainer.fit_loop.epoch_loop, trainer.check_val_every_n_epoch
    if not trainer.enable_validation or (every_epoch and (trainer.current_epoch + 1) % every_epoch):
        return False
    if trainer.should_stop or trainer.val_check_batch == float("inf"):
        return trainer.should_stop or loop.batch_progress.is_last_batch
    batches = loop.total_batch_idx if every_epoch is None else loop.batch_idx
    return (batches + 1) % trainer.val_check_batch == 0


def exit_after_training(signum: int, global_zero: bool) -> None:
    """A training stopped by a signal exits 128 + it (a scheduler, or `make train && ...`, must not read success);
    SLURM's SIGUSR1 (its time limit near) requeues the job first, to continue from last.ckpt."""
    if signum == signal.SIGUSR1 and global_zero:
        requeue_slurm_job()
    raise SystemExit(128 + signum)


def requeue_slurm_job() -> None:
    """`scontrol requeue <job>`: the job continues from last.ckpt (Lightning's auto_requeue saves inside the update)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        log.warning("SIGUSR1 outside a SLURM job: stopped, nothing requeued")
        return
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=True)
        log.info("requeued SLURM job %s: it continues from last.ckpt when it starts again", job)
    except (OSError, subprocess.SubprocessError) as e:
        why = (getattr(e, "stderr", None) or str(e)).strip()
        log.warning("could not requeue SLURM job %s (%s): continue it by hand with ckpt_path=last", job, why)
