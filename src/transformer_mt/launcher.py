"""Where this process runs, read without importing torch: its launcher and job's name, whether a GPU can be visible."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.errors import InputError


def launched_rank() -> int:
    """The global rank when an outside launcher started every rank (torchrun: RANK; srun: SLURM_PROCID), else 0."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def first_process() -> bool:
    """Global rank 0, not a rank Lightning's ddp started itself (LOCAL_RANK set), on the first node."""
    local = int(os.environ.get("LOCAL_RANK") or 0)
    return launched_rank() == 0 and local == 0 and int(os.environ.get("NODE_RANK") or 0) == 0


def launch_id() -> str | None:
    """A name every rank of a launched job shares, restarted too; None outside a launcher (an salloc shell too)."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none"):
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if "SLURM_JOB_ID" not in env:
        return None
    job = env["SLURM_JOB_ID"]
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return f"slurm-{job}-{env['SLURM_STEP_ID']}"
    return f"slurm-{job}" if env.get("ENVIRONMENT") == "BATCH" else None  # sbatch sets ENVIRONMENT=BATCH


@dataclass(frozen=True)
class Job:
    """What train.py tells a training of its Hydra job (sweep_dir and number: None outside a sweep)."""

    run_dir: Path
    overrides: tuple[str, ...] = ()
    sweep_dir: str | None = None
    number: int | None = None
    instantiate: Callable | None = None
    record: Callable | None = None  # record(cfg, code): the run's .hydra/ record, once its start's checks passed


GPU_DEVICE_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")  # NVIDIA's driver, or ROCm's


def gpu_may_be_visible() -> bool:
    """False where no GPU driver's device file exists or CUDA_VISIBLE_DEVICES hides every GPU."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1")
    return not hidden and any(Path(p).exists() for p in GPU_DEVICE_FILES)


def check_device(accelerator: str) -> None:
    """A GPU recipe without a GPU is refused; torch (seconds to import) is asked only where a GPU may be."""
    if accelerator not in ("gpu", "cuda"):
        return
    if "torch" in sys.modules or gpu_may_be_visible():
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            return
    raise InputError(
        f"trainer.accelerator={accelerator} needs a CUDA GPU and none is visible here. On a CPU, train the "
        'Multi30k recipe (~26 minutes on 2 cores): make train CONFIG=multi30k [ARGS="data.path=<folder with '
        'train.en, train.de, ...>"]; only to force this config onto the CPU (days for base) add trainer=cpu'
    )
