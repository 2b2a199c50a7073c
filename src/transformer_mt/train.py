"""Training entry point: `make train CONFIG=base` == `python -m transformer_mt.train experiment=base`."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf

from transformer_mt.data import TranslationDataModule
from transformer_mt.model import DecoderLayer, EncoderLayer
from transformer_mt.module import TranslationModule, write_checkpoint
from transformer_mt.tokenizer import PAD_ID

log = logging.getLogger(__name__)
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def make_logger(cfg: DictConfig | None):
    if cfg is None:
        return False
    if cfg._target_.endswith("WandbLogger") and not os.environ.get("WANDB_MODE") and not wandb_has_credentials():
        os.environ["WANDB_MODE"] = "offline"
        log.warning("wandb: no API key found, logging offline under %s/wandb (upload later with `wandb sync`)",
                    cfg.save_dir)
    return hydra.utils.instantiate(cfg)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, made atomic (write_checkpoint: temporary file + rename)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        write_checkpoint(checkpoint, path)


def make_callbacks(cfg: DictConfig, checkpoint_dir: Path) -> list:
    """Periodic checkpoints by updates and/or by time, keeping the last N, and last.ckpt."""
    periodic = []
    if cfg.every_n_train_steps:
        periodic.append(dict(every_n_train_steps=cfg.every_n_train_steps, filename="step{step:07d}"))
    if cfg.train_time_interval_minutes:
        periodic.append(dict(train_time_interval=timedelta(minutes=cfg.train_time_interval_minutes),
                             filename="time-step{step:07d}"))
    common = dict(dirpath=checkpoint_dir, save_last=True, auto_insert_metric_name=False)
    callbacks = [ModelCheckpoint(save_top_k=cfg.keep_last, monitor="step", mode="max", **common, **kw)
                 for kw in periodic] or [ModelCheckpoint(save_top_k=0, **common)]  # last.ckpt per epoch
    return callbacks + [LearningRateMonitor(logging_interval="step")]


def make_strategy(name):
    """String strategies from trainer configs; FSDP is wrapped per encoder/decoder layer."""
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy  # noqa: PLC0415

        return FSDPStrategy(auto_wrap_policy={EncoderLayer, DecoderLayer})
    launched_outside = any(k in os.environ for k in ("LOCAL_RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"))
    if name == "ddp" and HydraConfig.get().mode == RunMode.MULTIRUN and not launched_outside:
        # Lightning's `ddp` re-runs sys.argv for the other ranks, which under `-m` would re-run the
        # whole sweep in every child; spawning keeps each job's ranks inside that job.
        log.warning("Hydra multirun: using strategy=ddp_spawn instead of ddp (ddp would re-launch the sweep)")
        return "ddp_spawn"
    return name


def train(cfg: DictConfig) -> float | None:
    """Fit one run; returns the last validation BLEU (the objective of hparams_search)."""
    L.seed_everything(cfg.seed, workers=True)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    datamodule = TranslationDataModule(**plain(cfg.data))
    datamodule.build()  # the vocabulary size is known only after SentencePiece
    model_cfg = {**plain(cfg.model), "vocab_size": len(datamodule.tokenizer), "pad_id": PAD_ID}
    module = TranslationModule(
        model=model_cfg, label_smoothing=cfg.label_smoothing, **plain(cfg.optim),
        val_bleu_sentences=cfg.val_bleu_sentences, decoding=plain(cfg.decoding), config=plain(cfg),
    )
    trainer_args = plain(cfg.trainer)
    trainer_args["strategy"] = make_strategy(trainer_args.get("strategy", "auto"))
    checkpoint_dir = run_dir / "checkpoints"
    trainer = L.Trainer(**trainer_args, logger=make_logger(cfg.get("logger")),
                        callbacks=make_callbacks(cfg.checkpoint, checkpoint_dir), plugins=[AtomicCheckpointIO()],
                        default_root_dir=run_dir)
    trainer.accumulate_grad_batches = datamodule.accumulation(trainer.world_size)
    tokens = trainer.accumulate_grad_batches * datamodule.max_tokens * trainer.world_size
    if trainer.is_global_zero:
        n_params = sum(p.numel() for p in module.parameters())
        log.info("model: %s parameters, vocabulary %d", f"{n_params:,}", model_cfg["vocab_size"])
        log.info("tokens per update: accumulation %d x max_tokens %d x %d device(s) = %s padded tokens per "
                 "side (target: %s)", trainer.accumulate_grad_batches, datamodule.max_tokens, trainer.world_size,
                 f"{tokens:,}", datamodule.tokens_per_update)
        datamodule.tokenizer.save(checkpoint_dir)
        log.info("run directory: %s", run_dir)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    trainer.save_checkpoint(checkpoint_dir / "last.ckpt")  # the final state, whatever the schedule
    bleu = trainer.callback_metrics.get("val/bleu")
    return float(bleu) if bleu is not None else None


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    main()
