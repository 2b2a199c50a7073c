"""Checkpoint files: atomic writes, safe reads, a run's checkpoints and their average (§6.1), inference's model."""

from __future__ import annotations

import pickle
import re
import shutil
from dataclasses import fields
from pathlib import Path

import torch

from transformer_mt.errors import InputError, MissingInputError, UserError
from transformer_mt.files import RunFolder, atomic_write
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.runtime import bound_onednn_cache, keep_freed_memory, pick_device, set_threads, use_tf32
from transformer_mt.tokenizer import Tokenizer

EMA_KEY = "ExponentialMovingAverage"  # training/ema.py's callback state in a checkpoint (Lightning: its class name)


def write_checkpoint(checkpoint: dict, path: str | Path) -> Path:
    """torch.save to a temporary file, then rename: a crash never leaves a truncated checkpoint."""
    path = Path(path)
    try:
        with atomic_write(path) as tmp:
            torch.save(checkpoint, tmp)
    except (OSError, RuntimeError) as e:  # a full disk: torch says "[enforce fail ...] unexpected pos"
        free = shutil.disk_usage(path.parent).free / 2**20
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"could not write {path}: {cause} ({free:,.0f} MiB free there: a full disk, or a folder that cannot be "
            "written). Nothing partial was left behind: free space or write elsewhere and run the command again (a "
            "training continues with ckpt_path=last)"
        ) from e
    return path


def read_checkpoint(path: str | Path, mmap: bool = False, finite: bool = True) -> dict:
    """torch.load(weights_only=True), one line for a file not ours; finite: NaN or inf weights refused."""
    if not str(path).strip():
        raise MissingInputError("no checkpoint given: set ckpt=<path to a .ckpt file> (make ... CKPT=...)")
    path = Path(path)
    if path.is_dir():  # e.g. a run folder
        found = ", ".join(str(p.relative_to(path)) for p in sorted(path.glob("**/*.ckpt"))[:3]) or "none"
        raise InputError(f"{path} is a folder: give a checkpoint file in it (the first .ckpt files there: {found})")
    if not path.is_file():
        raise MissingInputError(f"checkpoint not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            raise InputError(f"{path}: not a checkpoint (torch.save writes a zip archive; this file is not one)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:  # torch's own message advises weights_only=False, which lets the file run code
        raise InputError(
            f"{path}: holds Python objects besides tensors and plain values, which are not loaded (unpickling "
            "them can run code); it was not written by transformer_mt"
        ) from None
    except Exception as e:  # a truncated or damaged archive
        cause = str(e).split(". ")[0].splitlines()[0]
        raise InputError(f"{path}: damaged or incomplete checkpoint ({type(e).__name__}: {cause})") from None
    hparams = checkpoint.get("hyper_parameters", {}) if isinstance(checkpoint, dict) else {}
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "model" not in hparams:
        raise InputError(f"{path}: not a transformer_mt checkpoint (no state_dict / hyper_parameters.model)")
    if unknown := sorted(set(hparams["model"]) - {f.name for f in fields(TransformerConfig)}):
        made_by = hparams.get("config", {}).get("code", {}).get("commit", "not recorded")
        raise InputError(
            f"{path}: its model has settings this version does not know ({', '.join(unknown)}): a newer "
            f"transformer_mt wrote it (its commit: {made_by}); read it with that version"
        )
    if finite:
        check_finite(path, checkpoint)
    return checkpoint


def check_finite(path: str | Path, checkpoint: dict) -> None:
    for key, value in checkpoint["state_dict"].items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            nan, inf = int(value.isnan().sum()), int(value.isinf().sum())
            raise InputError(
                f"{path}: the weights are not finite: {key} holds {nan:,} NaN and {inf:,} inf of "
                f"{value.numel():,} values; use another checkpoint (an earlier one of the run, or its average)"
            )


def load_for_inference(path: str | Path) -> tuple[Transformer, Tokenizer, dict]:
    """A checkpoint (trained or averaged) -> eval-mode model, its SentencePiece model, the raw dict."""
    checkpoint = read_checkpoint(path)
    model = Transformer(TransformerConfig(**checkpoint["hyper_parameters"]["model"]))
    # Weights live under "model." in the LightningModule; torch.compile adds "_orig_mod.".
    state = {k.removeprefix("model.").replace("_orig_mod.", ""): v for k, v in checkpoint["state_dict"].items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise InputError(f"{path}: weights do not fit the model its hyper_parameters describe: {e}") from None
    tokenizer = Tokenizer(proto=checkpoint["sentencepiece"], origin=f"{path} (sentencepiece)")
    return model.requires_grad_(False).eval(), tokenizer, checkpoint


def start_inference(ckpt: str | Path, device: str = "auto", threads: int = 0) -> tuple[Transformer, Tokenizer, dict]:
    """Every inference command's start: memory settings as in training, the model on `device`, `threads` threads."""
    keep_freed_memory()
    bound_onednn_cache()
    model, tokenizer, checkpoint = load_for_inference(ckpt)
    model.to(pick_device(device))
    if next(model.parameters()).device.type == "cuda":
        use_tf32()
    set_threads(threads)
    return model, tokenizer, checkpoint


def run_checkpoints(run_dir: str | Path) -> list[Path]:
    """A run's periodic checkpoints, oldest first, one per update (last.ckpt and averages excluded)."""
    folder = RunFolder(run_dir).checkpoints
    folder = folder if folder.is_dir() else Path(run_dir)
    by_step: dict[int, Path] = {}
    for path in folder.glob("*.ckpt"):
        if (match := re.search(r"step(\d+)", path.stem)) and not path.name.startswith(RunFolder.AVERAGE):
            by_step.setdefault(int(match.group(1)), path)  # time- and step-triggered saves can coincide
    if not by_step:
        raise MissingInputError(f"no periodic checkpoints (*step<N>.ckpt) in {folder}")
    return [by_step[s] for s in sorted(by_step)]


def average_checkpoints(paths: list[str | Path]) -> dict:
    """Mean of the weights (summed in float64); everything else (config, SentencePiece) from the newest checkpoint."""
    first = Path(paths[0])
    reference = read_checkpoint(first)
    total = {k: v.double() if v.is_floating_point() else v.clone() for k, v in reference["state_dict"].items()}
    for path in map(Path, paths[1:]):
        reference = read_checkpoint(path)  # the newest one's metadata is kept
        state = reference["state_dict"]
        if state.keys() != total.keys():
            diff = sorted(state.keys() ^ total.keys())[:5]
            raise InputError(f"{path} and {first} hold different parameters (e.g. {diff}): average one run's only")
        for key, value in state.items():
            if value.shape != total[key].shape:
                raise InputError(
                    f"{path}: {key} has shape {tuple(value.shape)}, {first} has "
                    f"{tuple(total[key].shape)}; average checkpoints of one run only"
                )
            if value.is_floating_point():
                total[key] += value.double()
    dtypes = {k: v.dtype for k, v in reference["state_dict"].items()}
    averaged = {k: (v / len(paths)).to(dtypes[k]) if v.is_floating_point() else v for k, v in total.items()}
    keep = {k: reference[k] for k in ("hyper_parameters", "sentencepiece", "global_step", "epoch") if k in reference}
    return {**keep, "state_dict": averaged, "averaged_from": [Path(p).name for p in paths]}  # however spelled


def ema_state(checkpoint: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's moving average (training/ema.py) as the LightningModule's state_dict, in the weights' dtypes."""
    weights, average = checkpoint["state_dict"], checkpoint["callbacks"][EMA_KEY]["average"]
    return {f"model.{name}": value.to(weights[f"model.{name}"].dtype) for name, value in average.items()}
