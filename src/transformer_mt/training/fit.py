"""One training run from its composed config: the Trainer's arguments, data, module, callbacks, fit, the end."""

from __future__ import annotations

import contextlib
import inspect
import logging
import multiprocessing
import os
import time
import traceback
import warnings
from dataclasses import fields
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig, OmegaConf

from transformer_mt import runtime
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.errors import InputError, UserError, closest
from transformer_mt.evaluation.protocol import Protocol
from transformer_mt.files import RunFolder, RunFolderLock, shown
from transformer_mt.launcher import Job, check_device, first_process, launched_rank
from transformer_mt.model import TransformerConfig
from transformer_mt.runtime import code_record, cpu_has_native_bf16, use_tf32
from transformer_mt.settings import ModelSettings
from transformer_mt.stops import Stopped, exit_after_training, peer_ended
from transformer_mt.tokenizer import PAD_ID
from transformer_mt.training.batch_fit import FitBatch, shape_updates
from transformer_mt.training.budget import budget_seconds
from transformer_mt.training.callbacks import ProgressLog, RunEnd, StartupLog, UpdateProgressBar
from transformer_mt.training.ema import ExponentialMovingAverage
from transformer_mt.training.logs import finish_wandb, make_loggers, setup_logging
from transformer_mt.training.module import TranslationModule
from transformer_mt.training.resume import (
    RandomState,
    check_resume,
    check_update_size,
    refuse_another_runs_folder,
    resume_checkpoint,
)
from transformer_mt.training.saving import AtomicCheckpointIO, checkpoint_callbacks
from transformer_mt.training.sharding import LayerFSDP
from transformer_mt.training.update import UpdateEnd

log = logging.getLogger(__name__)


def plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def trainer_arguments(cfg: DictConfig, sweep: bool = False) -> dict:
    """conf/trainer as lightning.Trainer arguments, checked against this machine; sweep: a job of a multirun (-m)."""
    args = plain(cfg)
    args.pop("compile", None)  # the module's (TranslationModule.compile_training)
    args.pop("max_time", None)  # a time budget (budget.py), not Lightning's Timer
    accelerator = args.get("accelerator", "auto")
    check_device(accelerator)
    known = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}
    if unknown := sorted(set(args) - known):  # +trainer.max_step=5 would end in the Trainer's TypeError
        hint = f"; did you mean trainer.{match}?" if (match := closest(unknown[0], known)) else ""
        raise InputError(f"trainer.{unknown[0]}: not a lightning.Trainer argument{hint}")
    if args.get("precision") == "auto":  # trainer=cpu: bf16 only where the CPU computes it natively
        on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
        args["precision"] = "bf16-mixed" if not on_cpu or cpu_has_native_bf16() else "32-true"
        if args["precision"] == "32-true":
            log.info("precision: 32-true (this CPU has no native bf16; set trainer.precision=bf16-mixed to force it)")
    if str(args.get("precision")).startswith("16"):  # the module's update applies no loss scale
        raise InputError(f"trainer.precision={args['precision']}: fp16 is not supported; use bf16-mixed or 32-true")
    args["strategy"] = make_strategy(args.get("strategy", "auto"), args.get("devices", 1), sweep)
    if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available() and "32" in str(args["precision"]):
        use_tf32()
        log.info("precision %s on CUDA: fp32 matrix products in TF32 (runtime.use_tf32)", args["precision"])
    return args


def make_callbacks(cfg: DictConfig, checkpoint_dir: Path, startup: StartupLog, saved_max_tokens: int | None = None):
    """UpdateEnd and the parts it runs, the checkpoints, early stopping, the batch size's probe."""
    checkpoints = checkpoint_callbacks(checkpoint_dir, plain(cfg.checkpoint))
    bar = UpdateProgressBar() if cfg.trainer.enable_progress_bar else None
    progress = ProgressLog(cfg.progress_every_n_updates, cfg.progress_every_seconds, startup, bar)
    ema = ExponentialMovingAverage(cfg.ema_decay) if cfg.ema_decay else None
    run_end = RunEnd(checkpoint_dir, cfg.checkpoint.keep_last, summary_later=cfg.final.enabled)
    callbacks = [UpdateEnd(progress, ema, saves=checkpoints[-1]), progress, run_end, RandomState(), SpawnedRankEnd()]
    if cfg.early_stopping_patience:
        best = dict(monitor=cfg.checkpoint.best_monitor, mode=cfg.checkpoint.best_mode)
        # checked as each validation ends (not at the epoch's end, after last.ckpt was written): its state is saved
        callbacks.append(EarlyStopping(patience=cfg.early_stopping_patience, check_on_train_epoch_end=False, **best))
    if cfg.data.max_tokens == "auto":
        callbacks.append(FitBatch(saved_max_tokens))
    return callbacks + [c for c in (ema, bar) if c is not None] + checkpoints


# Numbers that must be 0 or more (their types are settings.py's), and budget.*'s shares (below 1 too)
AT_LEAST_0 = ("seed", "val_bleu_sentences", "progress_every_n_updates", "progress_every_seconds", "final.average_last")
OPTIM = ("label_smoothing", "optim.lr_factor", "optim.warmup_steps", "optim.eps")
SHARES = ("warmup", "cooldown", "average_span", "margin")


def check_config(cfg: DictConfig) -> None:
    """Settings that only fail late (after the data is built, or at the first validation) are refused first."""
    for key in (*AT_LEAST_0, *OPTIM, *(f"budget.{share}" for share in SHARES)):
        if (value := OmegaConf.select(cfg, key)) < 0:
            raise InputError(f"{key}={value}: must be 0 or more")
    interval = cfg.trainer.val_check_interval  # Lightning's argument (trainer=*): updates between validations
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval < 0:
        raise InputError(f"trainer.val_check_interval={interval!r}: must be a number of updates, 0 or more")
    known = {f.name for f in fields(ModelSettings)}  # +model.<key> composes on the typed node: nothing reads it
    if unknown := sorted(set(cfg.model) - known):
        raise InputError(f"model.{unknown[0]}: not a model setting; the model takes {', '.join(sorted(known))}")
    try:  # the model's own checks (types, positive sizes, heads dividing d_model); the vocabulary comes later
        TransformerConfig(**plain(cfg.model), vocab_size=PAD_ID + 1, pad_id=PAD_ID)
    except ValueError as e:
        raise InputError(f"model.{e}") from None
    monitor = cfg.checkpoint.best_monitor
    if monitor and monitor.removeprefix("val/") in ("bleu", "chrf") and not cfg.val_bleu_sentences:
        fix = "checkpoint.best_monitor=val/loss checkpoint.best_mode=min"
        raise InputError(f"checkpoint.best_monitor={monitor} needs val_bleu_sentences > 0; or set {fix}")
    budget_seconds(cfg.trainer.get("max_time"))  # a malformed budget fails here, not after the setup
    for key in SHARES:
        if not cfg.budget[key] < 1:
            raise InputError(f"budget.{key}={cfg.budget[key]}: a share, below 1 (e.g. 0.2)")
    if cfg.early_stopping_patience and not monitor:
        raise InputError("early_stopping_patience needs checkpoint.best_monitor (e.g. val/bleu)")
    ema = cfg.ema_decay
    if ema is not None and not 0 < ema < 1:
        raise InputError(f"ema_decay={ema!r}: must be a number in (0, 1), e.g. 0.9999, or null (off)")
    if ema and cfg.trainer.get("strategy") == "fsdp":
        raise InputError("ema_decay with trainer=fsdp: the moving average needs whole weights on every rank; use ddp")
    compile_step = cfg.trainer.get("compile", False)
    if not isinstance(compile_step, bool) and compile_step != "auto":
        raise InputError(f"trainer.compile={compile_step!r}: must be true, false or auto (on with a CUDA GPU)")
    if compile_step is True and cfg.trainer.get("strategy") == "fsdp":
        raise InputError("trainer.compile with trainer=fsdp is not supported (untested); use ddp, or compile=false")
    splits = cfg.final.splits
    if cfg.final.enabled and (not splits or any(s not in ("validation", "test") for s in splits)):
        raise InputError(f"final.splits={splits}: must be a list of validation and/or test, e.g. final.splits=[test]")


def make_strategy(name, devices=1, sweep: bool = False):
    """trainer.strategy: FSDP per layer (sharding.py); DDP without the per-forward broadcast of buffers."""
    # Lightning's ddp and fsdp start the other ranks by re-running sys.argv: under `-m` from a shell, the whole sweep
    shell_sweep = sweep and not any(k in os.environ for k in ("LOCAL_RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"))
    if name == "fsdp":
        if shell_sweep and devices != 1:
            raise InputError(
                "trainer=fsdp in a Hydra multirun (-m) from a shell would re-run the whole sweep in each of its ranks: "
                "run the jobs one by one, or sweep with hydra/launcher=slurm, or start each job with torchrun/srun"
            )
        return LayerFSDP()
    if name == "ddp" and shell_sweep:  # spawning keeps each job's ranks inside that job
        log.warning("Hydra multirun: using strategy=ddp_spawn instead of ddp (ddp would re-launch the sweep)")
        name = "ddp_spawn"
    if name in ("ddp", "ddp_spawn"):
        return DDPStrategy(start_method="spawn" if name == "ddp_spawn" else "popen", broadcast_buffers=False)
    return name


class SpawnedRankEnd(L.Callback):
    """ddp_spawn's ranks (make_strategy: a Hydra multirun of ddp from a shell) end their process group as the Trainer
    tears down: gloo's threads alive when such a process exits abort it (-6, pytorch/pytorch#190489; 3 sweeps in 12)."""

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if multiprocessing.parent_process() is not None:  # a spawned rank (ddp's popen ranks end in train())
            runtime.end_process_group()


def compiles_training(trainer: DictConfig, accelerator: str) -> bool:
    """trainer.compile; auto: on a CUDA GPU (projected 1.5x eager), not with fsdp (untested), off on a CPU (0.85x)."""
    if (mode := trainer.get("compile", False)) != "auto":
        return bool(mode)
    fsdp = trainer.get("strategy") == "fsdp"
    on_cuda = accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
    if on_cuda and fsdp:
        log.info("trainer.compile=auto: off with trainer=fsdp (untested); trainer.compile=true compiles it")
    return on_cuda and not fsdp


def train(cfg: DictConfig, job: Job) -> float | None:
    """Fit one run in job.run_dir; returns the last validation BLEU (the objective of hparams_search)."""
    refuse_another_runs_folder(cfg.ckpt_path, job.run_dir)  # before anything in the folder is touched
    startup = StartupLog(time.monotonic())
    setup_logging()
    check_config(cfg)
    runtime.keep_freed_memory()  # no page faults for each step's activations
    runtime.bound_onednn_cache()  # host memory stays bounded over a long run
    trainer_args = trainer_arguments(cfg.trainer, sweep=job.sweep_dir is not None)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    try:  # one training per run folder: a second start into it is refused (the job's first process holds it)
        with RunFolderLock(job.run_dir) if first_process() else contextlib.nullcontext():
            return fit(cfg, job, trainer_args, startup)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # fit's Trainer must not outlive it through the traceback
        if isinstance(e, Stopped):  # before training began (UpdateEnd stops it at an update's end)
            e.kept = e.kept or kept(RunFolder(job.run_dir).checkpoints)
        if line := peer_ended(e):
            way_on = f"The newest checkpoint holds the run: continue it with ckpt_path=last hydra.run.dir={job.run_dir}"
            if not any(RunFolder(job.run_dir).checkpoints.glob("*.ckpt")):
                way_on = "No checkpoint was written yet: start it again"
            raise UserError(f"{line}. {way_on}") from None
        raise
    finally:
        # Where gloo's threads outlive the Trainer (fsdp), the entry point leaves past finalization (train.py)
        if still_running := runtime.end_process_group():
            log.info("the process group outlived the run (threads %s): ending past finalization", still_running)


def fit(cfg: DictConfig, job: Job, trainer_args: dict, startup: StartupLog) -> float | None:
    """The run in its folder: what to resume from, the data, the module, the Trainer, fit."""
    run_dir = job.run_dir
    checkpoint_dir = RunFolder(run_dir).checkpoints
    config = {**plain(cfg), "code": code_record()}  # every checkpoint's, the run's record's and results.json's
    resume_path, resumed = resume_checkpoint(cfg.ckpt_path, run_dir, config)  # a bad file fails here, first
    saved_max_tokens = None
    datamodule = TranslationDataModule(**plain(cfg.data))
    if launched_rank() != 0:  # torchrun/srun started every rank at once: rank 0 builds, the others read its caches
        datamodule.cache.wait_for_rank_0()
    datamodule.build()  # the vocabulary size is known only after SentencePiece
    datamodule.check_lengths(cfg.model.max_positions)
    startup.mark("data ready")
    model_cfg = {**plain(cfg.model), "vocab_size": len(datamodule.tokenizer), "pad_id": PAD_ID}
    seconds = budget_seconds(cfg.trainer.get("max_time"))  # trainer.max_time and the budget block: TimeBudget's
    budget = dict(seconds=seconds, keep_last=cfg.checkpoint.keep_last, **plain(cfg.budget)) if seconds else None
    module = TranslationModule(
        model_cfg,
        cfg.label_smoothing,
        **plain(cfg.optim),
        val_bleu_sentences=cfg.val_bleu_sentences,
        budget=budget,
        config=config,
        tokenizer=datamodule.tokenizer,
    )
    if compiles_training(cfg.trainer, trainer_args.get("accelerator", "auto")):
        module.compile_training()
    if resume_path:
        check_resume(resume_path, resumed, model_cfg, datamodule.tokenizer.proto, config, run_dir)
        log.info("resuming from %s (update %s)", resume_path, f"{resumed['global_step']:,}")
        if resume_path.parent.resolve() == checkpoint_dir.resolve():  # continuing in place, as documented
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        saved, saved_max_tokens = resumed["update_tokens"], resumed["max_tokens"]
        del resumed  # Lightning reads the file itself
    loggers = make_loggers(cfg.get("logger"), job)
    callbacks = make_callbacks(cfg, checkpoint_dir, startup, saved_max_tokens)
    trainer = L.Trainer(
        **trainer_args,
        logger=loggers,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=run_dir,
        enable_model_summary=False,
    )
    if datamodule.max_tokens != "auto":  # else FitBatch does, once it has measured the device
        now = shape_updates(trainer, datamodule, module)
        if resume_path and saved:
            check_update_size(resume_path, saved, now, trainer.world_size, datamodule.tokens_per_update)
    if trainer.is_global_zero:
        params, vocabulary = sum(p.numel() for p in module.parameters()), model_cfg["vocab_size"]
        log.info(f"model: {params:,} parameters, vocabulary {vocabulary}, precision {trainer.precision}")
        log.info("code: %s", ", ".join(f"{key} {value}" for key, value in config["code"].items()))
        datamodule.tokenizer.save(run_dir)  # for other tools; every checkpoint carries it too
        if job.record is not None:  # the start's checks passed: its settings become the run's record
            job.record(cfg, config["code"])
        log.info("run directory: %s", run_dir)
        if cfg.final.enabled:
            log.info("%s", Protocol.of_run(RunFolder(run_dir), config).plan())
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_path)
        return after_fit(config, job, trainer, loggers)
    finally:
        finish_wandb(loggers)


def kept(checkpoint_dir: Path) -> str:
    """What a stop before the first update keeps, and how to go on."""
    if not any(checkpoint_dir.glob("*.ckpt")):
        return "before the first update: nothing was trained, and the new run folder is removed"
    return (
        f"before training went on; the checkpoints in {shown(checkpoint_dir)} are as they were: continue with "
        f'make train ARGS="... ckpt_path=last hydra.run.dir={shown(checkpoint_dir.parent)}"'
    )


def after_fit(config: dict, job: Job, trainer: L.Trainer, loggers: list) -> float | None:
    """Exits 128 + a stop signal's number; else the end-of-run protocol on rank 0; returns the last validation BLEU."""
    stopped_by = trainer.callback_metrics.get("stopped_by_signal")  # UpdateEnd's (also from ddp_spawn's workers)
    if stopped_by is not None:
        exit_after_training(int(stopped_by), trainer.is_global_zero)
    run_end = next(c for c in trainer.callbacks if isinstance(c, RunEnd))
    if config["final"]["enabled"] and trainer.is_global_zero:
        if torch.distributed.is_initialized():  # (not in ddp_spawn's main process) the other ranks leave
            log.info(f"the end of the run on rank 0 alone: the other {trainer.world_size - 1} rank(s) exit now")
        progress = next(c for c in trainer.callbacks if isinstance(c, ProgressLog))
        protocol = Protocol.of_run(RunFolder(job.run_dir), config, devices=trainer.world_size)
        protocol.extra["overrides"] = list(job.overrides)
        try:
            results = protocol.run_on(trainer.strategy.root_device, progress.peak)
        except Stopped as e:
            e.kept = (
                f"in the end of the run; training is complete and its checkpoints kept: finish it with "
                f"make finish RUN={shown(job.run_dir)}"
            )
            raise
        for logger in loggers:
            logger.log_metrics(results.metrics(), step=results.updates)
            logger.save()
        run_end.log_summary(trainer, results.updates)  # the commands that follow, after the averaging
    bleu = trainer.callback_metrics.get("val/bleu")
    return float(bleu) if bleu is not None else None
