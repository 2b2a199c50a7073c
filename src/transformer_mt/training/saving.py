"""Every checkpoint a training run writes, and when: the periodic ones (every N updates and/or every N
minutes, the last `keep_last` of each kept, for averaging), best.ckpt (the best validation value of a
metric), and last.ckpt, the run's newest state (at each periodic save, after the final update, at a stop
signal, at the end of training). All are written atomically (temporary file + rename).

Two rules keep a resume exact:
- A save happens only right after an optimizer update, never inside an accumulation window, whose partial
  gradients a checkpoint does not hold. "An update just ended" is training/update.py's answer.
- At an update that is also validated, the save waits for the validation's end: Lightning resumes a
  checkpoint of that update as validated, so one written before the validation (then killed in it) would
  lose that validation for good, from the CSV, the log and the choice of best.ckpt. Lightning calls
  checkpoint callbacks after the others, in the order given: best.ckpt's comes first, so the saves that
  waited hold this validation's best score.
"""

from __future__ import annotations

import logging
import shutil
from datetime import timedelta
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only

from transformer_mt.checkpoint import write_checkpoint
from transformer_mt.evaluation.engines import ct2_folder
from transformer_mt.files import RunFolder
from transformer_mt.training.update import Update

log = logging.getLogger(__name__)

LAST = RunFolder.LAST


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, made atomic (write_checkpoint: temporary file + rename)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        write_checkpoint(checkpoint, path)


def checkpoint_callbacks(
    checkpoint_dir: Path,
    every_n_train_steps: int | None,
    train_time_interval_minutes: float | None,
    keep_last: int,
    best_monitor: str | None,
    best_mode: str,
) -> list[Checkpoint]:
    """conf/train.yaml's `checkpoint` block as callbacks, in the order their saves must happen."""
    # No "-v1" copies: a run resumed in place rewrites a killed attempt's file of the same name with the same content.
    common = dict(dirpath=checkpoint_dir, auto_insert_metric_name=False, enable_version_counter=False)
    best = []
    if best_monitor:
        best.append(BestCheckpoint(filename="best", save_top_k=1, monitor=best_monitor, mode=best_mode, **common))
    periodic = [
        UpdateCheckpoint(filename=name, save_top_k=keep_last, every=every, minutes=minutes, **common)
        for name, every, minutes in (
            ("step{step:07d}", every_n_train_steps, None),
            ("time-step{step:07d}", None, train_time_interval_minutes),
        )
        if every or minutes
    ]
    return [*best, *periodic, LastCheckpoint(checkpoint_dir / LAST, periodic)]


class MovedFolder:
    """A ModelCheckpoint that keeps its files and scores when the run folder was moved or copied. Lightning's
    own forgets them when the saved folder is not the current one: the first validation after the resume
    would replace best.ckpt whatever its score, and keep_last would lose count of the checkpoints there.
    Here the files are re-rooted in the new folder, those that are there."""

    moved_from: str | None = None  # the folder of the checkpoint resumed from, when it was another

    def load_state_dict(self, state: dict) -> None:
        if state.get("dirpath", self.dirpath) == self.dirpath:
            return super().load_state_dict(state)
        kept = {}
        for path, score in state.get("best_k_models", {}).items():
            moved = Path(self.dirpath) / Path(path).name
            if moved.is_file():
                kept[str(moved)] = score
        restored = dict(best_k_models=kept, best_model_path="", best_model_score=None, last_model_path="")
        restored.update(kth_best_model_path=self.kth_best_model_path, kth_value=self.kth_value)  # else: as new
        if kept:  # ModelCheckpoint's own choice of the best and the k-th best (the next to go)
            best = (max if self.mode == "max" else min)(kept, key=kept.get)
            kth = (min if self.mode == "max" else max)(kept, key=kept.get)
            restored.update(best_model_path=best, best_model_score=kept[best], kth_best_model_path=kth)
            restored.update(kth_value=kept[kth])
        super().load_state_dict({**state, "dirpath": self.dirpath, **restored})
        self.moved_from = state["dirpath"]


class BestCheckpoint(MovedFolder, ModelCheckpoint):
    """best.ckpt: the best validation value of `monitor` (a resume in a moved folder keeps it, and says so)."""

    def _generate_state_key(self, **kwargs) -> str:
        return f"ModelCheckpoint{kwargs!r}"  # Lightning's key for it: checkpoints written before this class resume

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.moved_from and self.best_model_score is not None and rank_zero_only.rank == 0:
            score, was = float(self.best_model_score), Path(self.moved_from).parent
            log.info(
                "resumed in a moved folder: best.ckpt's %s %.2f kept (the run was in %s)", self.monitor, score, was
            )


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning validates right after the current training batch: its own decision (a private
    method of its loop, tested through the kill tests of tests/test_resume.py)."""
    loop = trainer.fit_loop.epoch_loop
    return not loop._skip_next_val and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


def stop_after_this_update(trainer: L.Trainer) -> None:
    """End the run after the update that just ended (last.ckpt is written there), with no validation that was not
    due at it: Lightning validates whenever it is told to stop, so whether one follows is asked before telling it."""
    due = validation_follows(trainer)
    trainer.should_stop = True
    if not due:
        trainer.fit_loop.epoch_loop._skip_next_val = True


class AfterUpdate:
    """A save decided when an update ends (`due`), written then (`write`) or, at an update that is also
    validated, after the validation's end."""

    due_step: int | None = None  # the update of the newest save decided in this attempt
    _waiting: tuple | None = None  # the arguments of a save waiting for the validation's end

    def due(self, trainer: L.Trainer, update: Update) -> bool:
        raise NotImplementedError

    def write(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        raise NotImplementedError

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_train_start(trainer, module)
        self.due_step, self._waiting = None, None

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        update = module.updates.finished(trainer)
        if update is None or not self.due(trainer, update):  # inside an accumulation window, or not due
            return
        self.due_step = trainer.global_step
        if validation_follows(trainer):
            self._waiting = (outputs, batch, batch_idx)
        else:
            self.write(trainer, module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_validation_end(trainer, module)
        if self._waiting is not None and not trainer.sanity_checking:
            args, self._waiting = self._waiting, None
            self.write(trainer, module, *args)


class UpdateCheckpoint(AfterUpdate, MovedFolder, ModelCheckpoint):
    """Lightning's ModelCheckpoint (which keeps the newest `save_top_k` by the update count), saving every
    `every` updates or every `minutes` of training, right after an update. A time-based save comes due on
    the update clock (rank 0's, the same on every rank: training/update.py), not on Lightning's broadcast
    of a Python object at every update, a wait of its own. A time budget (budget.py) realigns the saves by
    update count once it knows where the schedule ends (`align`)."""

    def __init__(self, every: int | None = None, minutes: float | None = None, **kwargs):
        self.every, self.interval = every, timedelta(minutes=minutes).total_seconds() if minutes else None
        self.offset = 0  # saved when step % every == offset
        self._configured_every = every or 1  # names this callback's state in checkpoints (Lightning's key)
        # Lightning saves every update this callback lets through (`due` decides); save_on_train_epoch_end: right
        # after update N, never deferred to a later validation (which Lightning does at an epoch's last batch for a
        # checkpoint with a monitor).
        kwargs.update(every_n_train_steps=1, monitor="step", mode="max", save_on_train_epoch_end=True)
        super().__init__(**kwargs)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            monitor=self.monitor, mode=self.mode, every_n_train_steps=self._configured_every,
            every_n_epochs=self._every_n_epochs, train_time_interval=self._train_time_interval,
        )  # fmt: skip

    def align(self, every: int, end: int) -> None:
        """Saves by update count every `every` updates from now on, one of them at update `end`."""
        if self.every:
            self.every, self.offset = every, end % every

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_train_start(trainer, module)
        self._saved_at = module.updates.totals["train_seconds"]  # the update clock at the last time-based save

    def due(self, trainer: L.Trainer, update: Update) -> bool:
        if self.every:
            return update.step % self.every == self.offset
        if update.clock - self._saved_at < self.interval:
            return False
        self._saved_at = update.clock
        return True

    def write(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        ModelCheckpoint.on_train_batch_end(self, trainer, module, outputs, batch, batch_idx)

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        """A checkpoint pruned (keep_last) takes its CTranslate2 export along: engines.ct2_export's <name>.ct2/."""
        super()._remove_checkpoint(trainer, filepath)
        export = ct2_folder(Path(filepath))
        if trainer.is_global_zero and export.is_dir():
            shutil.rmtree(export, ignore_errors=True)


class LastCheckpoint(AfterUpdate, Checkpoint):
    """The one writer of last.ckpt, the state a run continues from (optimizer and loops included): with each
    periodic save, right after the final update (resumed with a larger max_steps, it continues the epoch;
    saved at on_train_end, the loops would already count the epoch as done), at the update where a stop
    signal or a time limit ends the run (callbacks.RunEnd sets trainer.should_stop first), at the end of
    training if not yet, and at each epoch's end when no periodic checkpoints are kept."""

    def __init__(self, path: Path, periodic: list[UpdateCheckpoint]):
        self.path, self.periodic = path, periodic
        self.saved_step: int | None = None

    def due(self, trainer: L.Trainer, update: Update) -> bool:
        step = trainer.global_step
        final = 0 < trainer.max_steps <= step or trainer.should_stop
        return self.saved_step != step and (final or any(p.due_step == step for p in self.periodic))

    def write(self, trainer: L.Trainer, *_) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)
        self.saved_step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not self.periodic and self.saved_step != trainer.global_step:
            self.write(trainer)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.saved_step != trainer.global_step:  # stopped otherwise: max_epochs, early stopping, max_time
            self.write(trainer)
