"""scripts/gpu_check.py (`make gpu-check`) here, without a GPU: the one-line answer, JUnit -> table, the exit rule."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT

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
<testcase classname="tests.test_cuda_runs" name="test_two_gpu_training_then_translate[fsdp]" time="0.001">
  <skipped type="pytest.skip" message="needs &gt;= 2 GPUs: on one GPU FSDP silently becomes NO_SHARD">\
tests/test_cuda_runs.py:150: needs &gt;= 2 GPUs: on one GPU FSDP silently becomes NO_SHARD</skipped>
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
        "test_two_gpu_training_then_translate[fsdp]",
        "SKIP",
        "needs >= 2 GPUs: on one GPU FSDP silently becomes NO_SHARD",
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
