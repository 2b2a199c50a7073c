"""Time and peak memory of each stage of the data pipeline, as training runs it, cold and then cached.

  python scripts/scale_report.py data=wmt14 data.path=/data/wmt14-scale data.cache_dir=/tmp/empty-cache

Takes the same Hydra overrides as training. Runs two passes, each in a fresh process so that its
memory is its own: the first builds whatever data.cache_dir lacks (SentencePiece, tokenized splits),
the second finds it all cached. For a truly cold first pass, point data.cache_dir and HF_DATASETS_CACHE
(where `datasets` keeps its Arrow copy of Parquet/JSON files) at empty folders. Peak memory is the
process's peak resident set size during the stage (Linux: /proc/self/status, reset per stage).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from transformer_mt.configs import CONF_DIR
from transformer_mt.data.corpus import SPLITS
from transformer_mt.data.datamodule import TranslationDataModule

PASS_ENV = "SCALE_REPORT_PASS"  # set in the child processes: the pass that one measures


def reset_peak_memory() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set size


def memory_gib(field: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) / 2**20


def peak_memory_gib() -> float:
    return memory_gib("VmHWM")


def resident_memory_gib() -> float:
    return memory_gib("VmRSS")


class Stopwatch:
    """Seconds per part, summed over its calls (`with watch("tokenizing"): ...`): the data cache's `watch`."""

    def __init__(self):
        self.seconds: Counter = Counter()

    @contextmanager
    def __call__(self, part: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - start


def measure_pass(cfg: DictConfig) -> dict:
    """Every stage of TranslationDataModule.build() (through its `stage` hook) and of the first training
    batch, each timed with its own peak memory."""
    stages = []
    dm = TranslationDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    dm.cache.watch = watch = Stopwatch()

    @contextmanager
    def stage(name: str):
        reset_peak_memory()
        before, start = dict(watch.seconds), time.perf_counter()
        yield
        row = {"stage": name, "seconds": time.perf_counter() - start, "peak_gib": peak_memory_gib()}
        if name.endswith(": tokenized"):  # where a cold split's time went: reading, cleaning, tokenizing, writing
            row["parts"] = {k: v - before.get(k, 0.0) for k, v in watch.seconds.items()}
        stages.append(row)

    dm.build(stage=stage)
    with stage("one epoch of training batches"):
        loader = dm.train_dataloader()
        n_batches = len(dm.train_sampler)  # the epoch's batches are made on first use
    with stage("first training batch (loader workers start)"):
        batch = next(iter(loader))
    train = dm.splits["train"]
    cache_bytes = sum(f.stat().st_size for f in dm.cache_dir.rglob("*") if f.is_file())
    return {
        "stages": stages,
        "first_batch_at": time.time(),
        "pairs": {split: len(dm.splits[split]) for split in SPLITS},
        "tokens": int(train.src_lens.sum() + train.tgt_lens.sum()),
        "vocabulary": len(dm.tokenizer),
        "batches": n_batches,
        "batch_shape": list(batch["src"].shape),
        "cache_gib": cache_bytes / 2**30,
        "peak_gib": peak_memory_gib(),
    }


def run_pass(name: str) -> tuple[dict, float]:
    """One pass in a child process; returns its figures and the seconds from launch to its first batch."""
    launched = time.time()
    child = subprocess.run(
        [sys.executable, __file__, *sys.argv[1:]],
        env={**os.environ, PASS_ENV: name},
        stdout=subprocess.PIPE,
        check=True,
        text=True,
    )
    figures = json.loads(child.stdout.strip().splitlines()[-1])
    return figures, figures["first_batch_at"] - launched


def batch_tokens(data: DictConfig) -> str:
    """data.max_tokens for a person; auto (measured on a GPU when training starts) as its CPU fallback, which
    this report's batches use."""
    return f"{data.max_tokens_fallback if data.max_tokens == 'auto' else data.max_tokens:,}"


def report(cfg: DictConfig) -> None:
    passes = {name: run_pass(name) for name in ("first", "second")}
    first = passes["first"][0]
    print(
        f"\ndata: {cfg.data.name} from {cfg.data.path or cfg.data.hub_name}: "
        + ", ".join(f"{split} {n:,}" for split, n in first["pairs"].items())
        + f" pairs kept; {first['tokens']:,} training tokens (both sides); vocabulary {first['vocabulary']:,}; "
        f"{first['batches']:,} batches of <= {batch_tokens(cfg.data)} tokens per epoch; "
        f"cache {first['cache_gib']:.2f} GiB; {os.cpu_count()} CPU cores\n"
    )
    for name, (figures, to_first_batch) in passes.items():
        print(f"{name} pass{'' if name == 'first' else ' (caches present)'}:")
        print(f"  {'stage':<48} {'seconds':>9} {'peak RSS GiB':>13}")
        for row in figures["stages"]:
            print(f"  {row['stage']:<48} {row['seconds']:>9.1f} {row['peak_gib']:>13.2f}")
            for part, seconds in row.get("parts", {}).items() if row["seconds"] >= 1 else ():
                print(f"    {part:<46} {seconds:>9.1f}")
        print(
            f"  launch to first training batch: {to_first_batch:.1f} s (imports included); "
            f"peak RSS over the pass: {max(r['peak_gib'] for r in figures['stages']):.2f} GiB\n"
        )


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if os.environ.get(PASS_ENV):
        print(json.dumps(measure_pass(cfg)))
    else:
        report(cfg)


if __name__ == "__main__":
    main()
