"""training/saving.py and the run folder: which checkpoints a run writes and when (right after an
update, after a due validation), resuming refuses non-finite weights, one training per run folder."""

import errno
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch

import transformer_mt.training.fit
import transformer_mt.training.update
from conftest import load, run_train, train_in_process
from transformer_mt.checkpoint import read_checkpoint, run_checkpoints, write_checkpoint
from transformer_mt.errors import InputError, UserError
from transformer_mt.files import RunFolder
from transformer_mt.tools.plot import read_metrics
from transformer_mt.training.saving import UpdateCheckpoint


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
    make_callbacks = transformer_mt.training.fit.make_callbacks
    monkeypatch.setattr(transformer_mt.training.fit, "make_callbacks", lambda *args: [slow, *make_callbacks(*args)])
    args = [f"data.path={corpus}", "data.tokens_per_update=600", "trainer.max_steps=3"]
    train_in_process([*args, f"checkpoint.train_time_interval_minutes={2 / 60}"], tmp_path, tmp_path / "run")
    (saved,) = (tmp_path / "run" / "checkpoints").glob("time-step*.ckpt")
    checkpoint = load(saved)
    micro_batches = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"]
    assert (checkpoint["global_step"], micro_batches) == (2, 4), saved.name  # whole updates only


def test_a_checkpoint_written_after_its_validation_holds_that_validations_best_score(trained_run):
    """Update 6 is checkpointed and validated: its checkpoint waits for the validation and for best.ckpt's
    choice, so that a run resumed from it compares later validations with the right best score."""
    checkpoint = torch.load(trained_run / "out" / "checkpoints" / "step0000006.ckpt", weights_only=True)
    (best,) = [state for key, state in checkpoint["callbacks"].items() if "'monitor': 'val/bleu'" in key]
    bleu = dict(read_metrics(trained_run / "out")["val/bleu"])
    assert 6 in bleu  # the validation of update 6
    assert best["best_model_score"].item() == pytest.approx(max(v for step, v in bleu.items() if step <= 6))


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


TRAINED = ["data.max_tokens=400", "trainer.val_check_interval=6", "checkpoint.every_n_train_steps=3"]  # trained_run's


def test_a_run_resumed_in_a_moved_folder_keeps_best_ckpt_and_its_periodic_checkpoints(trained_run, tmp_path, caplog):
    """Lightning's ModelCheckpoint forgets its best score and kept files when the saved folder is not the current
    one: the first validation after resuming a moved (or copied) run would replace best.ckpt whatever its score,
    and keep_last would lose count of the periodic checkpoints already there."""
    run = tmp_path / "moved"
    shutil.copytree(trained_run / "out", run)
    best_step = load(run / "checkpoints" / "best.ckpt")["global_step"]
    # A best score no validation can reach (BLEU 99), as the run left it: whatever update 15 and 18 score, they
    # are worse, so best.ckpt must stay (Lightning, having forgotten the score, saves the first validation).
    last = read_checkpoint(run / "checkpoints" / "last.ckpt")
    (key,) = [key for key in last["callbacks"] if "'monitor': 'val/bleu'" in key]  # best.ckpt's callback
    state = last["callbacks"][key]
    state["best_k_models"] = {path: torch.tensor(99.0) for path in state["best_k_models"]}  # best.ckpt's score
    state["best_model_score"] = torch.tensor(99.0)
    write_checkpoint(last, run / "checkpoints" / "last.ckpt")
    args = [f"data.path={trained_run / 'corpus'}", *TRAINED, "trainer.max_steps=18", "ckpt_path=last"]
    with caplog.at_level("INFO"):
        train_in_process(args, trained_run, run)
    assert sorted(dict(read_metrics(run)["val/bleu"])) == [6, 12, 18]  # update 18 validated (12 was before)
    assert load(run / "checkpoints" / "best.ckpt")["global_step"] == best_step
    assert f"resumed in a moved folder: best.ckpt's val/bleu 99.00 kept (the run was in {trained_run / 'out'})" in (
        caplog.text
    )
    periodic = sorted(p.name for p in (run / "checkpoints").glob("step*.ckpt"))
    assert periodic == [f"step{step:07d}.ckpt" for step in (6, 9, 12, 15, 18)]  # keep_last 5, counted across the move
    assert sorted(p.name for p in (trained_run / "out" / "checkpoints").glob("step*.ckpt"))[0] == "step0000003.ckpt"


def test_a_resume_sets_a_refused_checkpoint_aside_so_no_average_takes_it(trained_run, tmp_path, caplog):
    """ckpt_path=last skips a damaged or non-finite checkpoint and renames it <name>.refused (nothing deleted):
    the run summary's `make average`, make average itself and the end-of-run protocol no longer find it."""
    run = tmp_path / "run"
    shutil.copytree(trained_run / "out", run)
    checkpoints = run / "checkpoints"
    last = read_checkpoint(checkpoints / "last.ckpt")
    last["state_dict"]["model.embed.tokens.weight"][7, 0] = float("inf")
    write_checkpoint(last, checkpoints / "last.ckpt")
    damaged = checkpoints / "step0000012.ckpt"
    cut_short = damaged.read_bytes()[:5000]
    damaged.write_bytes(cut_short)
    args = [f"data.path={trained_run / 'corpus'}", *TRAINED, "trainer.max_steps=11", "ckpt_path=last"]
    with caplog.at_level("INFO"):
        train_in_process(args, trained_run, run)
    assert re.search(r"resuming from \S+step0000009.ckpt \(update 9\)", caplog.text)
    assert re.search(r"not resuming from \S+step0000012.ckpt: .* renamed to step0000012.ckpt.refused", caplog.text)
    assert (checkpoints / "step0000012.ckpt.refused").read_bytes() == cut_short  # nothing lost
    assert (checkpoints / "last.ckpt.refused").is_file() and load(checkpoints / "last.ckpt")["global_step"] == 11
    assert [p.name for p in run_checkpoints(run)] == ["step0000003.ckpt", "step0000006.ckpt", "step0000009.ckpt"]
    assert "3 periodic (step0000003.ckpt ... step0000009.ckpt)" in caplog.text
    assert f"make average RUN={run} N=3" in caplog.text


def test_a_second_training_into_a_folder_in_use_is_refused_and_a_dead_holders_lock_is_taken_over(corpus, tmp_path):
    run = tmp_path / "run"
    args = [f"data.path={corpus}", "trainer.max_steps=2"]
    hold = f"from transformer_mt.files import RunFolderLock; RunFolderLock(Path({str(run)!r})).__enter__()"
    script = f"from pathlib import Path; {hold}; print('held', flush=True); __import__('sys').stdin.read()"
    holder = subprocess.Popen(  # another training, holding the folder until its stdin closes (however slow we are)
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        refused = rf"{re.escape(str(run))} is in use by another training \(pid {holder.pid} on "
        with pytest.raises(InputError, match=refused):
            train_in_process(args, tmp_path, run)
        assert not (run / "checkpoints").exists()  # nothing of the refused start
        RunFolder(
            run
        ).remove_if_empty()  # what a failed start does to its folder: not to a folder another training holds
        assert (run / ".lock").is_file()
    finally:
        holder.kill()
        holder.wait()
    train_in_process(args, tmp_path, run)  # the holder died by SIGKILL: its lock went with it
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_a_lightning_hpc_checkpoint_in_the_run_folder_is_refused_under_slurm_not_restored(
    corpus, tmp_path, monkeypatch
):
    """Lightning restores <run>/hpc_ckpt_<N>.ckpt by itself under SLURM when given no checkpoint, past every check of
    the project's resume: a start that would be restored from one is refused in one line naming it and the two ways
    on; ckpt_path=<it> puts it through the project's own checks (issue 45, point 4)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "hpc_ckpt_2.ckpt").write_bytes(b"from somewhere else")
    (run_dir / "hpc_ckpt_10.ckpt").write_bytes(b"from somewhere else")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # what Lightning's SLURMEnvironment.detect() reads
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    args = [f"data.path={corpus}", "trainer.max_steps=2"]
    with pytest.raises(InputError) as error:
        train_in_process(args, tmp_path, run_dir)
    hpc = run_dir / "hpc_ckpt_10.ckpt"  # the one Lightning would take: the highest number
    assert str(error.value).startswith(f"{hpc}: a Lightning HPC checkpoint, which Lightning would restore under SLURM")
    assert str(error.value).endswith(f"ckpt_path={hpc}") and not (run_dir / "checkpoints").exists()
    with pytest.raises(InputError, match="not a checkpoint|cannot be read|damaged"):  # given on purpose: checked
        train_in_process([*args, f"ckpt_path={hpc}"], tmp_path, run_dir)
    monkeypatch.delenv("SLURM_NTASKS")  # off SLURM Lightning restores nothing: the run starts as usual
    train_in_process(args, tmp_path, run_dir)
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 2


@pytest.mark.slow
def test_a_refused_start_leaves_the_runs_record_byte_for_byte(corpus, tmp_path):
    """As a user runs it (Hydra's own entry point): the run's .hydra/ holds its settings; a second training in the
    same SLURM job's folder with seed=1 is refused in one line, and .hydra/ is what it was, byte for byte (Hydra wrote
    the refused settings there before, issue 56 point 1)."""
    env = {"SLURM_JOB_ID": "7002", "ENVIRONMENT": "BATCH"}  # sbatch's script running python itself
    run_dir = tmp_path / "slurm-7002"
    args = [f"data.path={corpus}", "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]
    run_train([*args, "seed=0"], tmp_path, env=env)
    folder = lambda: {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "train.log"}  # noqa: E731
    before, log = folder(), (run_dir / "train.log").read_bytes()
    record = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    assert sorted(record) == ["code.yaml", "config.yaml", "hydra.yaml", "overrides.yaml"]  # code.yaml: issue 63
    assert record["config.yaml"].startswith(b"seed: 0\n") and b"- seed=0\n" in record["overrides.yaml"]
    refused = run_train([*args, "seed=1"], tmp_path, env=env, check=False)
    assert refused.returncode == 1 and "holds another training of slurm-7002" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == record
    assert folder() == before  # nothing else changed either; the log only gained the refused attempt's lines
    assert (run_dir / "train.log").read_bytes().startswith(log)


def test_a_second_training_in_one_slurm_job_does_not_continue_the_firsts_folder(corpus, tmp_path, monkeypatch):
    """A batch script that runs python twice without srun (one folder, slurm-<job>): a restart of the same training
    continues by itself (with a longer schedule too); a second training with other settings (seed 0, then seed 1) is
    refused in one line naming the folder, the settings and both ways on, the first run's checkpoints untouched
    (issue 45, point 1)."""
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_ARRAY_JOB_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7001")  # sbatch's script running python itself: the job's folder
    monkeypatch.setenv("ENVIRONMENT", "BATCH")
    run_dir, args = tmp_path / "slurm-7001", [f"data.path={corpus}", "trainer.max_steps=2", "seed=0"]
    train_in_process(args, tmp_path, run_dir)
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").glob("*.ckpt")}
    with pytest.raises(InputError) as error:
        train_in_process([*args[:2], "seed=1"], tmp_path, run_dir)
    message = str(error.value)
    assert message.startswith(
        f"{run_dir} holds another training of slurm-7001, made with other settings (data.seed 0 -> 1; seed 0 -> 1)"
    )
    assert message.endswith("these settings on purpose (ckpt_path=last)") and "\n" not in message
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").glob("*.ckpt")} == before
    train_in_process(args, tmp_path, run_dir)  # the same training restarted (requeued): it continues by itself
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 2
    train_in_process([args[0], "trainer.max_steps=3", "seed=0"], tmp_path, run_dir)  # run on: the same training
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 3
    copied = tmp_path / "elsewhere" / "slurm-7001"  # the folder copied (another file system), the job restarted there:
    shutil.copytree(run_dir, copied)  # logger.save_dir, derived from the folder, is not a changed setting
    train_in_process([args[0], "trainer.max_steps=4", "seed=0"], tmp_path, copied)
    assert load(copied / "checkpoints" / "last.ckpt")["global_step"] == 4


def test_periodic_checkpoints_keep_the_newest_by_update_past_epoch_999_and_only_their_own_names(tmp_path):
    """UpdateCheckpoint prunes its own files (one name pattern) by update number, not by name: epoch 1000's file
    sorts before epoch 999's as text. Other names in the folder (another pattern, averages, last.ckpt) stay."""
    (tmp_path / "average-last2.ckpt").touch()
    (tmp_path / "step0000007.ckpt").touch()
    trainer = SimpleNamespace(
        current_epoch=0,
        save_checkpoint=lambda path, weights_only: path.touch(),
        strategy=SimpleNamespace(remove_checkpoint=lambda path: path.unlink()),
    )
    periodic = UpdateCheckpoint(tmp_path, "epoch{epoch:03d}-step{step:07d}", keep=2, epochs=1)
    for epoch in (998, 999, 1000):
        trainer.current_epoch = epoch
        periodic.write(trainer, SimpleNamespace(step=epoch + 1, clock=0.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "average-last2.ckpt",
        "epoch1000-step0001001.ckpt",
        "epoch999-step0001000.ckpt",
        "step0000007.ckpt",
    ]


def test_a_refused_checkpoint_write_names_the_cause_and_suits_every_command(tmp_path, monkeypatch):
    """A read-only folder is not called a full disk, and make average's or make finish's user is not told to resume
    a training; nothing partial stays behind."""

    def refuse(obj, f) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(torch, "save", refuse)
    with pytest.raises(UserError) as error:
        write_checkpoint({"state_dict": {}}, tmp_path / "average-last5.ckpt")
    text = str(error.value)
    assert text.startswith(f"could not write {tmp_path / 'average-last5.ckpt'}: [Errno 30] Read-only file system (")
    assert "a folder that cannot be written" in text and "run the command again" in text and "\n" not in text
    assert list(tmp_path.iterdir()) == []
