import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer_mt.model import Transformer, TransformerConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED_DATA = ROOT.parent / "shared" / "data"


def tiny_config(**overrides) -> TransformerConfig:
    """2+3 layers, d=16: big enough to exercise every code path, small enough for CPU tests."""
    values = dict(
        vocab_size=23,
        d_model=16,
        d_ff=32,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=3,
        dropout=0.1,
        max_positions=64,
        pad_id=0,
    )
    values.update(overrides)
    return TransformerConfig(**values)


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


requires_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(),
    reason=f"real EN-DE text not found at {SHARED_DATA} (present on the project's machines, absent in a bare clone)",
)


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
TINY_MODEL = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=4",
    "model.n_encoder_layers=2",
    "model.n_decoder_layers=2",
    "model.max_positions=64",
]
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
    *TINY_MODEL,
]


def run_train(
    args: list[str],
    tmp_path: Path,
    env: dict | None = None,
    check: bool = True,
    entry: tuple[str, ...] = ("-m", "transformer_mt.train"),
    **popen,
) -> subprocess.CompletedProcess:
    """`python -m transformer_mt.train` with TINY_RUN and `args` (Hydra flags such as -m first), as a user runs it.

    A key given in `args` replaces TINY_RUN's (e.g. data=multi30k instead of data=text). `entry`
    replaces `-m transformer_mt.train` (e.g. by tests/kill_at.py and its kill point).
    """
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    given = {a.split("=")[0] for a in overrides}
    defaults = [a for a in TINY_RUN if a.split("=")[0] not in given]
    cmd = [
        sys.executable,
        *entry,
        *flags,
        *defaults,
        f"data.cache_dir={tmp_path / 'cache'}",
        *overrides,
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        **popen,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` are skipped, with the reason, on a machine without a CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
