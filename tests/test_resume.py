"""Fault injection: training SIGKILLed at many points, resumed with the documented command
(`ckpt_path=last hydra.run.dir=<run>`), must end bit-identical to the run that was never killed."""

import json
import os
import re
import resource
import signal
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    ROOT,
    assert_same_run,
    assert_same_training_state,
    load,
    run_process,
    run_train,
    validation_lines,
    write_corpus,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # processes killed and resumed, several per test

MAX_STEPS = 39  # 18 updates per epoch on this corpus: the runs span three epochs; a multiple of EVERY
EVERY = 3  # a periodic checkpoint every 3 updates: a crash costs at most 3 updates


def common(corpus: Path) -> list[str]:
    return [
        f"data.path={corpus}",
        "model.dropout=0.1",  # as every shipped model: resume must restore the dropout masks' generator
        f"checkpoint.every_n_train_steps={EVERY}",
        f"trainer.max_steps={MAX_STEPS}",
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    corpus = write_corpus(root / "corpus")
    run_train([*common(corpus), f"hydra.run.dir={root / 'run'}"], root)
    return root / "run" / "checkpoints"


# Each chain is one run killed at every point in turn, each start after the first the documented resume
# command (which the next point kills in its turn): a resume of a resume must be as exact as the first.
KILLS = [
    pytest.param(
        [
            "update:10",  # mid-epoch, after an update, before its checkpoints
            "validation:12",  # update 12 has a periodic checkpoint and a validation: the checkpoint waits for it
            "write:last.ckpt:12",  # its step0000012.ckpt is complete, last.ckpt cut short
            "epoch-end:0",
            "validation:20",
            "update:25",  # inside the second epoch
            "write:step0000030.ckpt:30",  # a periodic checkpoint cut short
            "update:31",
        ],
        id="at-8-points-in-one-run",
    ),
    # data.num_workers=2: persistent loader worker processes give the same batches and the same result
    pytest.param(["epoch-end:0", "update:25"], id="with-2-loader-workers"),
]


def resumed_from(proc) -> tuple[str, int]:
    found = re.search(r"resuming from (\S+) \(update (\d+)\)", proc.stdout)
    assert found, proc.stdout[-3000:]
    return Path(found.group(1)).name, int(found.group(2))


@pytest.mark.parametrize("kills", KILLS)
def test_a_run_killed_and_resumed_ends_bit_identical_to_the_uninterrupted_run(kills, uninterrupted, tmp_path, request):
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    args = [*common(corpus), f"hydra.run.dir={run}"] + (
        ["data.num_workers=2"] if "workers" in request.node.name else []
    )
    kill_at = str(ROOT / "tests" / "kill_at.py")
    resumed_files = set()
    proc = run_train(args, tmp_path, check=False, entry=(kill_at, kills[0]))
    for attempt, point in enumerate(kills):
        killed = proc  # the start killed at this point: the first, or the resume of the point before
        assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]  # SIGKILL, really
        kind, *where = point.split(":")
        if kind == "write":  # the half-written file of the killed write is there, under its temporary name
            assert [p.name.split(".tmp-")[0] for p in checkpoints.glob(".*.tmp-*")] == [f".{where[0]}"]
        if kind == "validation":  # killed inside it: that validation never reported (the run has one there)
            done = [int(v) for v in re.findall(r"validation at update (\d+):", killed.stdout)]
            assert all(v < int(where[0]) for v in done) and max(validation_lines(uninterrupted.parent)) >= int(where[0])
        # The next start, the documented command (the same settings and folder, ckpt_path=last), resumes from
        # the newest complete checkpoint, at most one interval back; the next point, if any, kills it in its turn.
        following = kills[attempt + 1] if attempt + 1 < len(kills) else None
        if following is None:
            proc = run_train([*args, "ckpt_path=last"], tmp_path)
        else:
            proc = run_train([*args, "ckpt_path=last"], tmp_path, check=False, entry=(kill_at, following))
        name, step = resumed_from(proc)
        resumed_files.add(name)
        if kind in ("update", "write"):
            assert int(where[-1]) - EVERY <= step <= int(where[-1]), step
        if point == "write:last.ckpt:12":  # last.ckpt was cut short; the step checkpoint of update 12 is complete
            assert (name, step) == ("step0000012.ckpt", 12)
        if kind == "epoch-end":
            assert step == 18  # the epoch's last update; training goes on with the next epoch
        for noise in ("not resumable", "unreliable results", "exists and is not empty", "Traceback"):
            assert noise not in proc.stdout + proc.stderr, noise
        if following is not None:
            continue

        assert_same_run(uninterrupted.parent, run, MAX_STEPS)
        periodic = f"step{MAX_STEPS:07d}.ckpt"
        assert_same_training_state(uninterrupted / periodic, checkpoints / periodic, MAX_STEPS)
        # The same files as the uninterrupted run: the last 5 periodic ones, last, best. No stale temporary
        # file, no "-v1" copy beside a killed attempt's file, no periodic file beyond keep_last, except
        # a file a run resumed from, which Lightning never deletes (here when last.ckpt was cut short).
        expected = {p.name for p in uninterrupted.iterdir()}
        files = {p.name for p in checkpoints.iterdir()}
        assert expected <= files and files - expected <= resumed_files, (sorted(files), sorted(expected))


def test_ddp_with_accumulation_and_time_based_checkpoints_killed_and_resumed_is_bit_identical(tmp_path):
    """The paper's recipe on several devices: 2 DDP ranks, 2 micro-batches per update, checkpoints by time
    (the base/big configs' train_time_interval_minutes) that come due inside accumulation windows and are
    written at the update's end. SIGKILLed after update 7 and resumed: the uninterrupted run's state."""
    corpus = write_corpus(tmp_path / "corpus")
    args = [
        f"data.path={corpus}",
        "model.dropout=0.1",
        "trainer.strategy=ddp",
        "trainer.devices=2",
        "data.tokens_per_update=1200",  # max_tokens 300 x 2 devices x 2 micro-batches
        "checkpoint.train_time_interval_minutes=0.002",  # every 0.12 s: due mid-update most of the time
        "trainer.max_steps=12",
    ]
    uninterrupted, run = tmp_path / "uninterrupted", tmp_path / "run"
    first = run_train([*args, f"hydra.run.dir={uninterrupted}"], tmp_path)
    assert "accumulation 2 x 300 tokens x 2 device(s)" in first.stdout
    kill_at = str(ROOT / "tests" / "kill_at.py")
    killed = run_train([*args, f"hydra.run.dir={run}"], tmp_path, check=False, entry=(kill_at, "update:7"))
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    timed = sorted(p.name for p in (run / "checkpoints").glob("time-step*.ckpt"))
    assert timed, "no time-based checkpoint was written before the kill"
    resumed = run_train([*args, "ckpt_path=last", f"hydra.run.dir={run}"], tmp_path)
    _, step = resumed_from(resumed)
    assert 1 <= step <= 7
    assert_same_run(uninterrupted, run, 12)


# ---------------------------------------------------------------- stopped by a signal


SIGNAL_RUN = ["model.dropout=0.1", "checkpoint.every_n_train_steps=3", "trainer.max_steps=12"]
ACCUMULATE_2 = ["data.tokens_per_update=600"]  # max_tokens 300: 2 micro-batches per update on one device
DDP_ACCUMULATE_2 = ["trainer.strategy=ddp", "trainer.devices=2", "data.tokens_per_update=1200"]  # per rank


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory) -> Path:
    """The uninterrupted run of the signal tests: 2 micro-batches per update, 12 updates."""
    root = tmp_path_factory.mktemp("accumulated")
    corpus = write_corpus(root / "corpus")
    run_train([f"data.path={corpus}", *SIGNAL_RUN, *ACCUMULATE_2, f"hydra.run.dir={root / 'run'}"], root)
    return root / "run" / "checkpoints"


def fake_slurm(tmp_path: Path, batch_script: bool = False) -> dict:
    """One SLURM task's variables (an srun step's; with batch_script, those of an sbatch script that runs
    python itself: no step, no task), and an `scontrol` on PATH that records how it was called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.calls"}\n')
    scontrol.chmod(0o755)
    names = ["NTASKS", "NTASKS_PER_NODE", "NNODES", "PROCID", "LOCALID", "NODEID", "JOB_ID", "STEP_ID"]
    values = dict(zip(names, ["1", "1", "1", "0", "0", "0", "777", "0"]))
    if batch_script:
        values = {"JOB_ID": "777", "NNODES": "1", "NODEID": "0"}
    return {
        **{f"SLURM_{k}": v for k, v in values.items()},
        **({"ENVIRONMENT": "BATCH"} if batch_script else {}),
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "127.0.0.1",
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
    }


@pytest.mark.parametrize(
    "name, ranks",
    [("SIGTERM", 1), ("SIGINT", 1), ("SIGTERM", 2), ("SIGUSR1", 1), ("SIGUSR1-sbatch", 1)],
    ids=["sigterm", "sigint-ctrl-c", "sigterm-to-rank-0-of-2-ddp", "slurm-requeue-sigusr1", "sbatch-without-srun"],
)
def test_a_signal_stops_at_the_update_boundary_saves_and_exits_nonzero_and_the_run_continues_exactly(
    name, ranks, accumulated, tmp_path
):
    """The signal comes inside update 8's accumulation window (after its first micro-batch started): the run
    finishes update 8, writes last.ckpt there, says how to continue and exits 128 + the signal's number.
    Continued, it ends bit-identical to the uninterrupted run. Under DDP only rank 0 receives it; under
    SLURM the requeue signal also runs `scontrol requeue <job>`, and the requeued job continues by itself, also
    when its batch script runs python without srun."""
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    slurm, batch_script = name.startswith("SIGUSR1"), name.endswith("-sbatch")
    name = name.removesuffix("-sbatch")
    env = fake_slurm(tmp_path, batch_script) if slurm else {}
    shape = DDP_ACCUMULATE_2 if ranks == 2 else ACCUMULATE_2
    args = [f"data.path={corpus}", *SIGNAL_RUN, *shape] + ([] if slurm else [f"hydra.run.dir={run}"])
    if ranks == 2:  # its own uninterrupted run
        run_train([f"data.path={corpus}", *SIGNAL_RUN, *shape, f"hydra.run.dir={tmp_path / 'whole'}"], tmp_path)
        accumulated = tmp_path / "whole" / "checkpoints"
    kill_at = str(ROOT / "tests" / "kill_at.py")
    stopped = run_train(args, tmp_path, env=env, check=False, entry=(kill_at, f"signal:{name}:7"))
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + getattr(signal, name), output[-3000:]
    if slurm:
        run = tmp_path / "outputs" / ("slurm-777" if batch_script else "slurm-777-0")
        assert (tmp_path / "scontrol.calls").read_text() == "requeue 777\n"
    checkpoint = load(run / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == 8  # update 8 finished, not cut short, and nothing after it
    micro_batches = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"]
    assert micro_batches == 16 or ranks == 2  # (2 ranks: the first epoch ends on an update of 1 micro-batch)
    assert f"received {name}: stopping at the end of the update in progress" in output
    assert f"stopped by {name} after update 8; last.ckpt holds it" in output
    assert "ckpt_path=last hydra.run.dir=" in output and "finished after" not in output
    # Continued: the documented command, or (SLURM) the same command again, as a requeued job runs it.
    proc = run_train([*args, *([] if slurm else ["ckpt_path=last"])], tmp_path, env=env)
    assert resumed_from(proc) == ("last.ckpt", 8)
    assert_same_run(accumulated.parent, run, 12)
    assert_same_training_state(accumulated / "step0000012.ckpt", run / "checkpoints" / "step0000012.ckpt", 12)


def test_a_sigterm_while_the_run_starts_stops_it_there_in_one_line_with_status_143(tmp_path):
    """Before training starts (restoring, the sanity validation), Lightning's own handler takes the signal and calls
    the command's, which stops the start there (issue 57: it used to train one update first, and before that exit 0
    with nothing): one line, 143, and the new run folder, with nothing trained, removed."""
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "runs" / "run"
    args = [f"data.path={corpus}", "trainer.num_sanity_val_steps=1", "trainer.max_steps=12", f"hydra.run.dir={run}"]
    kill_at = str(ROOT / "tests" / "kill_at.py")
    stopped = run_train(args, tmp_path, check=False, entry=(kill_at, "signal:SIGTERM:-1"))
    stopped_in_one_line(stopped, signal.SIGTERM, "before the first update: nothing was trained")
    assert not (tmp_path / "runs").exists()


def stopped_in_one_line(proc, signum: int, kept: str) -> None:
    """Status 128 + the signal, no traceback, and one line on stderr saying what was kept (issue 57)."""
    name, output = signal.Signals(signum).name, proc.stdout + proc.stderr
    assert proc.returncode == 128 + signum and "Traceback" not in output, output[-3000:]
    assert f"stopped by {name}: {kept}" in proc.stderr and output.count(f"stopped by {name}") == 1, proc.stderr


@pytest.mark.parametrize("point", ["probe:SIGINT", "signal:SIGINT:-1"])
def test_a_ctrl_c_while_the_run_starts_ends_in_one_line_and_leaves_no_folder(tmp_path, point):
    """SIGINT as data.max_tokens=auto's batch-size probe starts, or as the sanity validation starts, before training
    (Lightning answered "Detected KeyboardInterrupt, attempting graceful shutdown" and exit 1, and left a run folder
    without a checkpoint)."""
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "runs" / "run"
    args = [f"data.path={corpus}", "trainer.num_sanity_val_steps=1", "trainer.max_steps=12", f"hydra.run.dir={run}"]
    args += ["data.max_tokens=auto"] * point.startswith("probe")
    stopped = run_train(args, tmp_path, check=False, entry=(str(ROOT / "tests" / "kill_at.py"), point))
    stopped_in_one_line(stopped, signal.SIGINT, "before the first update: nothing was trained")
    assert "graceful shutdown" not in stopped.stdout + stopped.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_inside_the_end_of_run_protocol_ends_in_one_line_naming_make_finish(tmp_path, signum):
    """Ctrl+C (or SIGTERM) while the end of the run decodes: one line naming make finish, 130 (143), no results.json
    (an 84-line KeyboardInterrupt traceback before)."""
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    final = ["final.enabled=true", "final.average_last=2", "checkpoint.every_n_train_steps=2", "decoding.max_len_b=10"]
    args = [f"data.path={corpus}", "trainer.max_steps=4", *final, f"hydra.run.dir={run}"]
    point = f"final:{signal.Signals(signum).name}"
    stopped = run_train(args, tmp_path, check=False, entry=(str(ROOT / "tests" / "kill_at.py"), point))
    kept = "in the end of the run; training is complete and its checkpoints kept: finish it with make finish RUN=run"
    stopped_in_one_line(stopped, signum, kept)
    assert not (run / "results.json").exists() and (run / "checkpoints" / "last.ckpt").is_file()


def test_a_kill_inside_the_end_of_run_protocol_says_how_to_finish_it_and_make_finish_does(tmp_path):
    """The protocol starts by saying how to finish it; a SIGKILL while it decodes leaves no results.json, and
    `python -m transformer_mt.finish <run>` (make finish) writes it from the run's own settings."""
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    final = ["final.enabled=true", "final.average_last=2", "checkpoint.every_n_train_steps=2", "decoding.max_len_b=10"]
    args = [f"data.path={corpus}", "trainer.max_steps=4", *final, f"hydra.run.dir={run}"]
    killed = run_train(args, tmp_path, check=False, entry=(str(ROOT / "tests" / "kill_at.py"), "final:0"))
    output = killed.stdout + killed.stderr
    assert killed.returncode == -9, output[-3000:]
    assert f"if this is interrupted, finish it with: make finish RUN={run}" in output
    assert not (run / "results.json").exists()
    proc = run_process([sys.executable, "-m", "transformer_mt.finish", str(run)], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["updates"] == 4 and results["finished_by"] == "make finish" and results["devices"] == 1
    assert "trainer.max_steps=4" in results["overrides"]  # the training's command line (.hydra/), for the model card
    test = results["models"]["average-last2"]["test"]
    assert test["sentences"] == 30 and test["bleu_signature"].startswith("nrefs:1|") and test["ppl"] > 1


# ---------------------------------------------------------------- what resuming refuses, and a full disk


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def test_resume_refuses_what_it_cannot_continue_in_one_line(tmp_path):
    corpus, other = write_corpus(tmp_path / "corpus"), write_corpus(tmp_path / "other")
    for path in other.iterdir():  # other text, the same vocabulary size: another SentencePiece model
        path.write_text(path.read_text().upper())
    run = tmp_path / "run"
    run_train([f"data.path={corpus}", "trainer.max_steps=3", f"hydra.run.dir={run}"], tmp_path)
    last = run / "checkpoints" / "last.ckpt"

    def resume(*args):
        return one_error_line(run_train([f"data.path={corpus}", "trainer.max_steps=6", *args], tmp_path, check=False))

    line = resume(f"data.path={other}", f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'a'}")
    assert f"ckpt_path={last}: the checkpoint's model has another SentencePiece model" in line
    line = resume("model.d_model=64", "ckpt_path=last", f"hydra.run.dir={run}")
    assert f"ckpt_path={last}: the checkpoint's model has d_model 32 (now 64)" in line
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(last.read_bytes()[:1000])  # a copy cut short
    # data.tokens_per_update null: the update is data.max_tokens per device; 2 devices would double it
    saved = load(last)["update_tokens"]
    line = resume("trainer.devices=2", "trainer.strategy=ddp", "ckpt_path=last", f"hydra.run.dir={run}")
    assert (
        f"the checkpoint's updates held {saved:,} padded tokens per side, these settings give {2 * saved:,} on 2"
        in line
    )
    assert f"keep the recipe with data.tokens_per_update={saved}" in line
    line = resume(f"ckpt_path={junk}", f"hydra.run.dir={tmp_path / 'b'}")
    assert line == f"error: {junk}: damaged or incomplete checkpoint (RuntimeError: PytorchStreamReader failed " + (
        "reading zip archive: failed finding central directory)"
    )
    line = resume("ckpt_path=last", f"hydra.run.dir={tmp_path / 'fresh'}")
    assert "ckpt_path=last: no complete checkpoint in" in line and "hydra.run.dir=<the run's folder>" in line
    older = load(last)  # as Lightning's automatic optimization counted updates, before TranslationModule.update
    older["loops"]["fit_loop"]["epoch_loop.manual_optimization.optim_step_progress"]["total"]["completed"] = 0
    torch.save(older, tmp_path / "older.ckpt")
    line = resume(f"ckpt_path={tmp_path / 'older.ckpt'}", f"hydra.run.dir={tmp_path / 'c'}")
    assert "written before the update moved into the module" in line and "the commit that wrote it" in line
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c", "fresh"))  # failed starts leave no folder
    # Nothing was written into the run that the refused resume named.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]


def limit_file_size(limit: int):
    def apply() -> None:  # in the child: a write past `limit` bytes fails with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_checkpoint_write_that_fails_ends_in_one_line_and_leaves_no_partial_file(tmp_path):
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    args = [f"data.path={corpus}", "trainer.max_steps=3", f"hydra.run.dir={run}"]
    run_train(["trainer.max_steps=0", *args[:1], f"hydra.run.dir={tmp_path / 'cache-only'}"], tmp_path)
    # The data cache exists; the checkpoint (~0.8 MB with Adam's moments) is larger than the limit.
    proc = run_train(args, tmp_path, check=False, preexec_fn=limit_file_size(400_000))
    line = one_error_line(proc)
    assert line.startswith(f"error: could not write {run / 'checkpoints'}/") and "Nothing partial was left" in line
    assert list((run / "checkpoints").iterdir()) == []  # no truncated file, no temporary file


def test_a_finished_run_extended_with_more_updates_continues_its_epoch(uninterrupted, tmp_path):
    # 20 updates end inside the second epoch; continuing to 39 must match the run that went to 39 at once.
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    args = [*common(corpus), f"hydra.run.dir={run}"]
    run_train([*args, "trainer.max_steps=20"], tmp_path)
    proc = run_train([*args, "ckpt_path=last"], tmp_path)
    assert resumed_from(proc) == ("last.ckpt", 20)
    assert "trainer.max_steps: 20 -> 39" in proc.stdout  # the changed setting is logged
    assert_same_training_state(uninterrupted / "last.ckpt", run / "checkpoints" / "last.ckpt", MAX_STEPS)


# ---------------------------------------------------------------- the random state of a process's own GPU


class FakeCuda:
    """torch.cuda as a process sees it with `visible` GPUs, using `current`: each device's generator state."""

    def __init__(self, visible: int, current: int):
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(visible)}
        self.current = current

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.states[self.current].clone())
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states.values()])
        monkeypatch.setattr(cuda, "set_rng_state", self.set_one)
        monkeypatch.setattr(
            cuda, "set_rng_state_all", lambda states: [self.set_one(s, i) for i, s in enumerate(states)]
        )

    def set_one(self, state, device="cuda"):
        index = self.current if device == "cuda" else device
        if index not in self.states:  # as torch.cuda.default_generators[index]
            raise IndexError(f"no CUDA device {index}")
        self.states[index] = state.clone()


def test_a_resume_that_sees_fewer_gpus_restores_its_own_devices_random_state(monkeypatch):
    """Saved by a process that saw 8 GPUs and trained on cuda:3 (a ddp launcher's rank 3); resumed by one that
    sees only its own GPU (srun --gpus-per-task=1): the state of the device it trains on, no IndexError."""
    from transformer_mt.training.resume import random_state, set_random_state  # noqa: PLC0415

    FakeCuda(visible=8, current=3).install(monkeypatch)
    saved = random_state()
    resumed = FakeCuda(visible=1, current=0)
    resumed.install(monkeypatch)
    set_random_state(saved)
    assert torch.equal(resumed.states[0], torch.tensor([3], dtype=torch.uint8))


# ---------------------------------------------------------------- a time budget, killed, stopped and resumed

# 100 s of training on the driven clock (kill_at.py: 1 s per micro-batch, whatever the machine does): the horizon,
# measured over updates 10-30, is 30 + 70 x 0.95 = 96 (budget.py), the same in every run; corrected where the
# cool-down begins (update 96 - 19 = 77) to 77 + floor(23 x 0.95) = 98: the margin of the time already spent returns.
BUDGETED = [
    "model.dropout=0.1",
    "trainer.max_time=00:00:01:40",
    "trainer.max_steps=500",
    "checkpoint.every_n_train_steps=3",
]


def test_a_budgeted_run_killed_stopped_and_resumed_continues_its_schedule_bit_identically(tmp_path):
    """Killed at update 20, before the horizon is fixed; resumed, then stopped by Ctrl+C at update 40 (40% of its
    budget, after the fix) and resumed again with the documented command: it trains the remaining updates of the
    same schedule, to the horizon, and ends bit-identical to the uninterrupted run (weights, Adam, schedule)."""
    corpus = write_corpus(tmp_path / "corpus")
    kill_at = str(ROOT / "tests" / "kill_at.py")
    env = {"KILL_AT_CLOCK": "1.0"}
    whole, run = tmp_path / "whole", tmp_path / "run"
    first = run_train(
        [f"data.path={corpus}", *BUDGETED, f"hydra.run.dir={whole}"], tmp_path, env=env, entry=(kill_at, "none:0")
    )
    assert "time budget 0:01:40: ~96 updates" in first.stdout + first.stderr
    args = [f"data.path={corpus}", *BUDGETED, f"hydra.run.dir={run}"]
    killed = run_train(args, tmp_path, env=env, check=False, entry=(kill_at, "update:20"))
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    stopped = run_train([*args, "ckpt_path=last"], tmp_path, env=env, check=False, entry=(kill_at, "signal:SIGINT:39"))
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 130 and resumed_from(stopped) == ("last.ckpt", 18), output[-3000:]
    assert "time budget 0:01:40: ~96 updates" in output  # fixed in this attempt: the kill came before
    assert "stopped by SIGINT after update 40" in output
    proc = run_train([*args, "ckpt_path=last"], tmp_path, env=env, entry=(kill_at, "none:0"))
    assert resumed_from(proc) == ("last.ckpt", 40)
    assert "0:00:40 used; the schedule ends at update 96 (fixed at update 30)" in proc.stdout + proc.stderr
    assert "so the cool-down from update 77 ends at update 98 (planned: 96)" in proc.stdout + proc.stderr
    assert_same_run(whole, run, 98)
    a, b = load(whole / "checkpoints" / "last.ckpt"), load(run / "checkpoints" / "last.ckpt")
    assert a["budget"] == b["budget"] and a["budget"]["horizon"] == 98
    assert a["totals"]["train_seconds"] == b["totals"]["train_seconds"] == 98.0  # the redone updates counted once


def test_a_budget_on_two_ddp_ranks_is_decided_on_rank_0s_clock_by_both(tmp_path):
    """2 DDP ranks over gloo, one micro-batch per update each, the driven clock: both ranks fix the horizon at 96
    and correct it to 98 on rank 0's clock (it travels in the update's one all-reduce), and both end there (ranks
    that disagreed would hang at the next all-reduce)."""
    corpus = write_corpus(tmp_path / "corpus")
    args = [f"data.path={corpus}", *BUDGETED, "trainer.strategy=ddp", "trainer.devices=2", "data.tokens_per_update=600"]
    kill_at = str(ROOT / "tests" / "kill_at.py")
    proc = run_train(
        [*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env={"KILL_AT_CLOCK": "1.0"}, entry=(kill_at, "none:0")
    )
    output = proc.stdout + proc.stderr
    assert "accumulation 1 x 300 tokens x 2 device(s)" in output
    assert "time budget 0:01:40: ~96 updates" in output
    assert "so the cool-down from update 77 ends at update 98 (planned: 96)" in output
    last = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 98 and last["budget"]["horizon"] == 98
    assert "ran out" not in output


def test_ctrl_c_between_validations_adds_none_and_a_second_one_exits_130_at_once(tmp_path):
    """Ctrl+C after update 3 of a run that validates every 100 updates: update 4 ends, last.ckpt holds it, exit 130,
    and no validation runs (Lightning validates whenever it is told to stop). Two in a row: 130 too, at once."""
    corpus = write_corpus(tmp_path / "corpus")
    kill_at = str(ROOT / "tests" / "kill_at.py")
    args = [f"data.path={corpus}", "trainer.max_steps=12", "trainer.val_check_interval=100"]
    once = run_train(
        [*args, f"hydra.run.dir={tmp_path / 'once'}"], tmp_path, check=False, entry=(kill_at, "signal:SIGINT:3")
    )
    output = once.stdout + once.stderr
    assert once.returncode == 130 and "stopped by SIGINT after update 4" in output, output[-3000:]
    assert (
        "validation at update" not in output
        and load(tmp_path / "once" / "checkpoints" / "last.ckpt")["global_step"] == 4
    )
    assert not (tmp_path / "once" / "checkpoints" / "best.ckpt").exists()
    twice = run_train(
        [*args, f"hydra.run.dir={tmp_path / 'twice'}"], tmp_path, check=False, entry=(kill_at, "signal:SIGINT-twice:3")
    )
    output = twice.stdout + twice.stderr
    assert twice.returncode == 130 and "received SIGINT again: stopping now" in output, output[-3000:]
    assert "Traceback" not in output and "validation at update" not in output
