"""scripts/gpu_check.py (`make gpu-check`) here, without a GPU: the one-line answer, JUnit -> table, the exit rule;
and what the cuda tests build on the CPU: the base recipe's run and its progress lines' medians
(tests/test_cuda_trainer.py), the two-rank launch on one GPU (tests/test_cuda_runs.py), run on the CPU here."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import OmegaConf

import transformer_mt.training.fit
from conftest import ROOT, TINY_RUN, TINY_SHAPE, free_port, run_process, write_corpus
from test_cuda_runs import GLOO_TRAIN, run_ranks, two_rank_launch
from test_cuda_trainer import (
    MULTI30K_LAYOUT,
    Speed,
    figures,
    made_up_corpus,
    progress_speed,
    trainer_command,
    update_shape,
)
from transformer_mt.configs import compose
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.training.fit import trainer_arguments
from transformer_mt.training.sharding import LayerFSDP

SCRIPT = ROOT / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)
Row = gpu_check.Row

# As pytest 9 writes it (newlines in a message as &#10;): a pass with figures, a failure, a skip, an error in setup,
# and a pass whose teardown failed (a second <testcase> of the same name).
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="2" failures="1" skipped="1" tests="6" time="130.2">
<testcase classname="tests.test_cuda_kernels" name="test_bf16_training_update_of_the_base_model" time="21.503">
  <properties><property name="figures" value="27,000 tgt tok/s, 41% of bf16 peak, 12.3 GiB"/></properties>
</testcase>
<testcase classname="tests.test_cuda_runs" name="test_multi30k_training_on_the_gpu_lowers_the_loss" time="95.25">
  <properties><property name="figures" value="loss 8.50 -&gt; 8.40 in 200 updates"/></properties>
  <failure message="AssertionError: loss 8.50 -&gt; 8.40 in 200 updates (expected at least 15% lower)\
&#10;assert 8.4 &lt; (0.85 * 8.5)">def test_multi30k_training_on_the_gpu_lowers_the_loss(...):
E       AssertionError: loss 8.50 -&gt; 8.40</failure>
</testcase>
<testcase classname="tests.test_cuda_runs" name="test_two_rank_training_then_translate[fsdp]" time="0.001">
  <skipped type="pytest.skip" message="needs a CUDA GPU">tests/test_cuda_runs.py:255: needs a CUDA GPU</skipped>
</testcase>
<testcase classname="tests.test_cuda_runs" name="test_beam_search_on_the_gpu_gives_the_cpus_tokens[multi30k]" \
time="0.002">
  <error message="failed on setup with &quot;RuntimeError: CUDA error: out of memory&quot;">traceback</error>
</testcase>
<testcase classname="tests.test_cuda" name="test_forward_in_fp32_matches_the_cpu" time="1.25"/>
<testcase classname="tests.test_cuda" name="test_forward_in_fp32_matches_the_cpu" time="0.25">
  <error message="failed on teardown with &quot;ZeroDivisionError: division by zero&quot;">traceback</error>
</testcase>
</testsuite></testsuites>
"""
ROWS = [
    Row("test_bf16_training_update_of_the_base_model", "PASS", "27,000 tgt tok/s, 41% of bf16 peak, 12.3 GiB", 21.503),
    Row(
        "test_multi30k_training_on_the_gpu_lowers_the_loss",
        "FAIL",
        "AssertionError: loss 8.50 -> 8.40 in 200 updates (expected at least 15% lower)",
        95.25,
    ),
    Row(
        "test_two_rank_training_then_translate[fsdp]",
        "SKIP",
        "needs a CUDA GPU",
        0.001,
    ),
    Row(
        "test_beam_search_on_the_gpu_gives_the_cpus_tokens[multi30k]",
        "FAIL",
        'failed on setup with "RuntimeError: CUDA error: out of memory"',
        0.002,
    ),
    Row(
        "test_forward_in_fp32_matches_the_cpu",
        "FAIL",
        'failed on teardown with "ZeroDivisionError: division by zero"',
        1.5,
    ),
]


def test_junit_rows_give_each_tests_result_and_key_figures():
    assert gpu_check.junit_rows(JUNIT) == ROWS


def test_junit_rows_of_a_run_that_collected_nothing_are_empty():
    assert gpu_check.junit_rows('<testsuites><testsuite name="pytest" tests="0"/></testsuites>') == []


def test_summary_has_one_row_per_test_and_ends_with_the_counts():
    lines = gpu_check.summary(ROWS, seconds=130.4).splitlines()
    assert lines[0].split() == ["test", "result", "key", "figures", "seconds"]
    assert len(lines) == 1 + len(ROWS) + 2 and lines[-2] == ""
    result, figures = lines[0].index("result"), lines[0].index("key figures")  # columns line up
    for line, row in zip(lines[1:], ROWS):
        assert line.startswith(row.test + " ") and line[result:figures].strip() == row.result
        assert line[figures:].startswith(row.figures) and line.endswith(f"{row.seconds:7.1f}")
    assert lines[-1] == "gpu-check: 1 passed, 3 failed, 1 skipped in 130 s"


@pytest.mark.parametrize(
    "results, pytest_status, expected",
    [
        (["PASS", "SKIP"], 0, 0),
        (["PASS", "FAIL", "SKIP"], 1, 1),
        (["PASS"], 2, 1),  # interrupted: not every test ran
        ([], 5, 1),  # no test collected: the `cuda` marker lost its tests
        (["FAIL"], 0, 1),
    ],
)
def test_exit_status_is_1_when_anything_failed(results, pytest_status, expected):
    rows = [Row(f"test_{i}", result, "", 1.0) for i, result in enumerate(results)]
    assert gpu_check.exit_status(rows, pytest_status) == expected


def test_without_a_gpu_it_prints_one_line_and_runs_nothing(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: pytest.fail("ran a command without a GPU"))
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out == (
        f"gpu-check: no CUDA GPU is visible (PyTorch {torch.__version__}), so nothing was checked\n"
    )


def test_with_a_gpu_it_runs_the_cuda_tests_then_prints_the_table(monkeypatch, capsys, tmp_path):
    """The GPU and pytest faked: the header, the pytest command, the table from its JUnit file, exit 1."""
    commands = []

    def fake_pytest(command, cwd, env):
        commands.append((command, cwd, env))
        junit = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--junitxml="))
        Path(junit).write_text(JUNIT, encoding="utf-8")
        return subprocess.CompletedProcess(command, returncode=1)

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_check.subprocess, "run", fake_pytest)
    assert gpu_check.main(["--multi30k", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "device: NVIDIA H100 80GB HBM3 (sm_90, 80 GiB); 1 GPU(s) visible" in out[0]
    ((command, cwd, env),) = commands
    assert command[:8] == [sys.executable, "-m", "pytest", "-m", "cuda", "tests/", "-p", "no:cacheprovider"]
    assert cwd == ROOT and env[gpu_check.MULTI30K_ENV] == str(tmp_path.resolve())
    table = out[out.index("") + 1 :]
    assert table[0].startswith("test ") and len(table) == 1 + len(ROWS) + 2
    assert table[-1].startswith("gpu-check: 1 passed, 3 failed, 1 skipped in ")


def test_a_missing_multi30k_folder_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: pytest.fail("ran pytest with a bad --multi30k"))
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--multi30k", str(tmp_path / "missing")])
    assert exit_info.value.code == 2 and "no such directory" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the checks would run")
def test_the_script_without_a_gpu_says_so_in_one_line_and_exits_0(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == f"gpu-check: no CUDA GPU is visible (PyTorch {torch.__version__}), so nothing was checked\n"


def test_the_speed_rows_stand_together_under_the_table():
    raw = Row("test_bf16_training_update_of_the_base_model", "PASS", "27,000 tgt tok/s, MFU 41.0% of bf16", 21.5)
    eager = Row("test_base_recipe_trains_through_the_trainer[eager]", "PASS", "20,000 tgt tok/s, MFU 30.0%", 50.0)
    compiled = Row("test_base_recipe_trains_through_the_trainer[compiled]", "FAIL", "exit status 1", 90.0)
    lines = gpu_check.summary([raw, ROWS[1], compiled, eager], seconds=200).splitlines()
    block = lines[lines.index("", 5) + 1 : -2]  # between the table (and its blank line) and the counts
    assert block[0].startswith("the base model's speed")
    assert block[1:] == [  # in this order, whatever the table's
        "  raw loop, no Lightning  27,000 tgt tok/s, MFU 41.0% of bf16",
        "  Trainer, eager          20,000 tgt tok/s, MFU 30.0%",
        "  Trainer, compiled       FAIL: exit status 1",
    ]
    assert lines[-1] == "gpu-check: 2 passed, 2 failed, 0 skipped in 200 s"
    assert gpu_check.speed_block([raw, ROWS[1]]) == []  # one of them alone: nothing to compare


# ---------------------------------------------------------------- tests/test_cuda_trainer.py: the base recipe's run

HYDRA_PREFIX = "[2026-12-02 05:58:47,887][transformer_mt.training.callbacks][INFO] - "
LOG = "\n".join(
    [
        "[2026-12-02 05:58:43,531][transformer_mt.training.batch_fit][INFO] - tokens per update: accumulation 1 x "
        "25,000 tokens x 1 device(s) = 25,000 padded tokens per side (data.tokens_per_update: 25000)",
        HYDRA_PREFIX + "first update done 41.2 s after the start (data ready at 2.0 s, training loop started at 9.1 s)",
        *(
            HYDRA_PREFIX + f"update {step}/200 ({step / 200:.0%}) | loss {loss} | lr 2.1e-06 | {tokens} target tok/s | "
            f"305 TFLOP/s, MFU {mfu}% | elapsed 0:01:02 | ETA 0:00:30"
            for step, loss, tokens, mfu in [
                (25, "9.120", "12,000", "1.0"),  # the compile
                (50, "8.900", "350,000", "29.0"),
                (75, "8.500", "400,000", "33.0"),
                (100, "8.300", "410,000", "34.0"),
                (125, "8.100", "1,000", "0.1"),  # a recompile
            ]
        ),
        HYDRA_PREFIX + "validation at update 125: loss 7.9, ppl 2,697, greedy sacreBLEU 0.12, chrF 3.37 (8 sentences)",
        HYDRA_PREFIX + "finished after 125 updates; next:",
    ]
)


def test_progress_speed_is_the_median_of_the_lines_after_the_warm_up():
    speed = progress_speed(LOG, warmup_lines=1)
    assert speed == Speed(lines=4, window=(25, 125), tokens_per_second=375_000, mfu=0.31, losses=speed.losses)
    assert speed.losses == [9.12, 8.9, 8.5, 8.3, 8.1]
    assert update_shape(LOG) == "1 x 25,000 tokens"
    assert figures(speed, update_shape(LOG)) == (
        "375,000 tgt tok/s, MFU 31.0% (median of 4 lines, updates 25-125; 1 x 25,000 tokens, vocab 37,000)"
    )
    compiled = speed._replace(tokens_per_second=750_000)
    assert figures(compiled, "1 x 25,000 tokens", eager=speed).endswith("; 2.00x eager")


def test_progress_speed_without_a_known_peak_or_enough_lines():
    no_peak = "\n".join(line.replace(", MFU 1.0%", "") for line in LOG.splitlines())  # one line names no MFU
    assert progress_speed(no_peak, warmup_lines=0).mfu is None
    with pytest.raises(ValueError, match="5 progress lines in the log: none left after the 5 of warm-up"):
        progress_speed(LOG, warmup_lines=5)
    assert update_shape("no such line") == "update shape not logged"


def test_trainer_command_is_the_base_recipe_with_auto_batches(tmp_path):
    eager = trainer_command(tmp_path / "corpus", tmp_path / "cache", tmp_path / "run", compiled=False)
    assert eager[:3] == [sys.executable, "-m", "transformer_mt.train"]
    for override in (
        "experiment=base",
        "data=text",
        f"data.path={tmp_path / 'corpus'}",
        "data.max_tokens=auto",
        "data.tokens_per_update=25000",
        "trainer.compile=false",
        "trainer.max_steps=200",
        "trainer.num_sanity_val_steps=0",
        "final.enabled=false",
        "logger=csv",
        f"hydra.run.dir={tmp_path / 'run'}",
    ):
        assert override in eager
    compiled = trainer_command(tmp_path, tmp_path, tmp_path, compiled=True, extra={"trainer.max_steps": 8, "seed": 1})
    assert "trainer.compile=true" in compiled and compiled[-1] == "seed=1"
    assert [a for a in compiled if a.startswith("trainer.max_steps=")] == ["trainer.max_steps=8"]  # replaced, once


def test_made_up_corpus_is_aligned_and_repeatable(tmp_path):
    made_up_corpus(tmp_path / "a", pairs=300, words=500, held_out=20, longest=30)
    made_up_corpus(tmp_path / "b", pairs=300, words=500, held_out=20, longest=30)
    for prefix, n in (("train", 300), ("valid", 20), ("test", 20)):
        en, de = ((tmp_path / "a" / f"{prefix}.{lang}").read_text().split("\n")[:-1] for lang in ("en", "de"))
        assert len(en) == len(de) == n
        assert all(len(e.split()) == len(d.split()) and 2 <= len(e.split()) <= 31 for e, d in zip(en, de))
    for name in ("train.en", "test.de"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_made_up_multi30k_is_read_by_data_multi30k_where_the_real_one_is_absent(tmp_path):
    """test_cuda_runs' stand-in for ../shared/data/multi30k on a GPU machine given the repository alone."""
    corpus = made_up_corpus(tmp_path / "m", 300, words=500, held_out=20, longest=10, median=6, layout=MULTI30K_LAYOUT)
    cfg = compose("train", ["experiment=multi30k", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}"])
    data = TranslationDataModule(**{**OmegaConf.to_container(cfg.data, resolve=True), "vocab_size": 300})
    data.build()
    assert {split: len(data.splits[split]) for split in data.splits} == {"train": 300, "validation": 20, "test": 20}


@pytest.mark.slow
def test_the_base_recipe_command_trains_on_the_cpu_and_its_log_gives_the_speed(tmp_path):
    """trainer_command as the cuda test runs it, with a tiny model on the CPU: the overrides compose, the run ends,
    and its real progress lines parse."""
    corpus = made_up_corpus(tmp_path / "corpus", pairs=1000, words=1000, held_out=50, longest=20)
    tiny = {f"model.{key}": value for key, value in TINY_SHAPE.items()}
    extra = {
        "trainer.accelerator": "cpu",
        "trainer.precision": "32-true",
        "data.vocab_size": 400,
        "data.tokens_per_update": 1000,
        "data.num_workers": 0,
        "trainer.max_steps": 6,
        "progress_every_n_updates": 2,
        **tiny,
        "model.max_positions": 256,
    }
    command = trainer_command(corpus, tmp_path / "cache", tmp_path / "run", compiled=False, extra=extra)
    proc = run_process(command, tmp_path, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    log = (tmp_path / "run" / "train.log").read_text(encoding="utf-8")
    speed = progress_speed(log, warmup_lines=1)
    assert speed.lines == 2 and speed.window == (2, 6) and speed.tokens_per_second > 0
    assert speed.mfu is None  # a CPU's lines name no peak (a GPU's MFU is parsed in the tests above)
    # the update of 1,000 tokens; on a CPU, data.max_tokens=auto times 1,000, 500 and 250 and takes the fastest
    micro_batches, tokens = (int(n) for n in re.fullmatch(r"(\d+) x (\d+) tokens", update_shape(log)).groups())
    assert len(speed.losses) == 3 and micro_batches * tokens == 1000


# ---------------------------------------------------------------- tests/test_cuda_runs.py: two ranks on one GPU


def test_two_ranks_on_two_gpus_are_lightnings_own_launch():
    command = [sys.executable, "-m", "transformer_mt.train", "experiment=multi30k", "trainer.max_steps=20"]
    assert two_rank_launch(command, "fsdp", gpus=4, port=1234) == [
        ([*command, "trainer=fsdp", "trainer.devices=4"], {})
    ]


def test_two_ranks_on_one_gpu_are_two_one_gpu_nodes_over_gloo():
    command = [sys.executable, "-m", "transformer_mt.train", "experiment=multi30k", "trainer.max_steps=20"]
    launch = two_rank_launch(command, "ddp", gpus=1, port=1234)
    overrides = [
        "experiment=multi30k",
        "trainer.max_steps=20",
        "trainer=ddp",
        "trainer.devices=1",
        "trainer.num_nodes=2",
    ]
    assert [process[0] for process in launch] == [[sys.executable, "-c", GLOO_TRAIN, *overrides]] * 2
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "LOCAL_RANK": "0"}  # LOCAL_RANK 0: cuda:0 each
    assert [process[1] for process in launch] == [
        {**common, "NODE_RANK": "0", "RANK": "0"},
        {**common, "NODE_RANK": "1", "RANK": "1"},
    ]


def test_the_gloo_entry_point_makes_gloo_every_strategys_default(monkeypatch):
    """GLOO_TRAIN's patch, run here with the entry point replaced: DDP and trainer=fsdp's strategy choose gloo,
    and a backend given explicitly still wins."""
    monkeypatch.setattr(DDPStrategy, "__init__", DDPStrategy.__init__)  # undone after the test
    monkeypatch.setattr("runpy.run_module", lambda *args, **kwargs: None)
    exec(GLOO_TRAIN, {})
    assert DDPStrategy(broadcast_buffers=False).process_group_backend == "gloo"
    assert LayerFSDP().process_group_backend == "gloo"
    assert DDPStrategy(process_group_backend="nccl").process_group_backend == "nccl"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_on_one_gpu_each_process_of_the_launch_is_its_rank_on_cuda_0_over_gloo(strategy, monkeypatch):
    """The Trainer that train.py builds in each process of the one-GPU launch, on a machine faked to have one GPU:
    Lightning's own cluster environment, device cuda:0, the process's rank of 2, and gloo (NCCL without GLOO_TRAIN,
    which would refuse a second rank on the same device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(transformer_mt.training.fit, "use_tf32", lambda: None)  # no global switch from a test
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)  # each Trainer sets it; restored after
    monkeypatch.setattr(DDPStrategy, "__init__", DDPStrategy.__init__)  # GLOO_TRAIN's patch, undone after
    monkeypatch.setattr("runpy.run_module", lambda *args, **kwargs: None)  # GLOO_TRAIN without the entry point

    def trainer(command: list[str]) -> L.Trainer:
        overrides = compose("train", command[command.index(GLOO_TRAIN) + 1 :]).trainer
        return L.Trainer(**trainer_arguments(overrides), logger=False, enable_checkpointing=False)

    launch = two_rank_launch([sys.executable, "-m", "transformer_mt.train", "experiment=multi30k"], strategy, 1, 1234)
    for rank, (command, env) in enumerate(launch):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        if rank == 0:
            assert trainer(command).strategy._get_process_group_backend() == "nccl"  # Lightning's choice for CUDA
            exec(GLOO_TRAIN, {})
        built = trainer(command).strategy
        assert isinstance(built, LayerFSDP if strategy == "fsdp" else DDPStrategy)
        assert isinstance(built.cluster_environment, LightningEnvironment)  # started outside: LOCAL_RANK is set
        assert (built.root_device, built.global_rank, built.world_size) == (torch.device("cuda", 0), rank, 2)
        assert built._get_process_group_backend() == "gloo"


@pytest.mark.slow
def test_the_one_gpu_launch_trains_two_ranks_on_the_cpu(tmp_path):
    """two_rank_launch's one-GPU processes (trainer=ddp; fsdp's are the same processes) with the accelerator switched
    to the CPU: two ranks of one run (rank 1 reads rank 0's data caches), over gloo, one checkpoint."""
    corpus = write_corpus(tmp_path / "corpus")
    overrides = [a for a in TINY_RUN if not a.startswith("trainer=")]  # the launch chooses the trainer
    command = [
        sys.executable,
        "-m",
        "transformer_mt.train",
        *overrides,
        f"data.path={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
    ]
    run_ranks(two_rank_launch(command, "ddp", gpus=1, port=free_port()), cwd=tmp_path, timeout=240)
    log = (tmp_path / "run" / "train.log").read_text(encoding="utf-8")
    assert "distributed_backend=gloo" in log and "Starting with 2 processes" in log
    assert "rank 1: reading the data caches that rank 0 builds" in log
    assert "validation at update 4:" in log and (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
