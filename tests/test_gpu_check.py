"""scripts/gpu_check.py (`make gpu-check`) without a GPU: the one-line answer, and every check's code on the CPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, synthetic_corpus, write_pair

SCRIPT = ROOT / "scripts" / "gpu_check.py"
CPU_ONLY = ["cuda tests", "fsdp + translate", "sdpa kernels"]  # skipped with --device cpu
RUN_ON_CPU = ["training step", "multi30k training", "ddp + translate", "beam gpu = cpu"]


def gpu_check(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "TRANSFORMER_MT_CACHE": str(tmp_path / "cache"),
        "TMPDIR": str(tmp_path),  # where the script's work folder goes (and must be gone from afterwards)
        "OMP_NUM_THREADS": "1",  # tiny models: one thread, which a busy machine cannot stall at OpenMP barriers
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )


def summary(stdout: str) -> dict[str, tuple[str, str]]:
    """The summary table at the end of the output: check name -> (PASS/FAIL/SKIP, key figures)."""
    table = stdout[stdout.rindex("\ncheck ") + 1 :].splitlines()
    assert re.match(r"check +result +key figures +seconds$", table[0]), table[0]
    rows = {}
    for line in table[1:]:
        if not line.strip():
            break
        name, status, figures, seconds = re.match(r"(.+?) {2,}(PASS|FAIL|SKIP) {2,}(.*?) +(\d+\.\d)$", line).groups()
        rows[name] = (status, figures)
    return rows


def multi30k_layout(root: Path, n_train: int = 3000) -> Path:
    """Synthetic text under Multi30k's file names (train, val, test_2016_flickr), as --multi30k takes them."""
    en, de = synthetic_corpus(n_train + 60)
    write_pair(root, "train", en[:n_train], de[:n_train])  # 3,000 pairs: 30 updates stay within one epoch
    write_pair(root, "val", en[n_train : n_train + 30], de[n_train : n_train + 30])
    write_pair(root, "test_2016_flickr", en[n_train + 30 :], de[n_train + 30 :])
    return root


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the checks would run")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    proc = gpu_check([], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.splitlines()
    assert "no CUDA GPU" in line and "nothing was checked" in line and "--device cpu" in line
    assert not list(tmp_path.glob("gpu-check-*")) and not (tmp_path / "cache").exists()  # nothing ran


def test_cpu_plumbing_mode_runs_every_check_that_can_run_on_a_cpu(tmp_path):
    proc = gpu_check(
        ["--device", "cpu", "--multi30k", str(multi30k_layout(tmp_path / "m30k")), "--updates", "30", "--steps", "2"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "plumbing mode" in proc.stdout.splitlines()[0]  # the header: versions and device
    rows = summary(proc.stdout)
    assert list(rows) == [
        "cuda tests",
        "training step",
        "multi30k training",
        "ddp + translate",
        "fsdp + translate",
        "beam gpu = cpu",
        "sdpa kernels",
    ]
    assert {name: rows[name][0] for name in RUN_ON_CPU} == dict.fromkeys(RUN_ON_CPU, "PASS"), rows
    assert {name: rows[name][0] for name in CPU_ONLY} == dict.fromkeys(CPU_ONLY, "SKIP"), rows
    assert rows["cuda tests"][1] == "needs a CUDA GPU"
    assert re.match(r"[\d,]+ tgt tok/s, peak unknown, \d+\.\d GiB$", rows["training step"][1])
    first, last = map(
        float, re.match(r"loss (\d+\.\d+) -> (\d+\.\d+) in 30 updates", rows["multi30k training"][1]).groups()
    )
    assert last < 0.85 * first
    assert rows["ddp + translate"][1] == "20 updates; 5/5 lines translated"
    assert rows["beam gpu = cpu"][1] == "8/8 identical (cpu vs cpu: plumbing)"  # decoded check 3's checkpoint
    assert "check 3's checkpoint, test_2016_flickr.en" in proc.stdout
    assert re.search(r"\ngpu-check: 4 passed, 0 failed, 3 skipped in \d+ s\n$", proc.stdout)  # the last line
    work = Path(re.search(r"work folder (\S+)", proc.stdout)[1])
    assert work.parent == tmp_path and not work.exists()  # the runs' folders are removed


def test_a_failing_check_is_reported_and_the_others_still_run(tmp_path):
    proc = gpu_check(
        ["--device", "cpu", "--multi30k", str(tmp_path / "missing"), "--updates", "4", "--steps", "1"], tmp_path
    )
    assert proc.returncode == 1, proc.stdout[-5000:] + proc.stderr[-3000:]
    rows = summary(proc.stdout)
    assert rows["multi30k training"][0] == rows["ddp + translate"][0] == "FAIL"
    # the training entry point's own one-line error names the missing folder
    assert (
        rows["multi30k training"][1].startswith("exit status 1: error: ") and "missing" in rows["multi30k training"][1]
    )
    assert rows["training step"][0] == "PASS"
    assert rows["beam gpu = cpu"][0] == "PASS"  # without check 3's checkpoint: random weights
    assert "random weights (no checkpoint from check 3)" in proc.stdout
    assert "gpu-check: 2 passed, 2 failed, 3 skipped" in proc.stdout
