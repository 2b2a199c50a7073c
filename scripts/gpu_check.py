"""Does every GPU path work on this machine, and how fast does the base recipe train on it? The test suite's tests
marked `cuda` (tests/test_cuda*.py), then one summary table of their results and key figures, and under it the base
model's target tok/s and MFU three ways, side by side: the raw loop (tests/test_cuda_kernels.py: a bare PyTorch
update, no Lightning, no loader, one wait per update: an upper bound), then `experiment=base` through the real entry
point, `python -m transformer_mt.train`, 200 updates with trainer.compile=false and 200 with true (tests/
test_cuda_trainer.py: the median of the run log's progress lines after the warm-up). The multi-rank tests run with
2 ranks on any machine: on 2 or more GPUs over NCCL, on one GPU both ranks on it over gloo. Under them, the waits
for the device of each update of a short real run, counted by CUDA (torch.cuda.set_sync_debug_mode): one each.

  make gpu-check                          # python scripts/gpu_check.py
  make gpu-check ARGS="--multi30k DIR"    # Multi30k's text files (default: ../shared/data/multi30k, else skipped)

Estimated duration on one H200, ~7 minutes (not yet measured on a GPU; the table gives each test's seconds; the
host-side pieces were timed on 2 cores of an AMD EPYC, the GPU machine has 16). Nothing needs more than the
repository: without Multi30k's files the Multi30k tests train on a made-up corpus in its layout and size.
- tests/test_cuda.py and test_cuda_kernels.py ~1.75 min: small models, SDPA kernels, the auto batch probe (~20 sizes,
  a forward and backward each) twice, the base model's raw loop at the shape the probe gives (13 updates of 25,000
  tokens), the whole-run waits test;
- test_cuda_runs.py ~2.75 min: Multi30k (or the made-up corpus: written in 1 s, SentencePiece and tokenization
  3 s), 150 updates and a validation ~0.6 min; beam search on the GPU and the CPU, TF32 decoding ~0.5 min (100
  sentences of beam 4 take 5 s on 2 CPU cores); DDP and FSDP on 2 ranks, each then translate, ~1.5 min;
- test_cuda_trainer.py ~2.5 min: the made-up corpus and its SentencePiece at the recipe's 37,000 pieces 10 s (7 s on
  2 cores); a process's start to its first update ~10 s plus CUDA's context; eager ~0.6 min; compiled ~1.75 min,
  most of it the compile (the base model's first compiled update took 115 s on 2 CPU cores with inductor's C++
  backend; Triton on 16 cores should not be slower).

Without a CUDA GPU it says so in one line and exits 0. The exit status is 1 if a test failed (or pytest did).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

import lightning
import torch

ROOT = Path(__file__).resolve().parents[1]
MULTI30K_ENV = "TRANSFORMER_MT_MULTI30K"  # read by tests/test_cuda_runs.py
# -rA: the passing tests' printed details (the SDPA table, the training update's figures) after the run
PYTEST = ["-m", "pytest", "-m", "cuda", "tests/", "-p", "no:cacheprovider", "-rA"]


# The base model's speed three ways: JUnit's test name (with its parameter) -> its label in speed_block.
SPEED_ROWS = {
    "test_bf16_training_update_of_the_base_model": "raw loop, no Lightning",
    "test_base_recipe_trains_through_the_trainer[eager]": "Trainer, eager",
    "test_base_recipe_trains_through_the_trainer[compiled]": "Trainer, compiled",
    "test_a_whole_training_run_on_the_gpu_waits_for_it_once_per_update": "Trainer, host waits",
}


class Row(NamedTuple):
    test: str
    result: str  # PASS, FAIL or SKIP
    figures: str  # the test's key figures; for a failure or a skip, its message
    seconds: float


def junit_rows(xml_text: str) -> list[Row]:
    """pytest's JUnit XML -> one row per test, in run order.

    A passing test's figures are its record_property("figures", ...); a failure's or skip's first message line
    stands in for them. An error in teardown comes as a second <testcase> of the same name: the test FAILs.
    """
    rows: dict[tuple[str, str], Row] = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        problem = next((case.find(tag) for tag in ("failure", "error") if case.find(tag) is not None), None)
        skipped = case.find("skipped")
        if problem is not None:
            result, text = "FAIL", problem.get("message", "")
        elif skipped is not None:
            result, text = "SKIP", skipped.get("message", "")
        else:
            result = "PASS"
            text = "; ".join(p.get("value", "") for p in case.iter("property") if p.get("name") == "figures")
        text = (text.strip().splitlines() or [""])[0][:160]
        seconds = float(case.get("time", 0))
        if key in rows:  # the same test's teardown
            before = rows[key]
            if before.result == "FAIL" or result != "FAIL":
                result, text = before.result, before.figures
            seconds += before.seconds
        rows[key] = Row(key[1], result, text, seconds)
    return list(rows.values())


def summary(rows: list[Row], seconds: float) -> str:
    """The table (test, result, key figures, seconds) and a last line with the counts."""
    name_width = max([4, *(len(row.test) for row in rows)])
    figures_width = max([11, *(len(row.figures) for row in rows)])
    lines = [f"{'test':{name_width}s}  result  {'key figures':{figures_width}s}  seconds"]
    for row in rows:
        lines.append(f"{row.test:{name_width}s}  {row.result:6s}  {row.figures:{figures_width}s}  {row.seconds:7.1f}")
    results = [row.result for row in rows]
    counts = f"{results.count('PASS')} passed, {results.count('FAIL')} failed, {results.count('SKIP')} skipped"
    return "\n".join([*lines, *speed_block(rows), "", f"gpu-check: {counts} in {seconds:.0f} s"])


def speed_block(rows: list[Row]) -> list[str]:
    """The base model's target tok/s and MFU, raw loop then Trainer eager and compiled, one under the other (a
    failure's or skip's message in place of its figures); nothing unless at least two of them ran."""
    found = {row.test: row for row in rows if row.test in SPEED_ROWS}
    if len(found) < 2:
        return []
    width = max(len(label) for label in SPEED_ROWS.values())
    lines = ["", "the base model's speed (vocabulary 37,000, 25,000 tokens per update): a bare loop beside real runs:"]
    for test, label in SPEED_ROWS.items():
        if test in found:
            row = found[test]
            lines.append(
                f"  {label:{width}s}  {row.figures if row.result == 'PASS' else f'{row.result}: {row.figures}'}"
            )
    return lines


def exit_status(rows: list[Row], pytest_status: int) -> int:
    """1 if a test failed, or if pytest did not run them all (collection error, interrupt, no test collected)."""
    return 1 if pytest_status != 0 or any(row.result == "FAIL" for row in rows) else 0


def header() -> str:
    props = torch.cuda.get_device_properties(0)
    return (
        f"PyTorch {torch.__version__}, Lightning {lightning.__version__}, Python {platform.python_version()}; "
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; device: {props.name} "
        f"(sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB); "
        f"{torch.cuda.device_count()} GPU(s) visible"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--multi30k", type=Path, help="Multi30k's text files (default: ../shared/data/multi30k)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU is visible (PyTorch {torch.__version__}), so nothing was checked")
        return 0
    env = dict(os.environ)
    if args.multi30k:
        if not args.multi30k.is_dir():
            parser.error(f"--multi30k {args.multi30k}: no such directory")
        env[MULTI30K_ENV] = str(args.multi30k.resolve())
    print(header(), flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        junit = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        status = subprocess.run([sys.executable, *PYTEST, f"--junitxml={junit}"], cwd=ROOT, env=env).returncode
        seconds = time.perf_counter() - start
        rows = junit_rows(junit.read_text(encoding="utf-8")) if junit.is_file() else []
    print("\n" + summary(rows, seconds))
    return exit_status(rows, status)


if __name__ == "__main__":
    sys.exit(main())
