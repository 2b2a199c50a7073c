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
from transformer_mt.stops import epoch_ends, validation_follows

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
    keep, every, minutes = cfg["keep_last"], cfg["every_n_train_steps"], cfg["train_time_interval_minutes"]
    periodic = [UpdateCheckpoint(checkpoint_dir, "step{step:07d}", keep, every=every)] if every else []
    if epochs := cfg["every_n_epochs"]:
        periodic.append(UpdateCheckpoint(checkpoint_dir, "epoch{epoch:03d}-step{step:07d}", keep, epochs=epochs))
    if minutes:
        periodic.append(UpdateCheckpoint(checkpoint_dir, "time-step{step:07d}", keep, minutes=minutes))
    watch = dict(monitor=cfg["best_monitor"], mode=cfg["best_mode"])
    # enable_version_counter=False: a run resumed in place rewrites a killed attempt's file instead of versioning it
    best = BestCheckpoint(dirpath=checkpoint_dir, filename="best", enable_version_counter=False, **watch)
    return [*([best] if cfg["best_monitor"] else []), Saves(checkpoint_dir / RunFolder.LAST, periodic)]


class BestCheckpoint(ModelCheckpoint):
    """best.ckpt: the best validation value of `monitor`, kept with its score in a moved run folder (Lightning's
    forgets them)."""

    def load_state_dict(self, state: dict) -> None:
        if state["dirpath"] == self.dirpath:
            return super().load_state_dict(state)
        kept = {str(Path(self.dirpath) / Path(p).name): s for p, s in state["best_k_models"].items()}
        kept = {path: score for path, score in kept.items() if Path(path).is_file()}
        restored = dict(best_k_models=kept, best_model_path="", best_model_score=None, last_model_path="")
        restored.update(kth_best_model_path=self.kth_best_model_path, kth_value=self.kth_value)  # else: as new
        for path, score in kept.items():  # one (save_top_k=1): the best is also the k-th best, the next to go
            restored.update(best_model_path=path, best_model_score=score, kth_best_model_path=path, kth_value=score)
        super().load_state_dict({**state, "dirpath": self.dirpath, **restored})
        if self.best_model_score is not None and rank_zero_only.rank == 0:
            score, was = float(self.best_model_score), Path(state["dirpath"]).parent
            log.info(f"resumed in a moved folder: best.ckpt's {self.monitor} {score:.2f} kept (the run was in {was})")


class UpdateCheckpoint:
    """<name>.ckpt, the newest `keep` of them kept (all: -1), written when Saves finds it due: every `every` updates (a
    time budget's spacing), every `minutes` on the update clock, or at the end of every `epochs`-th epoch (after its
    validation, as fairseq's --save-interval)."""

    def __init__(self, folder: Path, name: str, keep: int, every=None, minutes=None, epochs=None):
        self.folder, self.name, self.keep = Path(folder), name, keep
        self.every, self.interval, self.epochs, self.saved_at = every, 60 * minutes if minutes else None, epochs, 0.0

    def due(self, update: Update, budget: TimeBudget | None, epoch_end: int | None) -> bool:
        """epoch_end: the epoch (from 0) this update ends, else None."""
        if self.keep == 0:
            return False
        if self.epochs:
            return epoch_end is not None and (epoch_end + 1) % self.epochs == 0
        if not self.every:
            return update.clock - self.saved_at >= self.interval
        every, end = (budget.every, budget.horizon) if budget is not None and budget.horizon else (self.every, 0)
        return update.step % every == end % every

    def write(self, trainer: L.Trainer, update: Update) -> None:
        """Written (a killed attempt's file of the same update replaced), then the oldest beyond `keep` removed."""
        self.saved_at = update.clock
        name = self.name.format(epoch=trainer.current_epoch, step=update.step)
        trainer.save_checkpoint(self.folder / f"{name}.ckpt", weights_only=False)
        written = self.folder.glob(self.name.partition("{")[0] + "[0-9]*.ckpt")
        written = sorted(written, key=lambda path: int(path.stem.rpartition("step")[2]))  # by update
        for old in written[: max(len(written) - self.keep, 0)] if self.keep > 0 else []:
            trainer.strategy.remove_checkpoint(old)


class Saves(Checkpoint):
    """The saves at an update's end: the periodic checkpoints due, and last.ckpt with each of them and after the final
    update; last.ckpt also at the end of training, and at each epoch's end without periodic checkpoints."""

    def __init__(self, path: Path, periodic: list[UpdateCheckpoint]):
        self.path, self.periodic, self.saved_step = path, periodic, None
        self.waiting: tuple | None = None  # (update, the periodic checkpoints due) until the validation's end

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for checkpoint in self.periodic:  # the update clock at the last time-based save
            checkpoint.saved_at = module.updates.totals["train_seconds"]

    def after_update(self, trainer: L.Trainer, update: Update) -> None:
        budget = getattr(trainer.lightning_module, "budget", None)
        epoch_end = trainer.current_epoch if epoch_ends(trainer) else None
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
