"""Every checkpoint a training run writes (periodic, best.ckpt, last.ckpt), atomically, right after an update (never
inside an accumulation window) and after a validation due there (Lightning resumes such a checkpoint as validated)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only

from transformer_mt.checkpoint import write_checkpoint
from transformer_mt.evaluation.engines import ct2_folder
from transformer_mt.files import RunFolder
from transformer_mt.training.update import validation_follows

if TYPE_CHECKING:
    from transformer_mt.training.budget import TimeBudget
    from transformer_mt.training.update import Update

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, atomic; a pruned checkpoint takes its CTranslate2 export (<name>.ct2/) along."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        write_checkpoint(checkpoint, path)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        shutil.rmtree(ct2_folder(Path(path)), ignore_errors=True)


def checkpoint_callbacks(checkpoint_dir: Path, cfg: dict) -> list[Checkpoint]:
    """The `checkpoint` block as callbacks, best.ckpt first (saves after a validation hold its best score)."""
    common = dict(dirpath=checkpoint_dir, auto_insert_metric_name=False)
    keep, every, minutes = cfg["keep_last"], cfg["every_n_train_steps"], cfg["train_time_interval_minutes"]
    periodic = [UpdateCheckpoint(filename="step{step:07d}", every=every, save_top_k=keep, **common)] if every else []
    if epochs := cfg["every_n_epochs"]:
        name = "epoch{epoch:03d}-step{step:07d}"
        periodic.append(UpdateCheckpoint(filename=name, epochs=epochs, save_top_k=keep, **common))
    if minutes:
        periodic.append(UpdateCheckpoint(filename="time-step{step:07d}", minutes=minutes, save_top_k=keep, **common))
    best = BestCheckpoint(filename="best", save_top_k=1, monitor=cfg["best_monitor"], mode=cfg["best_mode"], **common)
    return [*([best] if cfg["best_monitor"] else []), *periodic, Saves(checkpoint_dir / RunFolder.LAST, periodic)]


class MovedFolder:
    """A ModelCheckpoint that keeps its files and scores when the run folder was moved (Lightning's forgets them)."""

    def file_exists(self, filepath, trainer) -> bool:
        """Never: a run resumed in place rewrites a killed attempt's file instead of versioning it ("-v1")."""
        return False

    def load_state_dict(self, state: dict) -> None:
        if state["dirpath"] == self.dirpath:
            return super().load_state_dict(state)
        kept = {str(Path(self.dirpath) / Path(p).name): s for p, s in state["best_k_models"].items()}
        kept = {path: score for path, score in kept.items() if Path(path).is_file()}
        restored = dict(best_k_models=kept, best_model_path="", best_model_score=None, last_model_path="")
        restored.update(kth_best_model_path=self.kth_best_model_path, kth_value=self.kth_value)  # else: as new
        if kept:  # ModelCheckpoint's own choice of the best and the k-th best (the next to go)
            best = (max if self.mode == "max" else min)(kept, key=kept.get)
            kth = (min if self.mode == "max" else max)(kept, key=kept.get)
            restored.update(
                best_model_path=best, best_model_score=kept[best], kth_best_model_path=kth, kth_value=kept[kth]
            )
        super().load_state_dict({**state, "dirpath": self.dirpath, **restored})
        if self.monitor != "step" and self.best_model_score is not None and rank_zero_only.rank == 0:  # best.ckpt's
            score, was = float(self.best_model_score), Path(state["dirpath"]).parent
            log.info(f"resumed in a moved folder: best.ckpt's {self.monitor} {score:.2f} kept (the run was in {was})")


class BestCheckpoint(MovedFolder, ModelCheckpoint):
    """best.ckpt: the best validation value of `monitor`."""


class UpdateCheckpoint(MovedFolder, ModelCheckpoint):
    """The newest `save_top_k` kept, written when Saves finds it due: every `every` updates (a time budget's spacing),
    every `minutes` on the update clock (Lightning's time check broadcasts at every update: a wait of its own), or
    at the end of every `epochs`-th epoch (after its validation, as fairseq's --save-interval)."""

    def __init__(self, every: int | None = None, minutes: float | None = None, epochs: int | None = None, **kwargs):
        self.every, self.interval, self.epochs, self.saved_at = every, 60 * minutes if minutes else None, epochs, 0.0
        # every_n_train_steps=1: Lightning saves whenever write() calls it; save_on_train_epoch_end: right after the
        # update, never deferred to a later validation (which it does at an epoch's last batch, with a monitor).
        super().__init__(every_n_train_steps=1, monitor="step", mode="max", save_on_train_epoch_end=True, **kwargs)

    @property
    def state_key(self) -> str:
        return f"UpdateCheckpoint[{self.filename}]"  # by updates and by time: two of them

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_train_start(trainer, module)
        self.saved_at = module.updates.totals["train_seconds"]  # the update clock at the last time-based save

    def due(self, update: Update, budget: TimeBudget | None, epoch_end: int | None) -> bool:
        """epoch_end: the epoch (from 0) this update ends, else None."""
        if self.epochs:
            return epoch_end is not None and (epoch_end + 1) % self.epochs == 0
        if not self.every:
            return update.clock - self.saved_at >= self.interval
        every, end = (budget.every, budget.horizon) if budget is not None and budget.horizon else (self.every, 0)
        return update.step % every == end % every

    def on_train_batch_end(self, *args) -> None:
        pass  # Saves decides when

    def write(self, trainer: L.Trainer, update: Update) -> None:
        self.saved_at = update.clock
        super().on_train_batch_end(trainer, trainer.lightning_module, None, None, 0)


class Saves(Checkpoint):
    """The saves at an update's end: the periodic checkpoints due, and last.ckpt with each of them and after the final
    update; last.ckpt also at the end of training, and at each epoch's end without periodic checkpoints."""

    def __init__(self, path: Path, periodic: list[UpdateCheckpoint]):
        self.path, self.periodic, self.saved_step = path, periodic, None
        self.waiting: tuple | None = None  # (update, the periodic checkpoints due) until the validation's end

    def after_update(self, trainer: L.Trainer, update: Update) -> None:
        budget = getattr(trainer.lightning_module, "budget", None)
        epoch_end = trainer.current_epoch if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch else None
        due = [c for c in self.periodic if c.due(update, budget, epoch_end)]
        if due or trainer.should_stop or 0 < trainer.max_steps <= update.step:
            if validation_follows(trainer):
                self.waiting = (update, due)
            else:
                self.write(trainer, update, due)

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.waiting is not None and not trainer.sanity_checking:
            (update, due), self.waiting = self.waiting, None
            self.write(trainer, update, due)

    def write(self, trainer: L.Trainer, update: Update | None = None, due: list[UpdateCheckpoint] = ()) -> None:
        for checkpoint in due:
            checkpoint.write(trainer, update)
        trainer.save_checkpoint(self.path, weights_only=False)
        self.saved_step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not self.periodic and self.saved_step != trainer.global_step:
            self.write(trainer)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.saved_step != trainer.global_step:  # stopped otherwise: max_epochs, early stopping
            self.write(trainer)
