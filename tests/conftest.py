import csv
import io
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from transformer_mt.commandline import hydra_job
from transformer_mt.configs import CONF_DIR
from transformer_mt.data.batching import collate
from transformer_mt.model import CHOICES, Transformer, TransformerConfig
from transformer_mt.training.fit import train
from transformer_mt.translate import translate

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED_DATA = ROOT.parent / "shared" / "data"

# Under pytest-xdist (`make test-slow`: WORKERS tests at a time) each worker and every process it starts gets
# its share of the cores: 2 tests of 2 torch threads each on 2 cores wait on each other's spinning threads
# (the Multi30k test trained at a third of its speed beside another test), 1 thread each does not.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


# The one tiny shape of the tests, in-process models and training runs alike: 2+3 layers (an encoder
# and a decoder of different depths, so that a loop over the wrong stack shows), d=32, 4 heads.
TINY_SHAPE = dict(d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=3, max_positions=64)


def tiny_config(**overrides) -> TransformerConfig:
    """TINY_SHAPE with a 23-token vocabulary: every code path of the model, small enough for CPU tests."""
    return TransformerConfig(**{**TINY_SHAPE, "vocab_size": 23, "dropout": 0.1, "pad_id": 0, **overrides})


# The in-process Lightning tests' model (TranslationModule's `model`): 1+1 layers, d=16, 2 heads, 20 tokens, where
# TINY_SHAPE's size costs (compiles; an epoch of news-length batches, past TINY_SHAPE's 64 positions).
MICRO_SHAPE = dict(vocab_size=20, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, dropout=0.1)


def micro_batches(seed: int = 0) -> list[dict]:
    """6 micro-batches (2 updates of 3 at module.accumulation=3) of random sentences, targets 1 longer."""
    g, batches, index = torch.Generator().manual_seed(seed), [], 0
    for lengths in [[5, 3], [2, 7, 4], [6], [3, 3], [4, 2, 8], [5]]:
        items = []
        for n in lengths:
            src, tgt = (torch.randint(4, MICRO_SHAPE["vocab_size"], (m,), generator=g).numpy() for m in (n, n + 1))
            items.append((src, tgt, index))
            index += 1
        batches.append(collate(items))
    return batches


def quiet_trainer(**arguments) -> L.Trainer:
    """A Lightning Trainer on the CPU that writes nothing and prints nothing (no logger, checkpoints, progress
    bar or model summary); `arguments` add to or replace these."""
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**quiet, "accelerator": "cpu", **arguments})


@pytest.fixture
def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_config()).eval()


def random_batch(lengths: list[int], vocab_size: int, pad_id: int = 0, seed: int = 0) -> torch.Tensor:
    """Right-padded (B, max(lengths)) ids drawn from the non-pad tokens."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.full((len(lengths), max(lengths)), pad_id, dtype=torch.long)
    for row, n in enumerate(lengths):
        batch[row, :n] = torch.randint(pad_id + 1, vocab_size, (n,), generator=g)
    return batch


def write_pair(directory: Path, prefix: str, src: list[str], tgt: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{prefix}.en").write_text("".join(s + "\n" for s in src), encoding="utf-8")
    (directory / f"{prefix}.de").write_text("".join(t + "\n" for t in tgt), encoding="utf-8")


def synthetic_corpus(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Made-up aligned sentences of varying length (German side a word-for-word 'translation')."""
    rng = random.Random(seed)
    words = {
        "the": "die",
        "cat": "Katze",
        "dog": "Hund",
        "sees": "sieht",
        "a": "eine",
        "small": "kleine",
        "house": "Haus",
        "red": "rote",
        "runs": "läuft",
        "and": "und",
        "big": "große",
        "tree": "Baum",
    }
    en, de = [], []
    for _ in range(n):
        chosen = [rng.choice(list(words)) for _ in range(rng.randint(1, 20))]
        en.append(" ".join(chosen) + " .")
        de.append(" ".join(words[w] for w in chosen) + " .")
    return en, de


def write_corpus(root: Path, n_train: int = 400, n_eval: int = 30) -> Path:
    """train/valid/test.{en,de} of synthetic text under root, as `data=text` reads them."""
    en, de = synthetic_corpus(n_train + 2 * n_eval)
    write_pair(root, "train", en[:n_train], de[:n_train])
    write_pair(root, "valid", en[n_train : n_train + n_eval], de[n_train : n_train + n_eval])
    write_pair(root, "test", en[n_train + n_eval :], de[n_train + n_eval :])
    return root


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


# A tiny model on the synthetic corpus: every code path of a real run in a few seconds.
TINY_MODEL = [f"model.{key}={value}" for key, value in TINY_SHAPE.items()]
TINY_RUN = [
    "data=text",
    "trainer=cpu",
    "logger=csv",
    "data.vocab_size=400",
    "data.max_tokens=300",
    "trainer.val_check_interval=4",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "val_bleu_sentences=8",
    "optim.warmup_steps=4",
    "progress_every_seconds=0",  # progress lines by update count only: a slow machine adds none
    *TINY_MODEL,
]


def train_overrides(args: list[str], tmp_path: Path) -> tuple[list[str], list[str]]:
    """(Hydra flags, overrides): TINY_RUN, a cache under tmp_path, then `args`; a key given in `args`
    replaces TINY_RUN's (e.g. data=multi30k instead of data=text)."""
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    given = {a.split("=")[0] for a in overrides}
    defaults = [a for a in TINY_RUN if a.split("=")[0] not in given]
    return flags, [*defaults, f"data.cache_dir={tmp_path / 'cache'}", *overrides]


def run_train(
    args: list[str],
    tmp_path: Path,
    env: dict | None = None,
    check: bool = True,
    entry: tuple[str, ...] = ("-m", "transformer_mt.train"),
    **popen,
) -> subprocess.CompletedProcess:
    """`python -m transformer_mt.train` with TINY_RUN and `args` (Hydra flags such as -m first), as a user
    runs it, in a process of its own (the slow tier). `entry` replaces `-m transformer_mt.train`
    (e.g. by tests/kill_at.py and its kill point)."""
    flags, overrides = train_overrides(args, tmp_path)
    proc = run_process([sys.executable, *entry, *flags, *overrides], tmp_path, env, **popen)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_process(command: list[str], cwd: Path, env: dict | None = None, timeout: float = 280, **popen):
    """`command` in a session of its own, output captured. At the timeout the whole process group is
    killed (a hung rank of a several-process run included) and the test fails with the output so far."""
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
        **popen,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            output = stdout[-3000:] + stderr[-3000:]
            pytest.fail(f"{' '.join(command[:4])} ... did not end within {timeout} s (a hang?):\n{output}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def hydra_task(config_name: str, overrides: list[str], run_dir: Path) -> DictConfig:
    """The config a Hydra entry point receives (conf/<config_name>.yaml + overrides), with HydraConfig set
    as in a run whose folder is run_dir: entry points' functions (train, evaluate) run in this process."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name, overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def train_in_process(args: list[str], tmp_path: Path, run_dir: Path) -> float | None:
    """transformer_mt.train.train() with TINY_RUN and `args`, in this process (~1 s instead of ~5 s of
    imports per subprocess); returns what train returns (the last validation BLEU)."""
    _, overrides = train_overrides(args, tmp_path)
    return train(hydra_task("train", overrides, run_dir), hydra_job())


def run_translate(ckpt: Path, text: bytes | str, *overrides: str, monkeypatch, capsys) -> tuple[str, str]:
    """transformer_mt.translate's function in this process (pytest fixtures monkeypatch and capsys):
    `text` on stdin -> (stdout, stderr)."""
    data = text.encode() if isinstance(text, str) else text
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    capsys.readouterr()
    translate(hydra_task("translate", [f"ckpt={ckpt}", *overrides], Path.cwd()))
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """One tiny run for every test that needs *a* trained checkpoint: 12 updates on synthetic text,
    checkpoints every 3. <root>/corpus holds its text, <root>/out the run."""
    root = tmp_path_factory.mktemp("run")
    corpus = write_corpus(root / "corpus")
    args = [f"data.path={corpus}", "data.max_tokens=400", "trainer.max_steps=12", "trainer.val_check_interval=6"]
    train_in_process([*args, "checkpoint.every_n_train_steps=3"], root, root / "out")
    return root


# A run of the tiny model with every switch on (the head sizes, and each choice of the typed config at its last value:
# a new switch runs through the end of a run, attention pictures, export and loading), the protocol, a moving average.
VARIANT_SWITCHES = ["model.d_k=6", "model.d_v=10", *(f"model.{key}={values[-1]}" for key, values in CHOICES.items())]
VARIANT_RUN = [
    "data.max_tokens=400",
    "trainer.val_check_interval=3",
    "checkpoint.every_n_train_steps=2",
    "ema_decay=0.9",
]
VARIANT_FINAL = [
    "final.enabled=true",
    "final.average_last=3",
    "final.splits=[validation,test]",
    "decoding.max_len_b=10",
]


class Lines(logging.Handler):
    """The messages a logger receives, in order."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="session")
def variant_run(tmp_path_factory) -> Path:
    """6 updates of a tiny model with every switch on, the end-of-run protocol and a moving average; its folder,
    with final.log: what the protocol logged. Trained once per worker: tests that change it work on a copy."""
    root = tmp_path_factory.mktemp("variant")
    corpus = write_corpus(root / "corpus")
    handler, logger = Lines(), logging.getLogger("transformer_mt.evaluation.protocol")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        args = [f"data.path={corpus}", "trainer.max_steps=6", *VARIANT_RUN, *VARIANT_FINAL]
        train_in_process([*args, *VARIANT_SWITCHES], root, root / "out")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    (root / "out" / "final.log").write_text("\n".join(handler.lines))
    return root / "out"


# Library lines that say nothing about a run; none may reach a user's console (tests assert it).
NOISE = [
    "LeafSpec",
    "weights_only",
    "Tip:",
    "exists and is not empty",
    "Saving the dataset",
    "not supported by the model summary",
]


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` skip, with the reason, where no CUDA GPU is visible; tests marked `real_data`
    where ../shared/data is absent (a bare clone). The tests with a longer timeout mark than the default
    run first (a stable sort): with several workers (`make test-slow`, pytest-xdist) the longest ones start
    at once instead of ending the run alone."""
    items.sort(key=lambda item: -timeout_of(item, config))
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_data = pytest.mark.skip(
        reason=f"real EN-DE text not found at {SHARED_DATA} (present on the project's machines, absent in a bare clone)"
    )
    for item in items:
        if item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if item.get_closest_marker("real_data") and not SHARED_DATA.is_dir():
            item.add_marker(no_data)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timeout_of(item, config) -> float:
    mark = item.get_closest_marker("timeout")
    return float(mark.args[0]) if mark and mark.args else float(config.getini("timeout") or 0)


def load(path: Path) -> dict:
    """A checkpoint as torch.load(weights_only=True) reads it: plain values only, on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------- the same training state


def assert_same_training_state(expected: Path, actual: Path, step: int) -> None:
    """Two checkpoints at update `step`, bit for bit: the weights, Adam's state (moments and step) and the schedule."""
    a, b = load(expected), load(actual)
    assert a["global_step"] == b["global_step"] == step
    for key, value in a["state_dict"].items():
        assert torch.equal(b["state_dict"][key], value), key
    for param, state in a["optimizer_states"][0]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(b["optimizer_states"][0]["state"][param][name], state[name]), (param, name)
    assert a["lr_schedulers"] == b["lr_schedulers"]


def csv_rows(run: Path) -> list[dict]:
    """The CSV logger's rows of a run, every attempt's (a resumed run writes a version of its own)."""
    rows = []
    for path in sorted(run.glob("csv/**/metrics.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    return rows


def validation_rows(run: Path) -> dict[int, dict]:
    """The validation metrics of every CSV version of a run (a resumed run writes its own), by update."""
    rows = {}
    for row in csv_rows(run):
        if row.get("val/loss"):
            rows[int(row["step"])] = {k: v for k, v in row.items() if k.startswith("val/")}
    return rows


def validation_lines(run: Path) -> dict[int, str]:
    """train.log's validation lines by update (a validation redone after a kill says the same)."""
    found = re.findall(r"validation at update (\d+): (.*)", (run / "train.log").read_text())
    lines = {}
    for update, text in found:
        assert lines.setdefault(int(update), text) == text, (update, text)
    return lines


def assert_same_run(expected: Path, actual: Path, step: int) -> None:
    """Two run folders of one training (e.g. an interrupted run against the uninterrupted one), on the full
    criterion: last.ckpt's weights, Adam state, update and schedule; best.ckpt (its update and weights); every
    validation once, with the same values, in the CSV and in the log (a validation added or lost by a stop shows
    here)."""
    assert_same_training_state(expected / "checkpoints" / "last.ckpt", actual / "checkpoints" / "last.ckpt", step)
    best, expected_best = load(actual / "checkpoints" / "best.ckpt"), load(expected / "checkpoints" / "best.ckpt")
    assert best["global_step"] == expected_best["global_step"]
    assert all(torch.equal(best["state_dict"][k], v) for k, v in expected_best["state_dict"].items())
    assert validation_rows(actual) == validation_rows(expected) != {}
    assert validation_lines(actual) == validation_lines(expected)
