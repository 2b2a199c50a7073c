"""Which launcher started this process (torchrun, srun, Lightning's ddp) and the name of its job: environment
variables only, nothing imported (the command line's check and the run folder's name read it before torch)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def launched_rank() -> int:
    """This process's global rank when an outside launcher started every rank (torchrun: RANK; srun:
    SLURM_PROCID), else 0. Lightning's own ddp starts the other ranks later, from inside fit()."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def first_process() -> bool:
    """The job's first process: global rank 0, and not one of the ranks Lightning's ddp starts itself
    (those re-run the command with LOCAL_RANK set), on the first node (NODE_RANK)."""
    local = int(os.environ.get("LOCAL_RANK") or 0)
    return launched_rank() == 0 and local == 0 and int(os.environ.get("NODE_RANK") or 0) == 0


def launch_id() -> str | None:
    """A name shared by every rank of one launched job, and by the same job restarted or requeued:
    torchrun's run id; under SLURM the job (an array's job and task) and, for an srun step, the step:
    slurm-<job>-<step>, or slurm-<job> for a batch script that runs python itself (sbatch sets
    ENVIRONMENT=BATCH there). None outside a launcher, an salloc shell included."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return None
    job = env["SLURM_JOB_ID"]
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"  # each task its own, as scontrol names it
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return f"slurm-{job}-{env['SLURM_STEP_ID']}"
    return f"slurm-{job}" if env.get("ENVIRONMENT") == "BATCH" else None


@dataclass(frozen=True)
class Job:
    """What the entry point (Hydra, in train.py) tells a training about its job: its run folder, its command-line
    overrides, the sweep it is one job of (a -m job: the sweep's folder and the job's number; None: no sweep), and
    the function that makes objects of the configs with a _target_ (the loggers: hydra.utils.instantiate)."""

    run_dir: Path
    overrides: tuple[str, ...] = ()
    sweep_dir: str | None = None
    number: int | None = None
    instantiate: Callable | None = None
