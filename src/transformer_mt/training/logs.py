"""Where a training run's lines and metrics go: one log setup, the configured logger and CSV, a wandb run per job."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from transformer_mt.launcher import Job

log = logging.getLogger(__name__)

# Library warnings that say nothing about this run (Lightning 2.6's use of a torch API; tiny runs only)
QUIET_WARNINGS = (r".*isinstance\(treespec, LeafSpec\)` is deprecated", r".*is smaller than the logging interval")


def setup_logging() -> None:
    """Every line once, through Hydra's root logger (console and <run>/train.log); ranks other than 0 warnings only."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "datasets", "huggingface_hub"):  # own handlers
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
    for handler in logging.getLogger().handlers:  # Hydra's console and file handlers; no Lightning cloud adverts
        handler.addFilter(lambda record: not str(record.msg).startswith("💡 Tip:"))
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger -> console and file
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    if rank_zero_only.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)


def make_loggers(cfg: DictConfig | None, job: Job) -> list:
    """The configured logger, if any, and always the metrics as CSV (<run>/csv/, what `make plot` reads)."""
    configured = [make_logger(cfg, job)] if cfg is not None else []
    csv = any(isinstance(logger, CSVLogger) for logger in configured)
    return configured + ([] if csv else [CSVLogger(job.run_dir, name="csv")])


def make_logger(cfg: DictConfig, job: Job):
    kwargs = {}
    if cfg["_target_"].endswith("WandbLogger"):
        netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        key = os.environ.get("WANDB_API_KEY") or netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
        if os.environ.get("WANDB_MODE", "") in ("", "offline") and not key:
            os.environ["WANDB_MODE"] = "offline"
            (log.warning if rank_zero_only.rank == 0 else log.debug)(  # one line per run, not per rank
                "wandb: no API key found, logging offline under %s/wandb (upload later with `wandb sync`)", cfg.save_dir
            )
        import wandb  # noqa: PLC0415 (only with this logger)

        # No ~35-line summary at the close: the run's last lines are its results and the next commands
        kwargs["settings"] = wandb.Settings(quiet=True)
        if job.sweep_dir is not None:  # one wandb run per job (see finish_wandb), grouped by sweep
            kwargs["group"] = cfg.group or job.sweep_dir
            kwargs["name"] = cfg.name or f"{Path(job.sweep_dir).name}-{job.number}"
    # cfg is the composed logger config (conf/logger and the command line), never one read from a checkpoint or a run
    # folder: instantiate imports and calls whatever `_target_` names.
    return job.instantiate(cfg, **kwargs)


def finish_wandb(loggers: list) -> None:
    """End this job's wandb run, so that the next job of a sweep starts its own (wandb.init reuses an open one)."""
    if any(type(logger).__name__ == "WandbLogger" for logger in loggers):
        import wandb  # noqa: PLC0415 (only with this logger)

        wandb.finish()  # the current run, if one was started
