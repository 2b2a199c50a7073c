"""Resuming a run exactly: every rank's random state, which checkpoint a run continues from, and whether it can."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only

from transformer_mt.checkpoint import check_finite, read_checkpoint
from transformer_mt.errors import InputError, MissingInputError, UserError
from transformer_mt.files import RunFolder, remove_stale_temporaries
from transformer_mt.launcher import first_process, launch_id
from transformer_mt.model import TransformerConfig

log = logging.getLogger(__name__)


def random_state() -> dict:
    """This process's generators as weights_only values; of CUDA its own device's (a resume may see fewer GPUs)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda_device": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_random_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda_device"] is not None:
        torch.cuda.set_rng_state(state["cuda_device"])


class RandomState(L.Callback):
    """Every rank's random generators in checkpoints, restored at the first training batch (the loaders and a sanity
    check draw from them in between, as the uninterrupted run did before it saved them): the same dropout masks."""

    def __init__(self):
        self._restore: list[dict] | None = None

    def state_dict(self) -> dict:
        ranks = [random_state()]
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # rank 0 writes all ranks' states
            ranks = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, random_state())
        return {"ranks": ranks}

    def load_state_dict(self, state: dict) -> None:
        self._restore = state["ranks"]

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._restore is not None and len(self._restore) == trainer.world_size:
            set_random_state(self._restore[trainer.global_rank])
        elif self._restore is not None:
            log.warning(
                f"resuming on {trainer.world_size} device(s) from a checkpoint written by {len(self._restore)}: "
                "dropout continues with fresh random states: the run is not bit-identical to an uninterrupted one"
            )
        self._restore = None


def newest_checkpoint(checkpoint_dir: Path) -> tuple[Path, dict]:
    """The checkpoint of a run folder with the most updates that reads completely, and its contents."""
    found = []
    for path in checkpoint_dir.glob("*.ckpt"):  # last.ckpt, step*.ckpt, time-step*.ckpt
        if path.name == RunFolder.BEST or path.name.startswith(RunFolder.AVERAGE):  # at validation / no optimizer
            continue
        try:
            checkpoint = read_checkpoint(path, mmap=True, finite=False)  # tensors stay on disk until used
            modified = path.stat().st_mtime
        except UserError as e:  # also one that another rank set aside meanwhile (MissingInputError)
            refuse(path, e)
            continue
        if "optimizer_states" in checkpoint and "loops" in checkpoint:
            found.append((checkpoint["global_step"], path.name == RunFolder.LAST, modified, path, checkpoint))
    for *_, path, checkpoint in sorted(found, key=lambda item: item[:3], reverse=True):
        try:  # only the newest is read whole
            check_finite(path, checkpoint)
            return path, checkpoint
        except InputError as e:
            refuse(path, e)
    raise MissingInputError(
        f"ckpt_path=last: no complete checkpoint in {checkpoint_dir}; continue a run with "
        "ckpt_path=last hydra.run.dir=<the run's folder>, or give ckpt_path=<a .ckpt file>"
    )


def refuse(path: Path, error: UserError) -> None:
    """Renames a checkpoint ckpt_path=last refuses to <name>.refused, so that no average or resume takes it."""
    if not first_process() or not path.is_file():
        log.warning("not resuming from %s: %s", path, error)
        return
    aside, n = path.with_name(f"{path.name}.refused"), 1
    while aside.exists():  # refused before: keep that one too
        n += 1
        aside = path.with_name(f"{path.name}.refused{n}")
    try:
        path.rename(aside)
    except OSError as e:  # a read-only folder: this resume cannot write its checkpoints either
        log.warning("not resuming from %s: %s (could not rename it aside: %s)", path, error, e)
        return
    log.warning(f"not resuming from {path}: {error}; renamed to {aside.name}, so that no average or resume takes it")


def resume_checkpoint(ckpt_path: str | None, run_dir: Path, config: dict) -> tuple[Path | None, dict | None]:
    """ckpt_path (`last`: the newest complete checkpoint of the run folder) -> (path, contents); a launched job
    restarted or requeued into its folder continues it by itself, as the same training only."""
    checkpoint_dir = RunFolder(run_dir).checkpoints
    remove_stale_temporaries(checkpoint_dir, log.info)
    if ckpt_path is None and launch_id() and any(checkpoint_dir.glob("*.ckpt")):
        log.info("%s restarted: continuing from the newest checkpoint in %s", launch_id(), checkpoint_dir)
        path, checkpoint = newest_checkpoint(checkpoint_dir)
        check_same_training(run_dir, checkpoint, config, launch_id())
        return path, checkpoint
    if ckpt_path is None:
        refuse_lightnings_own_resume(run_dir)
        return None, None
    if str(ckpt_path) == "last":
        return newest_checkpoint(checkpoint_dir)
    return Path(ckpt_path), read_checkpoint(ckpt_path, mmap=True)


def refuse_another_runs_folder(ckpt_path: str | None, run_dir: Path) -> None:
    """One run per folder: a new training (no ckpt_path) into a folder that holds a run's checkpoints is refused before
    anything there is touched; a launched job restarted into its folder continues it (resume_checkpoint)."""
    folder = RunFolder(run_dir)  # (one in use: RunFolderLock refuses the start, naming who holds it)
    if ckpt_path is None and not launch_id() and any(folder.checkpoints.glob("*.ckpt")) and not folder.in_use():
        raise InputError(
            f"{run_dir} holds another run's checkpoints: continue it with ckpt_path=last hydra.run.dir={run_dir}, or "
            "start this one in a new folder (another hydra.run.dir, or none: outputs/<date>/<time>)"
        )


def refuse_lightnings_own_resume(run_dir: Path) -> None:
    """Under SLURM, Lightning would restore <run>/hpc_ckpt_<N>.ckpt by itself, past this project's checks: refused."""
    from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: PLC0415

    found = sorted(run_dir.glob("hpc_ckpt_*.ckpt"), key=lambda p: int(p.stem.rpartition("_")[2] or 0))
    if found and SLURMEnvironment.detect():
        raise InputError(
            f"{found[-1]}: a Lightning HPC checkpoint, which Lightning would restore under SLURM past this project's "
            f"checks (its runs continue from {run_dir / 'checkpoints'}: ckpt_path=last). Move it out of {run_dir}, "
            f"or continue from it on purpose, checked like any checkpoint: ckpt_path={found[-1]}"
        )


def check_same_training(run_dir: Path, checkpoint: dict, config: dict, job: str) -> None:
    """A launched job continues its folder by itself only as the same training (a longer trainer.max_steps is)."""
    differ = changed_settings(checkpoint, config, run_dir)
    if differ := {k: v for k, v in differ.items() if k != "trainer.max_steps"}:
        shown = "; ".join(f"{k} {old} -> {new}" for k, (old, new) in list(differ.items())[:4])
        more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
        raise InputError(
            f"{run_dir} holds another training of {job}, made with other settings ({shown}{more}): a restarted job "
            "continues its folder by itself only with the same settings. Start this one in a folder of its own "
            "(hydra.run.dir=<another folder>), or continue that run with these settings on purpose (ckpt_path=last)"
        )


def changed_settings(checkpoint: dict, config: dict, run_dir: Path) -> dict[str, tuple]:
    """Flattened keys whose values differ between a checkpoint's run and `config`; ckpt_path, the code's record (said
    at each start) and the settings derived from the run's folder (logger.save_dir: a copied or moved folder) aside."""
    before, now = flatten(checkpoint["hyper_parameters"].get("config") or {}), flatten(config)
    folder = str(run_dir.absolute())
    derived = {k for k, v in now.items() if isinstance(v, str) and (v == folder or v.startswith(folder + os.sep))}
    keys = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k) and k not in derived)
    return {k: (before.get(k), now.get(k)) for k in keys if k.split(".")[0] not in ("ckpt_path", "code")}


def check_resume(path: Path, checkpoint: dict, model: dict, sentencepiece: bytes, config: dict, run_dir: Path) -> None:
    """Refuse a checkpoint that the configured run cannot continue; warn about settings that changed."""
    loop = checkpoint["loops"]["fit_loop"]["epoch_loop.manual_optimization.optim_step_progress"]
    if loop["total"]["completed"] != checkpoint["global_step"]:  # its updates counted by Lightning's automatic loop
        raise InputError(
            f"ckpt_path={path}: written before the update moved into the module (TranslationModule.update, 2026-12); "
            "continue it with the commit that wrote it, or start a new run without ckpt_path"
        )
    before, now = comparable_model(checkpoint["hyper_parameters"]["model"]), comparable_model(model)
    changed = [f"{k} {v} (now {now.get(k)})" for k, v in sorted(before.items()) if k != "dropout" and now.get(k) != v]
    if checkpoint.get("sentencepiece") != sentencepiece:
        changed.append("another SentencePiece model than these data settings give (data.path, data.vocab_size, seed)")
    if changed:
        raise InputError(
            f"ckpt_path={path}: the checkpoint's model has {', '.join(changed)}; resume with the run's own settings "
            "(the same CONFIG and ARGS), or start a new run without ckpt_path"
        )
    if (differ := changed_settings(checkpoint, config, run_dir)) and rank_zero_only.rank == 0:
        changes = "; ".join(f"{k}: {old} -> {new}" for k, (old, new) in differ.items())
        log.warning(f"resuming with settings that differ from the checkpoint's: {changes}")


def check_update_size(path: Path, saved: int, now: int, devices: int, tokens_per_update: int | None) -> None:
    """A resume keeps the update's size: without data.tokens_per_update another number of devices is refused."""
    if tokens_per_update is None and now != saved:
        raise InputError(
            f"ckpt_path={path}: the checkpoint's updates held {saved:,} padded tokens per side, these settings "
            f"give {now:,} on {devices} device(s) (data.tokens_per_update is null: data.max_tokens per device); "
            f"keep the recipe with data.tokens_per_update={saved}, or start a new run without ckpt_path"
        )
    if now != saved and rank_zero_only.rank == 0:
        log.info(f"the update holds {now:,} padded tokens per side on {devices} device(s), the checkpoint's {saved:,}")


def comparable_model(model: dict) -> dict:
    """A model's settings, d_k / d_v null where they are d_model / n_heads (d_k=64 at base equals null)."""
    cfg = TransformerConfig(**model)
    derived = cfg.d_model // cfg.n_heads if cfg.d_model % cfg.n_heads == 0 else None
    return {**asdict(cfg), **{k: None if size == derived else size for k, size in zip(("d_k", "d_v"), cfg.head_sizes)}}


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat
