"""Does every GPU path work on this machine? The test suite's tests marked `cuda` (tests/test_cuda*.py), then one
summary table of their results and key figures. At most ~8 minutes on one GPU.

  make gpu-check                          # python scripts/gpu_check.py
  make gpu-check ARGS="--multi30k DIR"    # Multi30k's text files (default: ../shared/data/multi30k, else skipped)

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
    return "\n".join([*lines, "", f"gpu-check: {counts} in {seconds:.0f} s"])


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
