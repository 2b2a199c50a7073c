"""Finish a run's end-of-run protocol (§6.1) that was interrupted or never ran: `make finish RUN=<run dir>`.

Reads the run's settings from its last.ckpt (the `final` block, decoding, data, label smoothing, EMA), then
averages, decodes and scores as training/final.py does at the end of a run: results.json in the run folder.
The MFU is left out (the training devices' peak is not known here); everything else is the same.

    python -m transformer_mt.finish outputs/<date>/<time> [--device cuda]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.commandline import CommandParser
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.errors import MissingInputError, exit_on_user_error
from transformer_mt.files import remove_stale_temporaries
from transformer_mt.runtime import pick_device
from transformer_mt.training.final import finish_run
from transformer_mt.tuning import ALPHAS, BEAMS


def finish(run_dir: str | Path, device: str = "auto", tune: bool | None = None) -> dict:
    run_dir = Path(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    if not last.is_file():
        raise MissingInputError(f"{last}: no such checkpoint; give RUN=<a training run's folder> (outputs/...)")
    for stale in remove_stale_temporaries(last.parent):
        print(f"removed {stale} (the unfinished write of a killed run)")
    checkpoint = read_checkpoint(last, mmap=True, finite=False)
    cfg = checkpoint["hyper_parameters"]["config"]
    datamodule = TranslationDataModule(**cfg["data"])
    datamodule.build()  # from the run's caches: the same splits, tokenized as in training
    final = {**cfg["final"], "enabled": True} | ({"tune": tune} if tune is not None else {})
    final = {"tune_alphas": list(ALPHAS), "tune_beams": list(BEAMS), **final}  # runs from before final.tune
    extra = {"table3_row": cfg.get("table3_row"), "seed": cfg.get("seed"), "finished_by": "make finish"}
    trainer = cfg.get("trainer", {})
    devices = [trainer.get(key) for key in ("devices", "num_nodes")]
    devices = devices[0] * (devices[1] or 1) if isinstance(devices[0], int) else 1  # as configured ("auto": 1)
    return finish_run(
        run_dir, final, cfg["decoding"], datamodule, pick_device(device), cfg["label_smoothing"],
        bool(cfg.get("ema_decay")), extra, devices=devices,
    )  # fmt: skip


def main() -> None:
    parser = CommandParser(__doc__)
    parser.add_argument("run_dir", help="a training run's folder (holding checkpoints/last.ckpt)")
    parser.add_argument("--device", default="auto", help="auto (a CUDA GPU if there is one), cpu or cuda")
    parser.add_argument(
        "--tune",
        action=argparse.BooleanOptionalAction,
        help="choose decoding on the validation split first (final.tune)",
    )
    args = parser.parse()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    exit_on_user_error(finish, args.run_dir, args.device, args.tune)


if __name__ == "__main__":
    main()
