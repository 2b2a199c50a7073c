"""A training run's resident host memory over its updates: is it flat after warm-up, and how high is its peak?

  python scripts/memory_report.py experiment=multi30k trainer.max_steps=1000 logger=csv
  TRANSFORMER_MT_MALLOC=system python scripts/memory_report.py ...   # glibc's own malloc settings

Runs `python -m transformer_mt.train` with the given Hydra overrides (plus a progress line every
--every updates) and samples the resident memory (Linux: /proc, VmRSS) of its process and of every process
it started (data-loader workers) several times a second. At each progress line it prints the update, the
training process's resident memory, the whole tree's, and the peak so far; at the end the growth per 100
updates after the warm-up (a least-squares line through the samples from --warmup on), the peak, the
allocator setting and the run's median target tok/s. Writes memory.csv into the run folder.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path

PROGRESS = re.compile(r"\bupdate ([\d,]+)(?:/[\d,]+)?\b.*?\| ([\d,]+) target tok/s")
RUN_DIR = re.compile(r"run directory: (\S+)")


def resident_mib(pid: int) -> float:
    """VmRSS of one process in MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0.0


def descendants(pid: int) -> list[int]:
    """pid and every process below it, from /proc/<pid>/task/*/children."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                todo += [int(child) for child in task.read_text().split()]
    return found


class Sampler(threading.Thread):
    """Samples the training process's and its tree's resident memory every `interval` seconds."""

    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        self.pid, self.interval, self.stop = pid, interval, threading.Event()
        self.main = self.tree = self.peak = 0.0

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.main = resident_mib(self.pid)
            self.tree = sum(resident_mib(pid) for pid in descendants(self.pid))
            self.peak = max(self.peak, self.tree)


def slope_per_100(points: list[tuple[int, float]]) -> float | None:
    """Least-squares growth in MiB per 100 updates of (update, MiB) points."""
    if len(points) < 2:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return 100 * sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=50, help="updates per progress line (and per row)")
    parser.add_argument("--warmup", type=int, default=200, help="updates left out of the growth's fit")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between memory samples")
    args, overrides = parser.parse_known_args()
    command = [sys.executable, "-m", "transformer_mt.train", *overrides, f"progress_every_n_updates={args.every}"]
    command.append("progress_every_seconds=0")  # a row every --every updates, none between
    allocator = os.environ.get("TRANSFORMER_MT_MALLOC", "shipped (runtime.keep_freed_memory)")
    print(f"$ {' '.join(command[1:])}\nallocator: {allocator}", flush=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid, args.interval)
    sampler.start()
    rows, rates, run_dir = [], [], None
    print(f"{'update':>8s}  {'train MiB':>10s}  {'tree MiB':>9s}  {'peak MiB':>9s}", flush=True)
    for line in proc.stdout:
        if match := RUN_DIR.search(line):
            run_dir = Path(match.group(1))
        if match := PROGRESS.search(line):
            update = int(match.group(1).replace(",", ""))
            rates.append(float(match.group(2).replace(",", "")))
            rows.append((update, round(sampler.main, 1), round(sampler.tree, 1), round(sampler.peak, 1)))
            print(f"{update:8,d}  {rows[-1][1]:10,.1f}  {rows[-1][2]:9,.1f}  {rows[-1][3]:9,.1f}", flush=True)
        elif "error" in line.lower() or "Traceback" in line:
            print(line, end="", flush=True)
    status = proc.wait()
    sampler.stop.set()
    after = [(update, tree) for update, _, tree, _ in rows if update >= args.warmup]
    growth = slope_per_100(after)
    fit = f"{growth:+,.1f} MiB per 100 updates (the tree's, least squares over {len(after)} rows)"
    print(
        f"after update {args.warmup:,}: "
        + (fit if growth is not None else "too few rows for a growth")
        + f"; peak {sampler.peak:,.0f} MiB; median {statistics.median(rates) if rates else 0:,.0f} target tok/s; "
        f"allocator: {allocator}; exit status {status}"
    )
    if run_dir is not None and run_dir.is_dir():
        with open(run_dir / "memory.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["update", "train_mib", "tree_mib", "peak_mib"])
            writer.writerows(rows)
        print(f"wrote {run_dir / 'memory.csv'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
