"""Training entry point: `make train CONFIG=base` == `python -m transformer_mt.train experiment=base`; the command
line is checked before torch and Lightning are imported (training/fit.py)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from transformer_mt.commandline import check_command_line, hydra_job, run_task
from transformer_mt.configs import CONF_DIR
from transformer_mt.errors import exit_on_user_error
from transformer_mt.launcher import check_device


def train_job(cfg: DictConfig, job) -> float | None:
    from transformer_mt.training.fit import train  # noqa: PLC0415 (torch and Lightning once the command line is good)

    return train(cfg, job)


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def run(cfg: DictConfig) -> float | None:
    return run_task(train_job, cfg, hydra_job())  # a stop while torch loads, too, is one line and no folder


def main() -> None:
    """`make train`: the command line checked before Hydra makes a run folder (a bad key: one line, no folder)."""
    argv = sys.argv[1:]
    cfg = exit_on_user_error(check_command_line, "train", argv)
    sweep = any(a in ("-m", "--multirun") or a.startswith("hparams_search=") for a in argv)
    if cfg is not None and not sweep:  # a sweep's jobs may run elsewhere (hydra/launcher=slurm): each checks its own
        exit_on_user_error(check_device, cfg.trainer.accelerator)
    status = None
    try:
        exit_on_user_error(run)  # a stop signal (Ctrl+C) anywhere: one line, 128 + it
        status = 0
    except SystemExit as e:  # a stop by a signal (128 + its number), a refused start (1)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    finally:  # where a training ran (it loaded runtime): runtime.leave_if_gloo_remains
        if status is not None and (runtime := sys.modules.get("transformer_mt.runtime")) is not None:
            runtime.leave_if_gloo_remains(status)


if __name__ == "__main__":
    main()
