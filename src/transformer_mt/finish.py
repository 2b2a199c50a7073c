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
from transformer_mt.errors import InputError, MissingInputError, exit_on_user_error, folder_in_use
from transformer_mt.files import remove_stale_temporaries
from transformer_mt.runtime import pick_device
from transformer_mt.training.final import finish_run
from transformer_mt.tuning import ALPHAS, BEAMS


def finish(run_dir: str | Path, device: str = "auto", tune: bool | None = None) -> dict:
    run_dir = Path(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    if not last.is_file():
        raise MissingInputError(f"{last}: no such checkpoint; give RUN=<a training run's folder> (outputs/...)")
    if folder_in_use(run_dir):
        holder = (run_dir / ".lock").read_text(encoding="utf-8", errors="replace").strip() or "a process"
        raise InputError(
            f"{run_dir} is in use by a training that is still running ({holder}): its checkpoints are still being "
            "written. Its own end of run averages and scores it; make finish is for a run whose training has ended"
        )
    for stale in remove_stale_temporaries(last.parent):
        print(f"removed {stale} (the unfinished write of a killed run)")
    checkpoint = read_checkpoint(last, mmap=True, finite=False)
    cfg = checkpoint["hyper_parameters"]["config"]
    if (stopped := stopped_early(checkpoint)) is not None:
        print(
            f"warning: {run_dir}'s training stopped at update {checkpoint['global_step']:,} of the {stopped:,} its "
            "schedule planned (killed, stopped, or out of time): finishing now averages and scores those weights, "
            f"not a trained model's. To train to the end first, resume it (ckpt_path=last hydra.run.dir={run_dir})"
        )
    datamodule = TranslationDataModule(**cfg["data"])
    datamodule.build()  # from the run's caches: the same splits, tokenized as in training
    if "final" not in cfg:
        print(
            f"{last} holds no end-of-run settings (trained before the `final` block): finishing with its defaults, "
            f"the last {cfg['checkpoint']['keep_last']} checkpoints averaged and the test split decoded"
        )
    saved = cfg.get("final") or {"average_last": cfg["checkpoint"]["keep_last"], "splits": ["test"], "tune": False}
    final = {**saved, "enabled": True} | ({"tune": tune} if tune is not None else {})
    final = {"tune_alphas": list(ALPHAS), "tune_beams": list(BEAMS), **final}  # runs from before final.tune
    extra = {"table3_row": cfg.get("table3_row"), "seed": cfg.get("seed"), "finished_by": "make finish"}
    trainer = cfg.get("trainer", {})
    devices = [trainer.get(key) for key in ("devices", "num_nodes")]
    devices = devices[0] * (devices[1] or 1) if isinstance(devices[0], int) else 1  # as configured ("auto": 1)
    return finish_run(
        run_dir, final, cfg["decoding"], datamodule, pick_device(device), cfg["label_smoothing"],
        bool(cfg.get("ema_decay")), extra, devices=devices,
    )  # fmt: skip


def stopped_early(checkpoint: dict) -> int | None:
    """The update at which a run's schedule ends (a time budget's horizon, else trainer.max_steps) where its last
    checkpoint is short of it; None where training reached it (or the checkpoint does not say)."""
    planned = checkpoint["hyper_parameters"]["config"].get("trainer", {}).get("max_steps")
    schedule = (checkpoint.get("lr_schedulers") or [{}])[0].get("lr_lambdas") or [None]
    if isinstance(schedule[0], dict) and schedule[0].get("horizon"):  # a time budget's, once it fixed it
        planned = schedule[0]["horizon"]
    if not isinstance(planned, int) or planned <= 0 or checkpoint.get("global_step", planned) >= planned:
        return None
    return planned


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
