"""Write aligned text files as a local copy of the Hub's WMT14 layout.

  python scripts/make_wmt14_layout.py --out /data/wmt14 \
      --train /raw/train --validation /raw/newstest2013 --test /raw/newstest2014

reads {prefix}.en / {prefix}.de for each split and writes
/data/wmt14/de-en/{split}-00000-of-00001.parquet with rows {"translation": {"de": ..., "en": ...}},
the files and schema of the Hub's `wmt/wmt14` dataset (config de-en), and a README.md whose
`configs:` header maps the config to its files as the Hub's dataset card does, so that
`datasets.load_dataset("/data/wmt14", "de-en")` reads it as it reads the Hub. Train with
`data.path=/data/wmt14`.
"""

import argparse
from pathlib import Path

import datasets

from transformer_mt.data.corpus import read_text_pair


def write_card(out: Path, config: str = "de-en", splits=("train", "validation", "test")) -> Path:
    """README.md with the `configs:` header of a Parquet dataset on the Hub: config -> files per split."""
    files = "".join(f"  - split: {split}\n    path: {config}/{split}-*\n" for split in splits)
    card = out / "README.md"
    card.write_text(
        f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{files}---\n"
        "A local copy of the Hugging Face Hub dataset wmt/wmt14 in its layout (scripts/make_wmt14_layout.py).\n",
        encoding="utf-8",
    )
    return card


def write_layout(out: Path, prefixes: dict[str, str], langs=("en", "de"), config="de-en", fmt="parquet") -> list[Path]:
    written = []
    for split, prefix in prefixes.items():
        a, b = read_text_pair(f"{prefix}.{langs[0]}", f"{prefix}.{langs[1]}")
        rows = [{langs[0]: x, langs[1]: y} for x, y in zip(a, b)]
        ds = datasets.Dataset.from_dict({"translation": rows})
        target = out / config / f"{split}-00000-of-00001.{fmt}"
        target.parent.mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(target)) if fmt == "parquet" else ds.to_json(str(target), force_ascii=False)
        print(f"{split}: {len(rows):,} pairs -> {target}")
        written.append(target)
    write_card(out, config)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    for split in ("train", "validation", "test"):
        parser.add_argument(
            f"--{split}", required=True, help=f"prefix of the {split} files ({{prefix}}.en, {{prefix}}.de)"
        )
    parser.add_argument("--langs", nargs=2, default=["en", "de"])
    parser.add_argument("--config", default="de-en", help="subdirectory, as the Hub's config name")
    parser.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    args = parser.parse_args()
    prefixes = {"train": args.train, "validation": args.validation, "test": args.test}
    write_layout(args.out, prefixes, tuple(args.langs), args.config, args.format)


if __name__ == "__main__":
    main()
