"""Hydra configs and the training entry point: in this process where a run's results are what is
checked, as a user runs it (subprocesses, the slow tier) where its console, log file and exit status are."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.types import RunMode
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import OmegaConf

import transformer_mt.train
import transformer_mt.training.update
from conftest import CONF, NOISE, ROOT, SHARED_DATA, hydra_task, run_train, train_in_process
from transformer_mt import runtime
from transformer_mt.checkpoint import read_checkpoint, write_checkpoint
from transformer_mt.configs import compose as compose_config
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.errors import InputError, remove_if_empty
from transformer_mt.files import RunFolderLock
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.runtime import device_peak, end_process_group, use_tf32
from transformer_mt.tools.plot import read_metrics
from transformer_mt.train import check_config, make_callbacks, make_strategy, trainer_arguments
from transformer_mt.training.callbacks import StartupLog
from transformer_mt.training.logs import make_logger
from transformer_mt.training.sharding import LayerFSDP
from transformer_mt.training.update import TrainingDiverged

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def compose_train(overrides: list[str], tmp_path: Path):
    return compose_config("train", overrides)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(experiment, tmp_path):
    cfg = compose_train([f"experiment={experiment}", f"data.cache_dir={tmp_path}"], tmp_path)
    with torch.device("meta"):
        Transformer(TransformerConfig(vocab_size=cfg.data.vocab_size, **cfg.model))
    TranslationDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        cfg.trainer.accelerator = "cpu"  # the same keys, checked on CPU
    L.Trainer(**trainer_arguments(cfg.trainer), logger=False, callbacks=make_callbacks(cfg, tmp_path, StartupLog(0.0)))


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
    assert dict(base.model) == dict(
        d_model=512, d_ff=2048, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, dropout=0.1, max_positions=1024,
        d_k=None, d_v=None, positions="sinusoidal", norm="post", share_embeddings="all",  # the switches: the paper's
    )  # fmt: skip
    assert base.label_smoothing == 0.1
    assert dict(base.optim) == dict(lr_factor=1.0, warmup_steps=4000, betas=[0.9, 0.98], eps=1e-9)
    assert base.trainer.max_steps == 100_000 and base.data.tokens_per_update == 25_000
    # a GPU's batch is the most it fits (the update stays 25k tokens); a CPU's is 4,096 tokens, big's 2,048
    assert (base.data.max_tokens, base.data.max_tokens_fallback) == ("auto", 4096)
    assert base.data.name == "wmt14" and base.data.vocab_size == 37_000
    assert base.checkpoint.train_time_interval_minutes == 10 and base.checkpoint.keep_last == 5
    assert base.logger._target_.endswith("WandbLogger")
    big = compose_train(["experiment=big"], tmp_path)
    assert (big.model.d_model, big.model.d_ff, big.model.n_heads, big.model.dropout) == (1024, 4096, 16, 0.3)
    assert big.trainer.max_steps == 300_000 and big.data.tokens_per_update == 25_000
    assert (big.data.max_tokens, big.data.max_tokens_fallback) == ("auto", 2048)
    assert big.checkpoint.keep_last == 20 and big.optim.warmup_steps == 4000
    # both end with §6.1's protocol: the last 5 / 20 checkpoints averaged, the test split (newstest2014) beam-decoded
    assert (base.final.enabled, base.final.average_last, list(base.final.splits)) == (True, 5, ["test"])
    assert (big.final.enabled, big.final.average_last) == (True, 20) and big.decoding.beam_size == 4


# ---------------------------------------------------------------- real runs (subprocesses)


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_end_to_end_run_logs_checkpoints_and_resumes_where_it_stopped(corpus, tmp_path):
    common = [
        f"data.path={corpus}",
        "model.dropout=0.1",  # as in every shipped model: resume must restore the dropout masks' generator
        "checkpoint.every_n_train_steps=3",
        "progress_every_n_updates=3",
    ]
    proc = run_train([*common, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'full'}"], tmp_path)
    run = tmp_path / "full"
    ckpts = run / "checkpoints"
    assert {p.name for p in ckpts.glob("*.ckpt")} == {"step0000003.ckpt", "step0000006.ckpt", "last.ckpt", "best.ckpt"}
    step3 = load(ckpts / "step0000003.ckpt")  # loads with weights_only=True: plain values only
    assert step3["global_step"] == 3 and isinstance(step3["hyper_parameters"]["config"], dict)
    assert step3["sentencepiece"] == (run / "sentencepiece.model").read_bytes()
    assert step3["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "position": 3}]  # mid-epoch
    # best.ckpt: the validation (of updates 4 and 8) with the higher val/bleu
    best = load(ckpts / "best.ckpt")
    logged = dict(read_metrics(run)["val/bleu"])  # update -> val/bleu, from metrics.csv
    assert set(logged) == {4, 8}
    (state,) = [c for c in best["callbacks"].values() if c.get("monitor") == "val/bleu"]
    best_score = float(state["best_model_score"])
    assert best_score == pytest.approx(max(logged.values())) and logged[best["global_step"]] == pytest.approx(
        best_score
    )

    # The run log: every line once, Lightning's included; each data split once; a progress line; what to do next.
    lines = (run / "train.log").read_text().splitlines()
    console = proc.stdout.splitlines()
    assert [line for line in lines if "][" in line] == [
        line for line in console if "][" in line
    ]  # the console shows the same lines
    for split in ("train", "validation", "test"):
        assert sum(f"text {split}: " in line for line in lines) == 1, split
    assert len(lines) == len(set(lines))
    (startup,) = [line for line in lines if "first update done" in line]  # how long the start took, once
    assert re.search(r"first update done [\d.]+ s after the start \(data ready at [\d.]+ s, training loop", startup)
    progress = (
        r"update 3/8 \(38%\) \| loss [\d.]+ \| lr \S+ \| [\d,]+ target tok/s \| [\d,.]+ [GT]FLOP/s, MFU [\d.]+% \|"
    )
    assert any(re.search(progress + r" elapsed \S+ \| ETA", line) for line in lines)
    (peak,) = [line for line in lines if "MFU: model FLOP/s" in line]  # what MFU is measured against, once
    assert re.search(r"over [\d.,]+ [GT]FLOP/s (?:bf16|fp32), a 2048\^3 matrix product timed on this CPU$", peak)
    assert any(
        "validation at update 8: loss" in line and "greedy sacreBLEU" in line and "chrF" in line for line in lines
    )
    assert any("`Trainer.fit` stopped" in line for line in lines)  # Lightning's lines reach the file
    # paths relative to the working directory (run_train's is tmp_path), as a user types them
    assert "make average RUN=full N=2\n  make evaluate CKPT=full/checkpoints/average-last2.ckpt" in proc.stdout
    for noise in NOISE:
        assert noise not in proc.stdout + proc.stderr, noise

    run_train(
        [
            *common,
            "trainer.max_steps=8",
            f"ckpt_path={ckpts / 'step0000003.ckpt'}",
            f"hydra.run.dir={tmp_path / 'resumed'}",
        ],
        tmp_path,
    )
    full, resumed = load(ckpts / "last.ckpt"), load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert full["global_step"] == resumed["global_step"] == 8
    # Bit-identical weights and Adam moments: the resumed run saw the same batches in the same order
    # and drew the same dropout masks.
    for key, value in full["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
    for param, state in full["optimizer_states"][0]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed["optimizer_states"][0]["state"][param][name], state[name]), (param, name)
    assert full["lr_schedulers"][0]["last_epoch"] == resumed["lr_schedulers"][0]["last_epoch"] == 8


def test_early_stopping_on_the_best_checkpoints_metric(corpus, tmp_path):
    # "The highest validation loss" stops improving after the first validation: patience 1 ends the run
    # at the second validation (update 8 of 40), and best.ckpt stays the one of update 4.
    overrides = [f"data.path={corpus}", "trainer.max_steps=40", "checkpoint.best_monitor=val/loss"]
    train_in_process([*overrides, "checkpoint.best_mode=max", "early_stopping_patience=1"], tmp_path, tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    assert load(ckpts / "last.ckpt")["global_step"] == 8
    assert load(ckpts / "best.ckpt")["global_step"] == 4


def test_accumulated_runs_validate_and_checkpoint_every_n_updates(corpus, tmp_path):
    # tokens_per_update 600 with max_tokens 300: 2 micro-batches per update. Validation every 4 updates
    # (not every 4 micro-batches) and checkpoints every 3 updates.
    args = [f"data.path={corpus}", "data.tokens_per_update=600", "trainer.max_steps=8"]
    train_in_process([*args, "checkpoint.every_n_train_steps=3"], tmp_path, tmp_path / "run")
    assert [update for update, _ in read_metrics(tmp_path / "run")["val/loss"]] == [4, 8]
    last = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 8
    assert last["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 16  # micro-batches
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step*.ckpt"))
    assert saved == ["step0000003.ckpt", "step0000006.ckpt"]


class SlowBatch(L.Callback):
    """Micro-batch `batch` takes `seconds` on the update's clock (training/update.py's, driven here)."""

    def __init__(self, batch: int, seconds: float):
        self.batch, self.seconds, self.now = batch, seconds, 0.0

    def clock(self) -> float:
        return self.now

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == self.batch:
            self.now += self.seconds


def test_a_time_based_checkpoint_that_comes_due_inside_an_update_waits_for_its_end(corpus, tmp_path, monkeypatch):
    # 2 micro-batches per update, a save every 2 s of training; micro-batch 2 (the first of update 2)
    # takes 2.5 s: the save comes due there, in the middle of update 2, whose accumulated gradient a
    # checkpoint would not hold. It must wait for update 2's end (micro-batch 3), and not come again at update 3.
    slow = SlowBatch(2, 2.5)
    monkeypatch.setattr(transformer_mt.training.update, "clock", slow.clock)
    make_callbacks = transformer_mt.train.make_callbacks
    monkeypatch.setattr(transformer_mt.train, "make_callbacks", lambda *args: [slow, *make_callbacks(*args)])
    args = [f"data.path={corpus}", "data.tokens_per_update=600", "trainer.max_steps=3"]
    train_in_process([*args, f"checkpoint.train_time_interval_minutes={2 / 60}"], tmp_path, tmp_path / "run")
    (saved,) = (tmp_path / "run" / "checkpoints").glob("time-step*.ckpt")
    checkpoint = load(saved)
    micro_batches = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"]
    assert (checkpoint["global_step"], micro_batches) == (2, 4), saved.name  # whole updates only


def test_settings_that_would_fail_late_are_refused_first(tmp_path):
    cfg = compose_train(["val_bleu_sentences=0"], tmp_path)
    with pytest.raises(InputError, match=r"best_monitor=val/bleu needs val_bleu_sentences > 0; or set checkpoint"):
        check_config(cfg)
    with pytest.raises(InputError, match="early_stopping_patience needs checkpoint.best_monitor"):
        check_config(compose_train(["early_stopping_patience=3", "checkpoint.best_monitor=null"], tmp_path))
    # Wrong types and values, by key, before the data is built (not "TypeError: not all arguments converted")
    for override, message in [
        ("model.d_model=abc", "model.d_model='abc': must be a whole number"),
        ("model.dropout=1.5", "model.dropout=1.5: must be in [0, 1)"),
        ("model.n_heads=3", "model.d_model=512 is not divisible by n_heads=3"),
        ("+model.d_modle=3", "model.d_modle: not a model setting; the model takes d_ff, d_k, d_model"),
        ("model.norm=sandwich", "model.norm='sandwich': must be one of post, pre"),
        ("model.d_k=0", "model.d_k=0: must be positive"),
        ("ema_decay=1.5", "ema_decay=1.5: must be a number in (0, 1)"),
        ("final.enabled=true final.splits=[dev]", "final.splits=['dev']: must be a list of validation and/or test"),
        ("optim.lr_factor=fast", "optim.lr_factor='fast': must be a number, 0 or more"),
        ("optim.warmup_steps=-5", "optim.warmup_steps=-5: must be a whole number, 0 or more"),
    ]:
        with pytest.raises(InputError) as error:
            check_config(compose_train(override.split(), tmp_path))
        assert str(error.value).startswith(message), (override, str(error.value))
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match=r"accelerator=gpu needs a CUDA GPU .* add trainer=cpu"):
            trainer_arguments(compose_train(["trainer=gpu"], tmp_path).trainer)


def test_fsdp_in_bf16_reduces_gradients_and_keeps_buffers_in_fp32():
    strategy = make_strategy("fsdp", "bf16-mixed")
    mixed = strategy.mixed_precision_config
    assert (mixed.param_dtype, mixed.reduce_dtype, mixed.buffer_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert make_strategy("fsdp", "32-true").mixed_precision is None  # fp32: no mixed precision at all


def test_ddp_broadcasts_no_buffers_and_sweeps_refuse_fsdp_that_would_relaunch_them(monkeypatch):
    for name, start in (("ddp", "popen"), ("ddp_spawn", "spawn")):
        strategy = make_strategy(name)
        assert isinstance(strategy, DDPStrategy) and strategy._start_method == start, name
        assert strategy._ddp_kwargs == {"broadcast_buffers": False}  # no broadcast of the sinusoids per forward

    class Sweep:  # HydraConfig of a `-m` run started from a shell
        @staticmethod
        def initialized():
            return True

        @staticmethod
        def get():
            return OmegaConf.create({"mode": RunMode.MULTIRUN})

    monkeypatch.setattr(transformer_mt.train, "HydraConfig", Sweep)
    for key in ("LOCAL_RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    assert make_strategy("ddp")._start_method == "spawn"
    with pytest.raises(InputError, match=r"trainer=fsdp in a Hydra multirun .* hydra/launcher=slurm"):
        make_strategy("fsdp", devices=-1)
    assert isinstance(make_strategy("fsdp", devices=1), LayerFSDP)  # one device: no other rank to start
    monkeypatch.setenv("SLURM_NTASKS", "8")  # each rank started by srun (hydra/launcher=slurm): nothing re-runs
    assert isinstance(make_strategy("fsdp", devices=-1), LayerFSDP)
    assert make_strategy("ddp")._start_method == "popen"


def test_use_tf32_turns_on_tf32_for_fp32_products():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("highest")
        use_tf32()
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_wandb_without_a_key_warns_once_per_run_not_once_per_rank(tmp_path, monkeypatch, caplog):
    from lightning.pytorch.utilities import rank_zero_only  # noqa: PLC0415

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg = compose_train(["logger=wandb"], tmp_path).logger
    hydra_task("train", [], tmp_path / "run")  # make_logger reads the run's HydraConfig
    seen = []
    for rank in (0, 1):
        monkeypatch.delenv("WANDB_MODE", raising=False)
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        caplog.clear()
        with caplog.at_level("INFO"):
            make_logger(OmegaConf.merge(cfg, {"save_dir": str(tmp_path / f"w{rank}")}))
        seen.append("no API key found" in caplog.text)
    assert seen == [True, False]


def test_cpu_precision_auto_is_bf16_only_where_the_cpu_computes_it(tmp_path, monkeypatch):
    cfg = compose_train(["trainer=cpu"], tmp_path).trainer
    for native, expected in [(True, "bf16-mixed"), (False, "32-true")]:
        monkeypatch.setattr("transformer_mt.train.cpu_has_native_bf16", lambda native=native: native)
        assert trainer_arguments(cfg)["precision"] == expected
    cfg.precision = "bf16-mixed"  # an explicit choice is kept
    assert trainer_arguments(cfg)["precision"] == "bf16-mixed"


@pytest.mark.slow
def test_a_failed_start_ends_in_one_line_and_leaves_no_run_folder(tmp_path):
    proc = run_train(["experiment=base", "data=wmt14", "data.path=/nonexistent/wmt14"], tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "error: data 'wmt14': data.path=/nonexistent/wmt14 does not exist"
    ]
    assert not (tmp_path / "outputs").exists()  # Hydra's outputs/<date>/<time>/ is removed again


def test_divergence_stops_at_the_first_non_finite_update_without_a_nan_checkpoint(corpus, tmp_path):
    run = tmp_path / "run"
    overrides = [f"data.path={corpus}", "optim.lr_factor=1e30", "trainer.max_steps=8"]
    with pytest.raises(TrainingDiverged) as error:
        train_in_process([*overrides, "checkpoint.every_n_train_steps=1"], tmp_path, run)
    message = str(error.value)  # what the entry point prints as its one `error: ...` line
    assert message.startswith("training diverged at update ") and "optim.lr_factor" in message
    diverged_at = int(message.split("update ")[1].split(":")[0])
    written = sorted((run / "checkpoints").glob("*.ckpt")) if (run / "checkpoints").exists() else []
    assert written  # update 1 is still finite: its checkpoint (and last.ckpt, a copy of it) exist
    for path in written:  # every checkpoint is from before the divergence, and finite
        checkpoint = load(path)
        assert checkpoint["global_step"] < diverged_at
        assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values() if v.is_floating_point())


@pytest.mark.slow
def test_hub_failure_says_how_to_work_offline(tmp_path):
    proc = run_train(
        ["experiment=multi30k", "data=multi30k", "trainer.max_steps=1"],
        tmp_path,
        check=False,
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines[-1].startswith("error: data 'multi30k': could not load bentrevett/multi30k")
    assert "data.path=" in lines[-1] and "make_wmt14_layout.py" in lines[-1]


@pytest.mark.slow
def test_sweep_jobs_each_get_their_own_wandb_run_in_one_group(corpus, tmp_path):
    sweep = tmp_path / "sweep"
    env = {"HOME": str(tmp_path / "home"), "WANDB_API_KEY": "", "WANDB_MODE": "", "NETRC": str(tmp_path / "none")}
    proc = run_train(
        [
            "-m",
            f"data.path={corpus}",
            "logger=wandb",
            "model.dropout=0.1,0.3",
            "trainer.max_steps=2",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
        env=env,
    )
    assert (proc.stdout + proc.stderr).count("logging offline") == 2  # once per job
    runs = [list((sweep / job / "wandb").glob("offline-run-*")) for job in ("0", "1")]
    assert [len(r) for r in runs] == [1, 1] and runs[0][0].name != runs[1][0].name
    for job, (run,) in zip(("0", "1"), runs):
        record = next(run.glob("run-*.wandb")).read_bytes()  # wandb's own record of the run
        assert f"sweep-{job}".encode() in record and str(sweep).encode() in record  # its name and group


@pytest.mark.slow
def test_two_process_ddp_on_cpu_logs_each_line_once(corpus, tmp_path):
    proc = run_train(
        [
            f"data.path={corpus}",
            "trainer.strategy=ddp",
            "trainer.devices=2",
            "trainer.max_steps=4",  # one validation (every 4): BLEU gathered from both ranks, best.ckpt on both
            f"hydra.run.dir={tmp_path / 'ddp'}",
        ],
        tmp_path,
    )
    assert "x 2 device(s)" in proc.stdout
    assert load(tmp_path / "ddp" / "checkpoints" / "last.ckpt")["global_step"] == 4
    assert load(tmp_path / "ddp" / "checkpoints" / "best.ckpt")["global_step"] == 4
    assert proc.stdout.count("validation at update 4:") == 1 and "(8 sentences)" in proc.stdout
    for split in ("train", "validation", "test"):  # rank 1 builds the data too, silently
        assert proc.stdout.count(f"text {split}: ") == 1, proc.stdout


@pytest.mark.slow
def test_two_job_sweep_runs_each_in_its_own_directory_also_with_ddp(corpus, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        [
            "-m",
            f"data.path={corpus}",
            "model.dropout=0.1,0.3",
            "trainer.max_steps=2",
            "trainer.strategy=ddp",
            "trainer.devices=2",
            f"hydra.sweep.dir={sweep}",
            *["final.enabled=true", "final.average_last=0", "decoding.max_len_b=10"],  # the end of run, by ddp_spawn
        ],
        tmp_path,
    )
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [j.name for j in jobs] == ["0", "1"]  # no re-launched sweeps, no extra directories
    lasts = [load(j / "checkpoints" / "last.ckpt") for j in jobs]
    assert [c["hyper_parameters"]["model"]["dropout"] for c in lasts] == [0.1, 0.3]
    assert [c["global_step"] for c in lasts] == [2, 2]  # written by the spawned workers, not the idle main process
    # the main process evaluated each job's last.ckpt once, with the two ranks' training totals
    results = [json.loads((j / "results.json").read_text()) for j in jobs]
    assert [r["updates"] for r in results] == [2, 2] and all(
        r["models"]["last"]["test"]["sentences"] == 30 for r in results
    )
    assert all(r["target_tokens"] > 0 for r in results)
    assert "ddp_spawn" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_optuna_search_maximises_validation_bleu(corpus, tmp_path):
    sweep = tmp_path / "optuna"
    proc = run_train(
        [
            f"data.path={corpus}",
            "hparams_search=optuna",
            "hydra.sweeper.n_trials=2",
            "trainer.max_steps=4",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    assert "Best value" in proc.stdout + proc.stderr
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    # (optim.warmup_steps is fixed by TINY_RUN's command line, which takes precedence over the search space)
    assert set(results.best_params) == {"model.dropout", "optim.lr_factor", "label_smoothing"}
    assert (sweep / "0" / "checkpoints" / "last.ckpt").exists() and (sweep / "1" / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
@pytest.mark.real_data
@pytest.mark.timeout(1800)
def test_multi30k_experiment_learns_real_translation(tmp_path):
    """400 updates of `make train CONFIG=multi30k` (~6 min on 2 cores): validation BLEU must climb."""
    cmd = [
        sys.executable,
        "-m",
        "transformer_mt.train",
        "experiment=multi30k",
        f"data.path={SHARED_DATA / 'multi30k'}",
        "logger=csv",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_steps=400",
        "trainer.val_check_interval=200",
        "val_bleu_sentences=300",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bleus = [value for _, value in read_metrics(tmp_path / "run")["val/bleu"]]
    assert len(bleus) == 2 and bleus[1] > bleus[0] and bleus[1] > 8.0, bleus
    # the recipe's end: the last 5 periodic checkpoints (every 50 updates: 200-400) averaged, test2016 decoded
    # with beam 4
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert list(results["models"]) == ["average-last5"] and results["updates"] == 400
    assert results["models"]["average-last5"]["test"]["bleu"] > 8.0 and results["decoding"]["beam_size"] == 4
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step*.ckpt"))
    assert saved == [f"step{step:07d}.ckpt" for step in (200, 250, 300, 350, 400)]


@pytest.mark.slow
@pytest.mark.timeout(900)  # pip builds the package
def test_installed_without_editable_mode_the_entry_points_find_their_configs(tmp_path):
    """`pip install .` (not -e) copies conf/ into the package; train, evaluate and translate compose from it,
    run as modules and as the console commands pip installs (the same entry points)."""
    source = tmp_path / "source"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(
        ROOT / "src", source / "src", symlinks=True, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    shutil.copytree(ROOT / "conf", source / "conf")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(source)]
    subprocess.run(pip, check=True, capture_output=True, text=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import transformer_mt; print(transformer_mt.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=tmp_path,
    ).stdout
    assert where.startswith(str(site)) and not (site / "transformer_mt" / "conf").is_symlink()
    for module, args, expected in [
        ("train", ["experiment=base"], "d_model: 512"),
        ("evaluate", ["ckpt=x.ckpt"], "beam_size: 4"),
        ("translate", ["ckpt=x.ckpt"], "batch_lines: 10000"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", f"transformer_mt.{module}", "--cfg", "job", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        assert proc.returncode == 0 and expected in proc.stdout, proc.stderr[-2000:]
        command = [str(site / "bin" / f"transformer-mt-{module}"), "--cfg", "job", *args]
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
        assert proc.returncode == 0 and expected in proc.stdout, proc.stderr[-2000:]
    for command, expected in [("average", "usage: transformer-mt-average"), ("export", "usage: transformer-mt-export")]:
        proc = subprocess.run(
            [str(site / "bin" / f"transformer-mt-{command}"), "--help"], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 0 and proc.stdout.startswith(expected), proc.stderr[-2000:]


def test_a_failed_run_removes_only_its_own_hydra_only_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "2026-11-30" / "10-00-00"
    (run / ".hydra").mkdir(parents=True)
    (run / "train.log").write_text("started\n")
    keep = tmp_path / "outputs" / "2026-11-29" / "09-00-00" / "checkpoints"
    keep.mkdir(parents=True)
    remove_if_empty(run)
    assert not run.exists() and not run.parent.exists() and keep.exists()  # outputs/ still holds another run
    (tmp_path / ".hydra").mkdir()
    remove_if_empty(tmp_path)  # translate's run folder is "."
    assert (tmp_path / ".hydra").exists()
    done = tmp_path / "done"
    (done / "checkpoints").mkdir(parents=True)
    remove_if_empty(done)
    assert done.exists()


def test_resume_refuses_non_finite_weights_and_last_falls_back_to_the_newest_finite_checkpoint(
    trained_run, tmp_path, caplog
):
    run = tmp_path / "run"
    shutil.copytree(trained_run / "out", run)
    last = read_checkpoint(run / "checkpoints" / "last.ckpt")
    last["state_dict"]["model.embed.tokens.weight"][7, 0] = float("nan")
    write_checkpoint(last, run / "checkpoints" / "last.ckpt")
    args = [f"data.path={trained_run / 'corpus'}", "data.max_tokens=400", "trainer.val_check_interval=6"]
    args += ["checkpoint.every_n_train_steps=3", "trainer.max_steps=13"]
    with pytest.raises(InputError, match=r"last.ckpt: the weights are not finite: model.embed.tokens.weight holds 1"):
        train_in_process([*args, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"], trained_run, tmp_path / "other")
    with caplog.at_level("INFO"):
        train_in_process([*args, "ckpt_path=last"], trained_run, run)
    assert re.search(r"not resuming from \S+last.ckpt: \S+ the weights are not finite", caplog.text)
    assert re.search(r"resuming from \S+step0000012.ckpt \(update 12\)", caplog.text)


def test_a_finite_divergence_is_warned_about_once_and_training_goes_on(corpus, tmp_path, caplog):
    # fp32 on every CPU (precision auto picks bf16 where it is native): a rate 30x the paper's diverges to a finite
    # loss there, 300x already to NaN (which stops the run: the divergence test above)
    args = [f"data.path={corpus}", "optim.lr_factor=30", "progress_every_n_updates=2", "trainer.max_steps=20"]
    args.append("trainer.precision=32-true")
    with caplog.at_level("INFO"):
        train_in_process(args, tmp_path, tmp_path / "run")
    warnings = re.findall(r"the training loss \(([\d.]+) at update (\d+)\) is ([\d.]+)x its best", caplog.text)
    assert len(warnings) == 1, caplog.text[-3000:]
    assert float(warnings[0][2]) > 3 and "finished after 20 updates" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):  # the shipped rate: no warning
        train_in_process([args[0], *args[2:]], tmp_path, tmp_path / "calm")
    assert "finished after 20 updates" in caplog.text and "may be diverging" not in caplog.text


def test_a_second_training_into_a_folder_in_use_is_refused_and_a_dead_holders_lock_is_taken_over(corpus, tmp_path):
    run = tmp_path / "run"
    args = [f"data.path={corpus}", "trainer.max_steps=2"]
    hold = f"from transformer_mt.files import RunFolderLock; RunFolderLock(Path({str(run)!r})).__enter__()"
    script = f"from pathlib import Path; {hold}; print('held', flush=True); __import__('time').sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)  # another training
    try:
        assert holder.stdout.readline() == "held\n"
        refused = rf"{re.escape(str(run))} is in use by another training \(pid {holder.pid} on "
        with pytest.raises(InputError, match=refused):
            train_in_process(args, tmp_path, run)
        assert not (run / "checkpoints").exists()  # nothing of the refused start
        remove_if_empty(run)  # what a failed start does to its folder: not to a folder another training holds
        assert (run / ".lock").is_file()
    finally:
        holder.kill()
        holder.wait()
    train_in_process(args, tmp_path, run)  # the holder died by SIGKILL: its lock went with it
    assert (run / "checkpoints" / "last.ckpt").is_file()
    # The holder's .hydra files: a refused start's Hydra rewrites them before it is refused; the holder
    # writes its own back when it ends.
    (run / ".hydra").mkdir(exist_ok=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    with RunFolderLock(run):
        (run / ".hydra" / "config.yaml").write_text("seed: 1\n")  # as Hydra of the refused start does
    assert (run / ".hydra" / "config.yaml").read_text() == "seed: 0\n"


def test_a_checkpoint_written_after_its_validation_holds_that_validations_best_score(trained_run):
    """Update 6 is checkpointed and validated: its checkpoint waits for the validation and for best.ckpt's
    choice, so that a run resumed from it compares later validations with the right best score."""
    checkpoint = torch.load(trained_run / "out" / "checkpoints" / "step0000006.ckpt", weights_only=True)
    (best,) = [state for key, state in checkpoint["callbacks"].items() if "'monitor': 'val/bleu'" in key]
    bleu = dict(read_metrics(trained_run / "out")["val/bleu"])
    assert 6 in bleu  # the validation of update 6
    assert best["best_model_score"].item() == pytest.approx(max(v for step, v in bleu.items() if step <= 6))


def test_the_process_group_ends_with_the_last_object_that_holds_it_and_its_gloo_threads_are_joined(tmp_path):
    """A gloo thread still running when the interpreter finalizes can abort the process (status -6):
    end_process_group reports the threads of a group something still holds, and none once it is dropped."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.distributed.all_reduce(torch.ones(3))
    holder = [torch.distributed.group.WORLD]  # as a DDP/FSDP wrapper holds its group
    assert "pt_gloo_runloop" in end_process_group()
    assert not torch.distributed.is_initialized()
    holder.clear()
    assert end_process_group() == []


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H200", "bf16-mixed", 989e12),
        ("NVIDIA H100 80GB HBM3", "32-true", 67e12),  # fp32: torch's default matmul precision is "highest"
        ("NVIDIA H100 PCIe", "bf16-mixed", 756e12),
        ("NVIDIA A100-SXM4-80GB", "16-mixed", 312e12),
        ("NVIDIA A10", "bf16-mixed", 125e12),  # not A100's
        ("NVIDIA H100 NVL", "bf16-mixed", None),  # lower clocks: left unknown rather than guessed
        ("Tesla V100-SXM2-32GB", "bf16-mixed", None),  # no bf16
    ],
)
def test_mfu_is_measured_against_the_data_sheets_peak_of_the_gpu_and_its_format(monkeypatch, name, precision, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    found = device_peak(torch.device("cuda", 0), precision)
    assert found.flops == peak
    assert (name in found.source) and (("no MFU" in found.source) == (peak is None))
    if peak:
        assert found.utilisation(peak / 4) == 0.25


def test_a_cpus_peak_is_a_matrix_product_timed_in_trainings_format():
    found = device_peak(torch.device("cpu"), "32-true")
    assert found.flops > 1e9 and re.fullmatch(
        r"[\d.]+ GFLOP/s fp32, a 2048\^3 matrix product timed on this CPU", found.source
    )


def clock(durations: list[float]):
    """time.perf_counter as matmul_peak reads it: once when timing starts, then before and after each product,
    the products taking `durations`; it runs out after the last (a product more would fail the test)."""
    readings, now = [0.0], 0.0
    for took in durations:
        readings += [now, now + took]
        now += took
    return iter(readings).__next__


@pytest.mark.parametrize(
    "durations",
    [
        [0.5, 0.2, 0.3, 0.4, 0.6],  # slow products: 5 of them, although past the second
        [0.1] * 8 + [0.04] + [0.1] * 2,  # a busy machine, quiet for one product: timing goes on until a second passed
    ],
)
def test_a_cpus_peak_is_the_fastest_product_of_a_second_of_them(durations, monkeypatch):
    monkeypatch.setattr(runtime, "time", SimpleNamespace(perf_counter=clock(durations)))  # runtime's clock only
    assert runtime.matmul_peak(torch.float32, n=16) == pytest.approx(2 * 16**3 / min(durations))
