"""Hydra configs and the training entry point, run as a user runs them (subprocesses)."""

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import CONF, synthetic_corpus, write_pair
from transformer_mt.data import TranslationDataModule
from transformer_mt.model import Transformer, TransformerConfig

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
TINY_MODEL = ["model.d_model=32", "model.d_ff=64", "model.n_heads=4", "model.n_encoder_layers=2",
              "model.n_decoder_layers=2", "model.max_positions=128"]


def compose_train(overrides: list[str], tmp_path: Path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=False)
    return cfg


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(experiment, tmp_path):
    cfg = compose_train([f"experiment={experiment}", f"data.cache_dir={tmp_path}"], tmp_path)
    with torch.device("meta"):
        Transformer(TransformerConfig(vocab_size=cfg.data.vocab_size, **cfg.model))
    TranslationDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    if trainer_args["accelerator"] == "gpu" and not torch.cuda.is_available():
        trainer_args.update(accelerator="cpu", precision="bf16-mixed")  # same keys, checked on CPU
    L.Trainer(**trainer_args, logger=False, enable_checkpointing=False)


@pytest.mark.parametrize("group", ["data", "model", "trainer", "logger"])
def test_every_group_option_composes(group, tmp_path):
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        extra = ["data.path=/somewhere"] if (group, option) == ("data", "text") else []
        cfg = compose_train([f"{group}={option}", *extra], tmp_path)
        assert cfg[group] is not None, option
    for launcher in ["slurm"]:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
        assert cfg.hydra.launcher.gpus_per_node == 8
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["hparams_search=optuna"], return_hydra_config=True)
    assert cfg.hydra.sweeper.direction == "maximize"


def test_unknown_config_keys_are_rejected(tmp_path):
    with pytest.raises(Exception, match="modle|not in struct|Could not override"):
        compose_train(["model.modle_dim=3"], tmp_path)


def test_base_and_big_carry_the_papers_values(tmp_path):
    base = compose_train(["experiment=base"], tmp_path)
    assert dict(base.model) == dict(d_model=512, d_ff=2048, n_heads=8, n_encoder_layers=6, n_decoder_layers=6,
                                    dropout=0.1, max_positions=1024)
    assert base.label_smoothing == 0.1
    assert dict(base.optim) == dict(lr_factor=1.0, warmup_steps=4000, betas=[0.9, 0.98], eps=1e-9)
    assert base.trainer.max_steps == 100_000 and base.data.tokens_per_update == 25_000
    assert base.data.name == "wmt14" and base.data.vocab_size == 37_000
    assert base.checkpoint.train_time_interval_minutes == 10 and base.checkpoint.keep_last == 5
    assert base.logger._target_.endswith("WandbLogger")
    big = compose_train(["experiment=big"], tmp_path)
    assert (big.model.d_model, big.model.d_ff, big.model.n_heads, big.model.dropout) == (1024, 4096, 16, 0.3)
    assert big.trainer.max_steps == 300_000 and big.data.tokens_per_update == 25_000
    assert big.checkpoint.keep_last == 20 and big.optim.warmup_steps == 4000


# ---------------------------------------------------------------- real runs (subprocesses)


@pytest.fixture
def corpus(tmp_path) -> Path:
    en, de = synthetic_corpus(460)
    root = tmp_path / "corpus"
    write_pair(root, "train", en[:400], de[:400])
    write_pair(root, "valid", en[400:430], de[400:430])
    write_pair(root, "test", en[430:], de[430:])
    return root


def run_train(args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    base = [sys.executable, "-m", "transformer_mt.train", "data=text", "trainer=cpu", "logger=csv",
            "trainer.precision=32-true", "data.vocab_size=400", "data.max_tokens=300", f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.val_check_interval=4", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
            "val_bleu_sentences=8", "optim.warmup_steps=4", *TINY_MODEL]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    flags = [a for a in args if a.startswith("-")]  # Hydra flags (-m) go before the overrides
    overrides = [a for a in args if not a.startswith("-")]
    proc = subprocess.run(base[:3] + flags + base[3:] + overrides, capture_output=True, text=True, env=full_env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_end_to_end_run_checkpoints_and_resumes_where_it_stopped(corpus, tmp_path):
    common = [f"data.path={corpus}", "model.dropout=0.0", "checkpoint.every_n_train_steps=3"]
    proc = run_train([*common, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'full'}"], tmp_path)
    assert "tokens per update: accumulation 1" in proc.stdout + proc.stderr
    ckpts = tmp_path / "full" / "checkpoints"
    assert {p.name for p in ckpts.glob("*.ckpt")} >= {"step0000003.ckpt", "step0000006.ckpt", "last.ckpt"}
    step3 = load(ckpts / "step0000003.ckpt")  # loads with weights_only=True: plain values only
    assert step3["global_step"] == 3 and isinstance(step3["hyper_parameters"]["config"], dict)
    assert step3["sentencepiece"] == (ckpts / "sentencepiece.model").read_bytes()
    assert step3["TranslationDataModule"]["train_sampler"]["position"] == 3  # mid-epoch

    run_train([*common, "trainer.max_steps=8", f"ckpt_path={ckpts / 'step0000003.ckpt'}",
               f"hydra.run.dir={tmp_path / 'resumed'}"], tmp_path)
    full, resumed = load(ckpts / "last.ckpt"), load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert full["global_step"] == resumed["global_step"] == 8
    # Same weights and optimizer moments: the resumed run saw the same batches in the same order.
    for key, value in full["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][key], value, rtol=0, atol=1e-6, msg=key)
    assert full["lr_schedulers"][0]["last_epoch"] == resumed["lr_schedulers"][0]["last_epoch"] == 8


def test_two_process_ddp_on_cpu_trains(corpus, tmp_path):
    proc = run_train([f"data.path={corpus}", "trainer.strategy=ddp", "trainer.devices=2", "trainer.max_steps=3",
                      f"hydra.run.dir={tmp_path / 'ddp'}"], tmp_path)
    assert "x 2 device(s)" in proc.stdout + proc.stderr
    assert load(tmp_path / "ddp" / "checkpoints" / "last.ckpt")["global_step"] == 3


def test_two_job_sweep_runs_each_in_its_own_directory_also_with_ddp(corpus, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(["-m", f"data.path={corpus}", "model.dropout=0.1,0.3", "trainer.max_steps=2",
                      "trainer.strategy=ddp", "trainer.devices=2", f"hydra.sweep.dir={sweep}"], tmp_path)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [j.name for j in jobs] == ["0", "1"]  # no re-launched sweeps, no extra directories
    dropouts = [load(j / "checkpoints" / "last.ckpt")["hyper_parameters"]["model"]["dropout"] for j in jobs]
    assert dropouts == [0.1, 0.3]
    assert "ddp_spawn" in proc.stdout + proc.stderr


def test_optuna_search_maximises_validation_bleu(corpus, tmp_path):
    sweep = tmp_path / "optuna"
    proc = run_train([f"data.path={corpus}", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "trainer.max_steps=4",
                      f"hydra.sweep.dir={sweep}"], tmp_path)
    assert "Best value" in proc.stdout + proc.stderr
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    # (optim.warmup_steps is fixed by run_train's command line, which takes precedence over the search space)
    assert set(results.best_params) == {"model.dropout", "optim.lr_factor", "label_smoothing"}
    assert (sweep / "0" / "checkpoints" / "last.ckpt").exists() and (sweep / "1" / "checkpoints" / "last.ckpt").exists()


def test_wandb_without_credentials_logs_offline(corpus, tmp_path):
    env = {"HOME": str(tmp_path / "home"), "WANDB_API_KEY": "", "WANDB_MODE": "", "NETRC": str(tmp_path / "none")}
    proc = run_train([f"data.path={corpus}", "logger=wandb", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'w'}"],
                     tmp_path, env={k: v for k, v in env.items()})
    assert (proc.stdout + proc.stderr).count("logging offline") == 1
    runs = list((tmp_path / "w" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb")), list((tmp_path / "w").rglob("*"))


@pytest.mark.slow
@pytest.mark.real_data
def test_multi30k_experiment_learns_real_translation(tmp_path):
    """400 updates of `make train CONFIG=multi30k` (~6 min on 2 cores): validation BLEU must climb."""
    from conftest import SHARED_DATA  # noqa: PLC0415

    if not (SHARED_DATA / "multi30k").is_dir():
        pytest.skip(f"Multi30k text not found under {SHARED_DATA}")
    cmd = [sys.executable, "-m", "transformer_mt.train", "experiment=multi30k", f"data.path={SHARED_DATA / 'multi30k'}",
           "logger=csv", f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=400", "trainer.val_check_interval=200",
           "val_bleu_sentences=300", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bleus = [float(line.rsplit("greedy sacreBLEU ", 1)[1].split()[0])
             for line in (proc.stdout + proc.stderr).splitlines() if "greedy sacreBLEU" in line]
    assert len(bleus) == 2 and bleus[1] > bleus[0] and bleus[1] > 8.0, bleus
