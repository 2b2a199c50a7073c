"""How many sentences SentencePiece should learn from: time, peak memory and vocabulary quality per sample size.

  python scripts/spm_sample_size.py --path /data/wmt14-scale --sizes 1000000 4000000 9000000

For each size, in a fresh process (so that its memory is its own), trains the shared BPE vocabulary
exactly as training does (`data.spm_max_sentences` = size, the corpus streamed, SentencePiece keeping a
seeded reservoir sample) and tokenizes newstest2014. A better vocabulary needs fewer tokens per
sentence, and leaves fewer words in pieces or bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_report import peak_memory_gib, reset_peak_memory, resident_memory_gib  # noqa: E402 (a sibling script)
from transformer_mt.data.datamodule import TranslationDataModule  # noqa: E402
from transformer_mt.files import read_lines  # noqa: E402

DEFAULT_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "wmt14" / "newstest2014"


def measure(args: argparse.Namespace, size: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        dm = TranslationDataModule(
            "wmt14",
            path=str(args.path),
            hub_config="de-en",
            vocab_size=args.vocab,
            spm_max_sentences=size,
            cache_dir=cache,
        )
        train = dm.corpus.load("train")
        train.open()  # datasets' Arrow copy of the files: made once, not part of SentencePiece's cost
        reset_peak_memory()
        start = time.perf_counter()
        tokenizer = dm.cache.load_or_train_tokenizer(train)
        seconds, peak, after = time.perf_counter() - start, peak_memory_gib(), resident_memory_gib()
    figures = {"size": size, "seconds": seconds, "peak_gib": peak, "after_gib": after}
    byte_pieces = {i for i in range(len(tokenizer)) if tokenizer.sp.is_byte(i)}
    for lang in ("en", "de"):
        lines = [line.strip() for line in read_lines(f"{args.test}.{lang}")]
        ids = tokenizer.encode(lines)
        words = sum(len(line.split()) for line in lines)
        figures[lang] = {
            "tokens_per_sentence": sum(map(len, ids)) / len(lines),
            "tokens_per_word": sum(map(len, ids)) / words,
            "byte_tokens": sum(i in byte_pieces for seq in ids for i in seq),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, required=True, help="a corpus in the WMT14 layout (data.path)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000, 9_000_000])
    parser.add_argument("--vocab", type=int, default=37_000)
    parser.add_argument("--test", default=str(DEFAULT_TEST), help="prefix of {prefix}.en/.de to tokenize")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: measure this size
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return
    print(
        f"{'sample':>10} {'seconds':>8} {'peak GiB':>9} {'after GiB':>9}  {'en tok/sent':>11} {'de tok/sent':>11}  "
        f"{'en tok/word':>11} {'de tok/word':>11}  {'byte tokens en/de':>17}"
    )
    for size in args.sizes:
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--one", str(size)], stdout=subprocess.PIPE, check=True, text=True
        )
        f = json.loads(child.stdout.strip().splitlines()[-1])
        en, de = f["en"], f["de"]
        print(
            f"{size:>10,} {f['seconds']:>8.0f} {f['peak_gib']:>9.2f} {f['after_gib']:>9.2f}  "
            f"{en['tokens_per_sentence']:>11.2f} {de['tokens_per_sentence']:>11.2f}  "
            f"{en['tokens_per_word']:>11.3f} {de['tokens_per_word']:>11.3f}  "
            f"{en['byte_tokens']:>8}/{de['byte_tokens']:<8}",
            flush=True,
        )


if __name__ == "__main__":
    main()
