"""A WMT14-sized corpus in the local WMT14 layout, made from real WMT news text, for scale tests.

  python scripts/make_scale_corpus.py --out /data/wmt14-scale            # 4,500,000 pairs
  python scripts/make_scale_corpus.py --out /tmp/scale --pairs 20000 --seed 1

Training pairs are real pairs of <source>/train-sample/news2008-2012.{en,de}, drawn with
replacement, so sentence lengths follow real news text. A small share of the words (--new-word-rate)
is replaced by a compound of two words of the same side drawn by frequency, so that the number of
distinct words keeps growing with the number of pairs, as in real text. Validation and test are
the real newstest2013 and newstest2014. Output: <out>/de-en/{train-*,validation-*,test-*}.parquet
with rows {"translation": {"de": ..., "en": ...}}, what `data=wmt14 data.path=<out>` reads.
The same seed and source give the same files. Written in shards, never held in memory whole.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_wmt14_layout import write_layout  # noqa: E402 (a sibling script, not part of the package)
from transformer_mt.data.corpus import read_text_pair  # noqa: E402

DEFAULT_SOURCE = Path(__file__).resolve().parents[2] / "shared" / "data" / "wmt14"
SCHEMA = pa.schema([("translation", pa.struct([("de", pa.string()), ("en", pa.string())]))])


class Recombiner:
    """Real sentences of one language, with words occasionally replaced by new compounds."""

    def __init__(self, sentences: list[str], rng: np.random.Generator, new_word_rate: float):
        self.sentences, self.rng, self.rate = sentences, rng, new_word_rate
        counts: dict[str, int] = {}
        for sentence in sentences:
            for word in sentence.split():
                if word.isalpha():
                    counts[word] = counts.get(word, 0) + 1
        self.words = list(counts)
        self.cumulative = np.cumsum([counts[w] for w in self.words], dtype=np.float64)  # sampling by frequency

    def sentence(self, index: int) -> str:
        text = self.sentences[index]
        n_new = self.rng.binomial(len(text.split()), self.rate) if self.rate else 0
        if not n_new:
            return text
        words = text.split()
        first, second = np.searchsorted(self.cumulative, self.rng.random((2, n_new)) * self.cumulative[-1], "right")
        for slot, a, b in zip(self.rng.integers(0, len(words), n_new), first, second):
            words[slot] = self.words[a] + self.words[b].lower()
        return " ".join(words)


def write_train(source: tuple[list[str], list[str]], out: Path, pairs: int, seed: int, rate: float, shard: int):
    """`pairs` recombined training pairs as parquet shards of at most `shard` rows."""
    rng = np.random.default_rng(seed)
    en, de = Recombiner(source[0], rng, rate), Recombiner(source[1], rng, rate)
    n_shards = max(1, -(-pairs // shard))
    written, bar = [], tqdm(total=pairs, unit="pair", desc="train", disable=None)
    for k in range(n_shards):
        rows = min(shard, pairs - k * shard)
        picks = rng.integers(0, len(source[0]), rows)
        batch = [{"de": de.sentence(i), "en": en.sentence(i)} for i in picks.tolist()]
        target = out / f"train-{k:05d}-of-{n_shards:05d}.parquet"
        pq.write_table(pa.Table.from_pylist([{"translation": row} for row in batch], schema=SCHEMA), target)
        written.append(target)
        bar.update(rows)
    bar.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=4_500_000, help="training pairs (WMT14: 4.5M)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--new-word-rate", type=float, default=0.02, help="share of words replaced by compounds")
    parser.add_argument("--shard", type=int, default=500_000, help="rows per training parquet file")
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="real WMT text (../shared/data/wmt14)")
    args = parser.parse_args()
    if args.pairs < 1 or args.shard < 1 or not 0 <= args.new_word_rate < 1:
        parser.error("--pairs and --shard must be positive and --new-word-rate in [0, 1)")
    out = args.out / "de-en"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("train-*.parquet"):  # an earlier, larger corpus must not mix in
        old.unlink()
    real = read_text_pair(
        args.source / "train-sample" / "news2008-2012.en", args.source / "train-sample" / "news2008-2012.de"
    )
    shards = write_train(real, out, args.pairs, args.seed, args.new_word_rate, args.shard)
    print(f"train: {args.pairs:,} pairs -> {len(shards)} files in {out}")
    write_layout(args.out, {"validation": str(args.source / "newstest2013"), "test": str(args.source / "newstest2014")})


if __name__ == "__main__":
    main()
