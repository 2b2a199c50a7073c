"""What a real run of the base recipe does on this GPU: `experiment=base` through `python -m transformer_mt.train`
(the Lightning Trainer, the loader, the callbacks and loggers of a run), eager and with trainer.compile=true, on a
made-up corpus; the progress lines' target tok/s and MFU, for `make gpu-check`'s table beside the raw loop's
(tests/test_cuda_kernels.py::test_bf16_training_update_of_the_base_model: no Lightning, no loader).

Budget on one H200, both tests, ~2.5 min (estimated, not yet measured on a GPU; host-side pieces timed on 2 cores of
an AMD EPYC):
- data, once (the compiled run reads the eager run's cache): the corpus written 2.5 s; SentencePiece (vocab 37,000,
  100,000 sampled sentences) and the text converted to Arrow and tokenized 7.1 s on 2 CPU cores;
- each run's start and end: imports and Hydra to the training loop ~6 s, CUDA's context ~5 s, data.max_tokens=auto's
  probe (a forward and backward of the longest pair, ~20 sizes) ~10 s, last.ckpt (~750 MB) ~5 s;
- eager: 200 updates of 25,000 padded tokens per side (~21,000 real target tokens) at a projected 300,000-1M
  target tok/s, 5-15 s: ~0.6 min with its start;
- compiled: the compile of the loss and its backward (dynamic shapes), with a recompile or two as batch shapes
  vary, ~1-1.5 min (the warm-up lines, left out of the median; on 2 CPU cores with inductor's C++ backend the
  first compiled update of the base model took 115 s), then the same updates: ~1.75 min with its start.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from conftest import run_process

pytestmark = pytest.mark.cuda

VOCAB = 37000  # the recipe's (WMT14's shared SentencePiece): the loss's traffic grows with it; SentencePiece: 7 s
PAIRS = 100_000  # ~3.3M target tokens: 200 updates see each pair about 1.3 times
UPDATES = 200
EVERY = 25  # updates per progress line: 8 lines
WARMUP_LINES = 2  # left out of the median: the compile, its recompiles for new shapes, the allocator growing
TIMEOUT = {"eager": 300, "compiled": 420}  # seconds per run, well above the estimates


TEXT_LAYOUT = {"train": "train", "valid": "valid", "test": "test"}  # data=text's file names
MULTI30K_LAYOUT = {"train": "train", "valid": "val", "test": "test_2016_flickr"}  # data=multi30k's


def made_up_corpus(
    root: Path,
    pairs: int,
    seed: int = 0,
    words: int = 20_000,
    held_out: int = 500,
    longest: int = 100,
    median: int = 15,
    layout: dict[str, str] = TEXT_LAYOUT,
) -> Path:
    """train/valid/test.{en,de} under root (or `layout`'s names for them), as `data=text` reads them: made-up words
    (2-10 random letters) drawn by Zipf's law from `words` per language, sentence lengths like news text (lognormal,
    `median` words, at most `longest`); the German side translates word for word. ~19 SentencePiece tokens per
    sentence at a vocabulary of 37,000 (a word is mostly one piece)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def lexicon() -> np.ndarray:
        return np.array(["".join(rng.choice(letters, n)) for n in rng.integers(2, 11, words)], dtype=object)

    english, german = lexicon(), lexicon()
    zipf = 1 / np.arange(1, words + 1)
    lengths = np.clip(np.rint(rng.lognormal(math.log(median), 0.6, pairs + 2 * held_out)), 1, longest).astype(int)
    ids = rng.choice(words, size=int(lengths.sum()), p=zipf / zipf.sum())
    ends = np.cumsum(lengths)
    splits = {"train": slice(0, pairs), "valid": slice(pairs, pairs + held_out), "test": slice(pairs + held_out, None)}
    root.mkdir(parents=True, exist_ok=True)
    for lang, lexicon_ in (("en", english), ("de", german)):
        sentences = [" ".join(lexicon_[ids[end - n : end]]) + " ." for n, end in zip(lengths, ends)]
        for split, rows in splits.items():
            (root / f"{layout[split]}.{lang}").write_text("".join(s + "\n" for s in sentences[rows]), encoding="utf-8")
    return root


def trainer_command(
    corpus: Path, cache_dir: Path, run_dir: Path, compiled: bool, extra: dict[str, object] | None = None
) -> list[str]:
    """`python -m transformer_mt.train experiment=base` on the made-up corpus: WMT14's batching (25,000 tokens per
    update, data.max_tokens=auto: as few micro-batches as the GPU's memory allows), no validation (its interval,
    5,000 updates, is never reached; no sanity check), no end-of-run protocol, CSV logs. `extra` adds or replaces
    overrides (the CPU test of this command: a tiny model on the CPU)."""
    overrides = {
        "experiment": "base",
        "data": "text",
        "data.path": corpus,
        "data.cache_dir": cache_dir,
        "data.vocab_size": VOCAB,
        "data.spm_max_sentences": 100_000,
        "data.tokens_per_update": 25_000,  # conf/data/wmt14's, as the base recipe trains
        "data.max_len_ratio": 1.5,
        "data.num_workers": 2,
        "data.max_tokens": "auto",  # the recipe's (conf/experiment/base.yaml): the most the GPU's memory fits
        "trainer.compile": str(compiled).lower(),
        "trainer.max_steps": UPDATES,
        "trainer.num_sanity_val_steps": 0,
        "trainer.enable_progress_bar": "false",
        "progress_every_n_updates": EVERY,
        "progress_every_seconds": 0,  # lines every EVERY updates only (a compile's minutes would add one)
        "final.enabled": "false",
        "logger": "csv",  # the recipe's wandb is not reachable from a GPU machine without credentials
        "hydra.run.dir": run_dir,
        **(extra or {}),
    }
    return [sys.executable, "-m", "transformer_mt.train", *(f"{key}={value}" for key, value in overrides.items())]


PROGRESS_LINE = re.compile(r"\bupdate ([\d,]+)(?:/[\d,]+)?(?: \([^)]*\))? \|.*?\| ([\d,]+) target tok/s \|(.*)")
LOSS = re.compile(r"\| loss ([-+\w.]+) \|")
MFU = re.compile(r"MFU ([\d.]+)%")
UPDATE_SHAPE = re.compile(r"accumulation (\d+) x ([\d,]+) tokens")


class Speed(NamedTuple):
    lines: int  # progress lines in the median
    window: tuple[int, int]  # the updates they cover: (the update before the first, the last)
    tokens_per_second: float  # median target tok/s
    mfu: float | None  # median MFU (a fraction); None where the log names no peak for the device
    losses: list[float]  # of every progress line, warm-up included


def progress_speed(log: str, warmup_lines: int) -> Speed:
    """The medians of a run log's progress lines (ProgressLog.report: `update N/M (x%) | loss L | lr .. | 123,456
    target tok/s | 305 GFLOP/s, MFU 33.6% | elapsed .. | ETA ..`), leaving out the first `warmup_lines`."""
    lines = [match for match in map(PROGRESS_LINE.search, log.splitlines()) if match]
    if len(lines) <= warmup_lines:
        raise ValueError(f"{len(lines)} progress lines in the log: none left after the {warmup_lines} of warm-up")
    losses = [float(loss.group(1)) for line in lines if (loss := LOSS.search(line.group(0)))]
    measured = lines[warmup_lines:]
    mfus = [float(mfu.group(1)) / 100 for line in measured if (mfu := MFU.search(line.group(3)))]
    updates = [0] + [int(line.group(1).replace(",", "")) for line in lines]
    return Speed(
        lines=len(measured),
        window=(updates[warmup_lines], updates[-1]),
        tokens_per_second=statistics.median(float(line.group(2).replace(",", "")) for line in measured),
        mfu=statistics.median(mfus) if len(mfus) == len(measured) else None,
        losses=losses,
    )


def update_shape(log: str) -> str:
    """`7 x 3,572 tokens` from the log's line on the update's shape (micro-batches x tokens per micro-batch)."""
    match = UPDATE_SHAPE.search(log)
    return f"{match.group(1)} x {match.group(2)} tokens" if match else "update shape not logged"


def figures(speed: Speed, shape: str, eager: Speed | None = None) -> str:
    """The summary table's key figures: target tok/s and MFU (the raw loop's row states the same two)."""
    mfu = f"MFU {speed.mfu:.1%}" if speed.mfu is not None else "no MFU (no peak known)"
    text = (
        f"{speed.tokens_per_second:,.0f} tgt tok/s, {mfu} (median of {speed.lines} lines, updates "
        f"{speed.window[0]}-{speed.window[1]}; {shape}, vocab {VOCAB:,})"
    )
    return text + (f"; {speed.tokens_per_second / eager.tokens_per_second:.2f}x eager" if eager else "")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return made_up_corpus(tmp_path_factory.mktemp("made-up"), PAIRS)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """SentencePiece and the tokenized corpus: built by the first run, read by the second."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def speeds() -> dict[str, Speed]:
    """Each mode's result, for the compiled run's ratio to eager."""
    return {}


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """The run's data.max_tokens=auto probes the GPU's free memory: earlier tests' cached blocks go back first."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["eager", "compiled"])  # eager first: it builds the data cache
def test_base_recipe_trains_through_the_trainer(mode, corpus, cache_dir, speeds, tmp_path, record_property):
    run_dir = tmp_path / "run"
    command = trainer_command(corpus, cache_dir, run_dir, compiled=mode == "compiled")
    print("$ python " + " ".join(command[1:]), flush=True)
    proc = run_process(command, tmp_path, timeout=TIMEOUT[mode])
    if proc.returncode != 0:
        print("\n".join((proc.stdout + proc.stderr).rstrip().splitlines()[-30:]))
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), "")
        pytest.fail(f"{mode} run: exit status {proc.returncode}: {last.strip()[:160]}")
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    speed = progress_speed(log, WARMUP_LINES)
    speeds[mode] = speed
    shown = figures(speed, update_shape(log), speeds.get("eager") if mode == "compiled" else None)
    print("\n".join(line for line in log.splitlines() if PROGRESS_LINE.search(line) or "tokens per update" in line))
    record_property("figures", shown)
    assert speed.lines >= 3, shown
    assert all(math.isfinite(loss) for loss in speed.losses), speed.losses
    assert speed.losses[-1] < speed.losses[0], f"the loss did not fall: {speed.losses}"
