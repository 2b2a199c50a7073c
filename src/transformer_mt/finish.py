"""Finish a run's end-of-run protocol (§6.1) that was interrupted or never ran: `make finish RUN=<run dir>`, from the
settings in its last.ckpt, without Lightning (no MFU: the training devices' peak is not known here).

    python -m transformer_mt.finish outputs/<date>/<time> [--device cuda]
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.errors import CommandParser, InputError, MissingInputError, exit_on_user_error
from transformer_mt.evaluation.protocol import Protocol
from transformer_mt.files import RunFolder, next_commands, remove_stale_temporaries
from transformer_mt.results import Results
from transformer_mt.runtime import pick_device
from transformer_mt.stops import Stopped


def finish(run_dir: str | Path, device: str = "auto") -> Results:
    run = RunFolder(Path(run_dir))
    last = run.last
    if not last.is_file():
        raise MissingInputError(f"{last}: no such checkpoint; give RUN=<a training run's folder> (outputs/...)")
    if run.in_use():
        raise InputError(
            f"{run.path} is in use by a training that is still running ({run.holder()}): its own end of run averages "
            "and scores it; make finish is for a run whose training has ended"
        )
    remove_stale_temporaries(last.parent, print)
    checkpoint = read_checkpoint(last, mmap=True, finite=False)
    if (stopped := stopped_early(checkpoint)) is not None:
        print(
            f"warning: {run.path}'s training stopped at update {checkpoint['global_step']:,} of the {stopped:,} its "
            "schedule planned (killed, stopped, or out of time): finishing now averages and scores those weights, "
            f"not a trained model's. To train to the end first, resume it (ckpt_path=last hydra.run.dir={run.path})"
        )
    protocol = Protocol.of_run(run, checkpoint["hyper_parameters"]["config"])
    protocol.extra["finished_by"] = "make finish"
    if (overrides := run.path / ".hydra" / "overrides.yaml").is_file():  # the training's command line (model card)
        protocol.extra["overrides"] = list(OmegaConf.load(overrides))
    try:
        results = protocol.run_on(pick_device(device))
    except Stopped as e:
        e.kept = f"the run's checkpoints are kept, no results.json written: run make finish RUN={run.path} again"
        raise
    model = Path(next(iter(results.models.values()))["checkpoint"])  # the average (or last.ckpt), as a run's end
    print("\n".join(["next:", *next_commands(model)]))
    return results


def stopped_early(checkpoint: dict) -> int | None:
    """The schedule's last update (a time budget's horizon, else max_steps) if the checkpoint is short of it and
    early stopping did not end it (its patience used up)."""
    stopping = [s for key, s in checkpoint.get("callbacks", {}).items() if key.startswith("EarlyStopping")]
    if any(s["wait_count"] >= s["patience"] for s in stopping):
        return None
    max_steps = checkpoint["hyper_parameters"]["config"]["trainer"]["max_steps"]
    planned = (checkpoint.get("budget") or {}).get("horizon") or max_steps  # a time budget's (training/budget.py)
    return planned if planned > 0 and checkpoint["global_step"] < planned else None


def main() -> None:
    parser = CommandParser(__doc__)
    parser.add_argument("run_dir", help="a training run's folder (holding checkpoints/last.ckpt)")
    parser.add_argument("--device", default="auto", help="auto (a CUDA GPU if there is one), cpu or cuda")
    args = parser.parse()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    exit_on_user_error(finish, args.run_dir, args.device)


if __name__ == "__main__":
    main()
