"""`python -m transformer_mt.train`, SIGKILLed by itself at one point of training (fault injection).

    python tests/kill_at.py <point> <train overrides ...>

Points:
  update:N          after update N, before its checkpoints are written (mid-epoch)
  rank-0-dies:N     after update N, rank 0 only: the other ranks go on to their next collective
  epoch-end:E       at the end of epoch E, after the checkpoints of its last update
  validation:N      inside the first validation batch after update N
  write:NAME:N      halfway through writing checkpoint NAME (e.g. last.ckpt) at update N
  final:0           inside the end-of-run protocol (final.enabled), as it decodes its first split
  final:NAME        no kill: sends itself signal NAME (SIGINT, SIGTERM) there instead
  probe:NAME        sends itself signal NAME as data.max_tokens=auto's batch-size probe starts (a CPU run)
  after-rank-1:0    no kill: under torchrun/srun, rank 0's end-of-run protocol starts only once rank 1's process
                    has exited (it says so), or after 120 s if it has not (a rank 1 waiting for rank 0)
  signal:NAME:N     sends itself signal NAME (SIGTERM, SIGINT, SIGUSR1) as the micro-batch after update N
                    starts, inside the next update's accumulation window (rank 0 only): the run stops by itself;
                    N = -1: as the sanity validation starts, before training (and this script's handlers) start;
                    NAME = SIGINT-twice: two Ctrl+C in a row
  none:0            no kill (with KILL_AT_CLOCK: a run on the driven clock)

KILL_AT_CLOCK=S in the environment drives the update clock (training/update.py's `clock`): every training
micro-batch takes S seconds, validations none, whatever the machine does; a time budget then fixes the same
horizon in every run.

The process really dies by SIGKILL (exit status -9 for the caller): nothing runs after it, no
`finally`, no atexit handler, exactly as when a node dies or the OOM killer strikes.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from pathlib import Path

import lightning as L
import torch

import transformer_mt.checkpoint
import transformer_mt.evaluation.protocol
import transformer_mt.launcher
import transformer_mt.train
import transformer_mt.training.batch_fit
import transformer_mt.training.fit
import transformer_mt.training.update


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Killer(L.Callback):
    def __init__(self, kind: str, at: int):
        self.kind, self.at = kind, at

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.kind == "update" and trainer.global_step == self.at:
            die()
        if self.kind == "rank-0-dies" and trainer.global_step == self.at and trainer.global_rank == 0:
            die()

    def on_sanity_check_start(self, trainer, module) -> None:
        if self.kind.startswith("SIG") and self.at == -1 and trainer.global_rank == 0:
            os.kill(os.getpid(), getattr(signal, self.kind))

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        first = not getattr(self, "sent", False)
        if first and self.kind.startswith("SIG") and trainer.global_step == self.at and trainer.global_rank == 0:
            self.sent = True
            name, twice = self.kind.removesuffix("-twice"), self.kind.endswith("-twice")
            for _ in range(2 if twice else 1):
                os.kill(os.getpid(), getattr(signal, name))

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.kind == "epoch-end" and trainer.current_epoch == self.at:
            die()

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.kind == "validation" and not trainer.sanity_checking and trainer.global_step >= self.at:
            die()


class DrivenClock(L.Callback):
    """The update clock, driven: each training micro-batch advances it by `seconds`."""

    def __init__(self, seconds: float):
        self.seconds, self.now = seconds, 0.0
        transformer_mt.training.update.clock = lambda: self.now

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.now += self.seconds


def kill_while_writing(name: str, step: int) -> None:
    """torch.save of checkpoint `name` at update `step` writes half the file, then the process dies."""
    real_save = torch.save

    def save(checkpoint, path, *args, **kwargs):
        if f".{name}.tmp-" in str(path) and checkpoint.get("global_step") == step:
            real_save(checkpoint, path, *args, **kwargs)
            size = os.path.getsize(path)
            os.truncate(path, size // 2)
            die()
        real_save(checkpoint, path, *args, **kwargs)

    transformer_mt.checkpoint.torch.save = save


def protocol_after_rank_1() -> None:
    """Rank 1 names its process in a file; rank 0's protocol waits for that process's exit (an event: its pidfd
    becomes readable; at most 120 s), then says whether it came."""
    named = Path("rank-1.pid")
    if transformer_mt.launcher.launched_rank() == 1:
        named.with_suffix(".tmp").write_text(str(os.getpid()))
        named.with_suffix(".tmp").rename(named)
        return
    run_on = transformer_mt.evaluation.protocol.Protocol.run_on

    def after_rank_1(*args, **kwargs):
        pidfd = os.pidfd_open(int(named.read_text()))
        exited = bool(select.select([pidfd], [], [], 120)[0])
        print(f"rank 0's protocol starts; rank 1 {'has exited' if exited else 'is still running'}", flush=True)
        return run_on(*args, **kwargs)

    transformer_mt.evaluation.protocol.Protocol.run_on = after_rank_1


def main() -> None:
    # Lightning's ddp starts the other ranks with this script's sys.argv (without the point): they find it here.
    point = os.environ.get("KILL_AT") or sys.argv.pop(1)
    os.environ["KILL_AT"] = point
    kind, *where = point.split(":")
    if kind == "write":
        kill_while_writing(where[0], int(where[1]))
    elif kind == "after-rank-1":
        protocol_after_rank_1()
    elif kind == "probe":
        probe = transformer_mt.training.batch_fit.fastest_max_tokens

        def stop_at_start(*args, **kwargs):
            os.kill(os.getpid(), getattr(signal, where[0]))
            return probe(*args, **kwargs)

        transformer_mt.training.batch_fit.fastest_max_tokens = stop_at_start
    elif kind == "final":
        stop = die if where[0] == "0" else lambda: os.kill(os.getpid(), getattr(signal, where[0]))
        transformer_mt.evaluation.protocol.Protocol.scores = lambda *args, **kwargs: stop()
    else:
        if kind == "signal":
            kind, where = where[0], where[1:]
        make_callbacks = transformer_mt.training.fit.make_callbacks

        driven = [DrivenClock(float(os.environ["KILL_AT_CLOCK"]))] if os.environ.get("KILL_AT_CLOCK") else []

        def with_killer(*args):
            return [*driven, Killer(kind, int(where[0])), *make_callbacks(*args)]

        transformer_mt.training.fit.make_callbacks = with_killer
    transformer_mt.train.main()


if __name__ == "__main__":
    main()
