"""Finish a run's end-of-run protocol (§6.1) that was interrupted or never ran: `make finish RUN=<run dir>`.

Reads the run's settings from its last.ckpt (the `final` block, decoding, data, label smoothing, EMA), then
averages, decodes and scores as the end of a run does (evaluation/protocol.py, built the same way, without
Lightning): results.json in the run folder.
The MFU is left out (the training devices' peak is not known here); everything else is the same.

    python -m transformer_mt.finish outputs/<date>/<time> [--device cuda]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.errors import CommandParser, InputError, MissingInputError, exit_on_user_error
from transformer_mt.evaluation.protocol import Protocol
from transformer_mt.files import RunFolder, remove_stale_temporaries
from transformer_mt.results import Results
from transformer_mt.runtime import pick_device
from transformer_mt.training.budget import TimeBudget


def finish(run_dir: str | Path, device: str = "auto", tune: bool | None = None) -> Results:
    run = RunFolder(Path(run_dir))
    last = run.last
    if not last.is_file():
        raise MissingInputError(f"{last}: no such checkpoint; give RUN=<a training run's folder> (outputs/...)")
    if run.in_use():
        raise InputError(
            f"{run.path} is in use by a training that is still running ({run.holder()}): its checkpoints are still "
            "being written. Its own end of run averages and scores it; make finish is for a run whose training has "
            "ended"
        )
    for stale in remove_stale_temporaries(last.parent):
        print(f"removed {stale} (the unfinished write of a killed run)")
    checkpoint = read_checkpoint(last, mmap=True, finite=False)
    cfg = checkpoint["hyper_parameters"]["config"]
    if (stopped := stopped_early(checkpoint)) is not None:
        print(
            f"warning: {run.path}'s training stopped at update {checkpoint['global_step']:,} of the {stopped:,} its "
            "schedule planned (killed, stopped, or out of time): finishing now averages and scores those weights, "
            f"not a trained model's. To train to the end first, resume it (ckpt_path=last hydra.run.dir={run.path})"
        )
    if "final" not in cfg:
        print(
            f"{last} holds no end-of-run settings (trained before the `final` block): finishing with its defaults, "
            f"the last {cfg['checkpoint']['keep_last']} checkpoints averaged and the test split decoded"
        )
    protocol = Protocol.of_run(run, cfg, **({"tune": tune} if tune is not None else {}))
    protocol.extra["finished_by"] = "make finish"
    return protocol.run_on(pick_device(device))


def stopped_early(checkpoint: dict) -> int | None:
    """The update at which a run's schedule ends (a time budget's horizon, else trainer.max_steps) where its last
    checkpoint is short of it; None where training reached it (or the checkpoint does not say)."""
    budget = TimeBudget.of(checkpoint)
    planned = (
        budget.horizon
        if budget and budget.horizon
        else checkpoint["hyper_parameters"]["config"]["trainer"]["max_steps"]
    )
    if not isinstance(planned, int) or planned <= 0 or checkpoint["global_step"] >= planned:
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
