from pathlib import Path

import pytest
import torch

from transformer_mt.model import Transformer, TransformerConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED_DATA = ROOT.parent / "shared" / "data"


def tiny_config(**overrides) -> TransformerConfig:
    """2+3 layers, d=16: big enough to exercise every code path, small enough for CPU tests."""
    values = dict(vocab_size=23, d_model=16, d_ff=32, n_heads=4, n_encoder_layers=2,
                  n_decoder_layers=3, dropout=0.1, max_positions=64, pad_id=0)
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
    import random

    rng = random.Random(seed)
    words = {"the": "die", "cat": "Katze", "dog": "Hund", "sees": "sieht", "a": "eine", "small": "kleine",
             "house": "Haus", "red": "rote", "runs": "läuft", "and": "und", "big": "große", "tree": "Baum"}
    en, de = [], []
    for _ in range(n):
        chosen = [rng.choice(list(words)) for _ in range(rng.randint(1, 20))]
        en.append(" ".join(chosen) + " .")
        de.append(" ".join(words[w] for w in chosen) + " .")
    return en, de
