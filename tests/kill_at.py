"""`python -m transformer_mt.train`, SIGKILLed by itself at one point of training (fault injection).

    python tests/kill_at.py <point> <train overrides ...>

Points:
  update:N          after update N, before its checkpoints are written (mid-epoch)
  epoch-end:E       at the end of epoch E, after the checkpoints of its last update
  validation:N      inside the first validation batch after update N
  write:NAME:N      halfway through writing checkpoint NAME (e.g. last.ckpt) at update N
  final:0           inside the end-of-run protocol (final.enabled), as it decodes its first split
  signal:NAME:N     sends itself signal NAME (SIGTERM, SIGINT, SIGUSR1) as the micro-batch after update N
                    starts, inside the next update's accumulation window (rank 0 only): the run stops by itself;
                    N = -1: as the sanity validation starts, before training (and this script's handlers) start

The process really dies by SIGKILL (exit status -9 for the caller): nothing runs after it, no
`finally`, no atexit handler, exactly as when a node dies or the OOM killer strikes.
"""

from __future__ import annotations

import os
import signal
import sys

import lightning as L
import torch

import transformer_mt.checkpoint
import transformer_mt.train
import transformer_mt.training.final


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

    def on_sanity_check_start(self, trainer, module) -> None:
        if self.kind.startswith("SIG") and self.at == -1 and trainer.global_rank == 0:
            os.kill(os.getpid(), getattr(signal, self.kind))

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        first = not getattr(self, "sent", False)
        if first and self.kind.startswith("SIG") and trainer.global_step == self.at and trainer.global_rank == 0:
            self.sent = True
            os.kill(os.getpid(), getattr(signal, self.kind))

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.kind == "epoch-end" and trainer.current_epoch == self.at:
            die()

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.kind == "validation" and not trainer.sanity_checking and trainer.global_step >= self.at:
            die()


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


def main() -> None:
    # Lightning's ddp starts the other ranks with this script's sys.argv (without the point): they find it here.
    point = os.environ.get("KILL_AT") or sys.argv.pop(1)
    os.environ["KILL_AT"] = point
    kind, *where = point.split(":")
    if kind == "write":
        kill_while_writing(where[0], int(where[1]))
    elif kind == "final":
        transformer_mt.training.final.evaluate_split = lambda *args, **kwargs: die()
    else:
        if kind == "signal":
            kind, where = where[0], where[1:]
        make_callbacks = transformer_mt.train.make_callbacks

        def with_killer(cfg, checkpoint_dir, startup):
            return [Killer(kind, int(where[0])), *make_callbacks(cfg, checkpoint_dir, startup)]

        transformer_mt.train.make_callbacks = with_killer
    transformer_mt.train.main()


if __name__ == "__main__":
    main()
