"""training/logs.py and callbacks.py's lines: where a run's lines and metrics go (the log file once per run,
Weights & Biases per run and per sweep), and the progress lines' durations."""

import os
import re
import subprocess
import sys

import lightning as L
import pytest
from omegaconf import OmegaConf

import transformer_mt.runtime
import transformer_mt.training.fit
import transformer_mt.training.update
from conftest import hydra_task, load, run_train, train_in_process, train_overrides
from transformer_mt.commandline import hydra_job
from transformer_mt.configs import compose as compose_config
from transformer_mt.runtime import duration
from transformer_mt.training.logs import make_logger


def test_wandb_without_a_key_warns_once_per_run_not_once_per_rank(tmp_path, monkeypatch, caplog):
    from lightning.pytorch.utilities import rank_zero_only  # noqa: PLC0415

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg = compose_config("train", ["logger=wandb"]).logger
    hydra_task("train", [], tmp_path / "run")  # the run's HydraConfig, handed down as a Job
    job = hydra_job()
    seen = []
    for rank in (0, 1):
        monkeypatch.delenv("WANDB_MODE", raising=False)
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        caplog.clear()
        with caplog.at_level("INFO"):
            make_logger(OmegaConf.merge(cfg, {"save_dir": str(tmp_path / f"w{rank}")}), job)
        seen.append("no API key found" in caplog.text)
    assert seen == [True, False]


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


def test_progress_durations_never_go_negative():
    assert duration(3725.9) == "1:02:05"
    assert duration(-6.0) == "0:00:00"  # the run went past its time limit: ETA 0, not "-1 day, 23:59:54"


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a hang guard only: nothing here is timed
def test_a_run_ends_with_its_results_and_the_next_commands_after_wandb_and_the_averaging(corpus, tmp_path):
    """With wandb (the recipes' logger) and the end-of-run protocol: the last lines are the results block and
    the next commands, none of wandb's; no `make average` is proposed, before or after the run averages."""
    _, overrides = train_overrides(
        [f"data.path={corpus}", "logger=wandb", "trainer.max_steps=4", "checkpoint.every_n_train_steps=2"]
        + ["final.enabled=true", "final.average_last=2", "decoding.max_len_b=10", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
    )
    env = {"HOME": str(tmp_path / "home"), "WANDB_API_KEY": "", "WANDB_MODE": "", "NETRC": str(tmp_path / "none")}
    proc = subprocess.run(  # stdout and stderr in one stream, in the order a person sees them
        [sys.executable, "-m", "transformer_mt.train", *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    results = max(i for i, line in enumerate(lines) if "results (" in line)
    averaged = next(i for i, line in enumerate(lines) if "averaged step0000002.ckpt, step0000004.ckpt" in line)
    assert "make average" not in proc.stdout and averaged < results
    tail = lines[results:]
    assert "finished after 4 updates; next:" in tail[-4] and "checkpoints in run/checkpoints" in tail[-3], tail
    assert tail[-1].strip().startswith('echo "A sentence to translate." | make translate CKPT='), tail
    assert "average-last2.ckpt" in tail[-1] and not [line for line in tail if line.startswith("wandb")], tail


class SlowMachine(L.Callback):
    """The update's clock (training/update.py's, driven here): each micro-batch takes 61 s."""

    def __init__(self):
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def on_train_batch_start(self, *args) -> None:
        self.now += 61.0


def test_a_slow_machine_shows_a_progress_line_with_an_eta_after_its_first_update(corpus, tmp_path, monkeypatch, caplog):
    slow = SlowMachine()
    monkeypatch.setattr(transformer_mt.training.update, "clock", slow.clock)
    make_callbacks = transformer_mt.training.fit.make_callbacks
    monkeypatch.setattr(transformer_mt.training.fit, "make_callbacks", lambda *args: [slow, *make_callbacks(*args)])
    args = [f"data.path={corpus}", "trainer.max_steps=3", "trainer.val_check_interval=100"]
    with caplog.at_level("INFO"):  # progress_every_n_updates: 100, progress_every_seconds: 60 (conf/train.yaml)
        train_in_process([*args, "progress_every_n_updates=100", "progress_every_seconds=60"], tmp_path, tmp_path / "r")
    lines = re.findall(r"update (\d)/3 \(.*\| ETA (\S+)$", caplog.text, flags=re.M)
    assert lines == [("1", "0:02:02"), ("2", "0:01:01"), ("3", "0:00:00")]  # a line every 61 s, at 61 s per update
