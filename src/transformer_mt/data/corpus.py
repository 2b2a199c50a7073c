"""Parallel text from the Hub, a local copy of its layout or aligned text files; reading and cleaning it."""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np

from transformer_mt.errors import InputError, MissingInputError
from transformer_mt.files import file_digest, iter_lines

SPLITS = ("train", "validation", "test")

FINGERPRINT = functools.partial(hashlib.blake2b, digest_size=16)  # of a split's files: its cache key's part


def iter_text_pair(src_path: str | Path, tgt_path: str | Path, size: int) -> Iterator[tuple[list[str], list[str]]]:
    """Aligned lines of two files, `size` pairs at a time; a misalignment is found at the end."""
    pairs, done = itertools.zip_longest(iter_lines(src_path), iter_lines(tgt_path)), 0
    while chunk := list(itertools.islice(pairs, size)):
        src, tgt = map(list, zip(*chunk))
        if None in src or None in tgt:  # the shorter file's lines ended in this chunk
            total = done + len(chunk) + sum(1 for _ in pairs)
            n_src, n_tgt = (done + src.index(None), total) if None in src else (total, done + tgt.index(None))
            raise InputError(
                f"misaligned parallel files: {src_path} has {n_src} lines but {tgt_path} has "
                f"{n_tgt}; they must be aligned line by line"
            )
        yield src, tgt
        done += len(chunk)


def gather(batches: Iterator[tuple[list[str], list[str]]]) -> tuple[list[str], list[str]]:
    chunks = list(batches)
    return [s for src, _ in chunks for s in src], [t for _, tgt in chunks for t in tgt]


def read_text_pair(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    return gather(iter_text_pair(src_path, tgt_path, size=1 << 20))


@dataclass
class Corpus:
    """Where one language pair comes from: the Hub (path=None) or a local copy (path=...)."""

    name: str
    src_lang: str = "en"
    tgt_lang: str = "de"
    path: str | None = None  # local copy: Hub layout (parquet/jsonl), save_to_disk dir, or text files
    hub_name: str | None = None  # e.g. "wmt14"
    hub_config: str | None = None  # e.g. "de-en"
    text_files: dict[str, str] = field(default_factory=dict)  # split -> prefix of {prefix}.{lang}

    @classmethod
    def from_config(cls, data_cfg: Mapping, **overrides) -> Corpus:
        """The Corpus fields of a data config (conf/data/); `overrides` win, and an unknown one is a TypeError."""
        picked = {f.name: data_cfg[f.name] for f in fields(cls) if f.name in data_cfg} | overrides
        picked["text_files"] = dict(picked.get("text_files") or {})  # null in conf/data/default.yaml
        return cls(**picked)

    def texts(self, split: str) -> tuple[list[str], list[str]]:
        """A split's (sources, references) as a run's end, make evaluate and make tune score them (drop_empty)."""
        raw = self.load(split)
        sources, references, _ = drop_empty(*raw.pairs())
        if not sources:
            raise InputError(f"{raw.describe()}: the {split} split has no pair with text on both sides")
        return sources, references

    def load(self, split: str) -> RawSplit:
        if self.path is None:
            if not self.hub_name:
                raise InputError(f"data '{self.name}': set data.path to a local copy (no Hub name is configured)")
            ds = self.load_from_hub(split)  # datasets' fingerprint has no public name: it keys our cache
            return RawSplit(self, split, ds._fingerprint, dataset=ds, raw_bytes=ds.data.nbytes)
        root = Path(self.path).expanduser()
        if not root.exists():
            raise MissingInputError(f"data '{self.name}': data.path={root} does not exist")
        prefix = self.text_files.get(split)
        pair = tuple(root / f"{prefix}.{lang}" for lang in (self.src_lang, self.tgt_lang)) if prefix else ()
        if any(p.exists() for p in pair):
            for p in pair:
                if not p.is_file():
                    raise MissingInputError(
                        f"data '{self.name}', split {split}: missing {p} (its pair is {' and '.join(map(str, pair))})"
                    )
            fingerprint = file_digest(*pair, algorithm=FINGERPRINT)
            return RawSplit(self, split, fingerprint, text_pair=pair, raw_bytes=sum(p.stat().st_size for p in pair))
        if (root / "dataset_dict.json").exists():  # DatasetDict.save_to_disk
            ds = datasets.load_from_disk(str(root))[split]
            return RawSplit(self, split, ds._fingerprint, dataset=ds, raw_bytes=ds.data.nbytes)
        files = self.local_files(root, split)
        if not files:
            raise MissingInputError(
                f"data '{self.name}': no {split} split under {root}; looked for "
                f"{' and '.join(map(str, pair)) + ', ' if pair else ''}{split}-*.parquet / {split}.jsonl "
                f"(optionally under {self.hub_config}/) and a save_to_disk dataset_dict.json. "
                "scripts/make_wmt14_layout.py builds this layout from aligned text files."
            )
        builder = "parquet" if files[0].suffix == ".parquet" else "json"
        return RawSplit(  # opened when read: a start whose caches are present only hashes the files
            self,
            split,
            file_digest(*files, algorithm=FINGERPRINT),
            raw_bytes=sum(f.stat().st_size for f in files),
            open_dataset=lambda: datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train"),
        )

    def local_files(self, root: Path, split: str) -> list[Path]:
        """Parquet/JSON Lines files of `split` in the Hub's layout: [<config>/]<split>[-*].<ext>."""
        for folder in [root / self.hub_config, root] if self.hub_config else [root]:
            for ext in ("parquet", "jsonl", "json"):
                if found := sorted([*folder.glob(f"{split}-*.{ext}"), *folder.glob(f"{split}.{ext}")]):
                    return found
        return []

    def load_from_hub(self, split: str) -> datasets.Dataset:
        """`split` from the Hub, or `datasets`' cache when one request gets no answer (no ~25 s of retries)."""
        unreachable = None if Path(self.hub_name).expanduser().is_dir() else hub_unreachable()  # a folder: no Hub
        saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
        try:
            if unreachable is not None:  # as HF_HUB_OFFLINE=1, for this load only
                datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
            return datasets.load_dataset(self.hub_name, self.hub_config, split=split)
        except Exception as e:  # offline, unknown name, changed layout: the fix is the same
            name = f"{self.hub_name} ({self.hub_config})" if self.hub_config else self.hub_name
            cause = unreachable or f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            files = ", ".join(
                f"{prefix}.{lang}" for prefix in self.text_files.values() for lang in (self.src_lang, self.tgt_lang)
            )
            fix = (
                f"point data.path at a folder with its text files: data.path=<folder with {files}>"
                if self.text_files
                else "point data.path at a local copy in the Hub's layout: data.path=<folder> "
                "(scripts/make_wmt14_layout.py builds it from aligned text files)"
            )
            raise MissingInputError(
                f"data '{self.name}': could not load {name} {split} from the Hugging Face Hub ({cause}). Offline, {fix}"
            ) from e
        finally:
            datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def hub_unreachable(timeout: float = 10.0) -> str | None:
    """Why the Hub does not answer one request, or None when it answers at all (any HTTP status)."""
    if datasets.config.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        huggingface_hub.get_session().head(huggingface_hub.constants.ENDPOINT, timeout=timeout)
    except Exception as e:  # httpx's ConnectError, a timeout, a proxy's refusal: no answer
        return f"the Hub does not answer: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


@dataclass
class RawSplit:
    """One split before tokenization; its fingerprint keys the cache. Read in chunks (WMT14's: ~1.3 GB of strings)."""

    corpus: Corpus
    split: str
    fingerprint: str
    dataset: datasets.Dataset | None = None
    text_pair: tuple[Path, Path] | None = None
    open_dataset: Callable[[], datasets.Dataset] | None = None
    raw_bytes: int = 0  # its files' size on disk, or its Arrow table's: the cache's estimate

    def describe(self, row: int | None = None) -> str:
        """Where the split (or its row, from 0) comes from, as an error message names it."""
        if self.text_pair is not None:
            where = " and ".join(str(p) for p in self.text_pair)
            return where if row is None else f"{where}, line {row + 1}"
        where = f"data '{self.corpus.name}' {self.split}"
        return where if row is None else f"{where}, row {row}"

    def open(self) -> None:
        """Open a local copy's dataset (`datasets` converts its files to Arrow, once)."""
        if self.dataset is None and self.open_dataset is not None:
            self.dataset = self.open_dataset()

    def batches(self, size: int = 50_000) -> Iterator[tuple[list[str], list[str]]]:
        """(source, target) texts of `size` consecutive rows at a time, in order; a missing value is ''."""
        if self.text_pair is not None:
            yield from iter_text_pair(*self.text_pair, size)
            return
        self.open()
        langs, names = (self.corpus.src_lang, self.corpus.tgt_lang), self.dataset.column_names
        nested = "translation" in names  # the Hub's wmt14 schema: {"translation": {"de": ..., "en": ...}}
        present = [f.name for f in self.dataset.data.schema.field("translation").type] if nested else names
        if missing := [lang for lang in langs if lang not in present]:
            raise InputError(
                f"{self.describe()}: no {' or '.join(missing)} text: its columns are {names}"
                + (f", with languages {present} in 'translation'" if nested else "")
            )
        for table in self.dataset.with_format("arrow").iter(batch_size=size):
            if nested:
                table = table.column("translation").combine_chunks()  # a StructArray
            sides = [table.field(lang) if nested else table.column(lang) for lang in langs]
            yield tuple([x or "" for x in side.to_pylist()] for side in sides)

    def pairs(self) -> tuple[list[str], list[str]]:
        """Every (source, target) text of a small split."""
        return gather(self.batches())


def drop_empty(src: list[str], tgt: list[str]) -> tuple[list[str], list[str], list[int]]:
    """Both sides stripped, the pairs with an empty side dropped; (src, tgt, the rows kept, from 0)."""
    kept = [(i, s, t) for i, (s, t) in enumerate(zip((s.strip() for s in src), (t.strip() for t in tgt))) if s and t]
    return [s for _, s, _ in kept], [t for _, _, t in kept], [i for i, _, _ in kept]


def length_filter(src_lens: np.ndarray, tgt_lens: np.ndarray, max_len: int, max_ratio: float | None) -> tuple:
    """(keep-mask, drops per rule) of token lengths (without BOS/EOS)."""
    too_long = (src_lens > max_len) | (tgt_lens > max_len)
    keep = ~too_long
    drops = {f"longer than {max_len} tokens": int(too_long.sum())}
    if max_ratio is not None:
        ratio = np.maximum(src_lens, tgt_lens) / np.maximum(np.minimum(src_lens, tgt_lens), 1)
        bad_ratio = keep & (ratio > max_ratio)
        keep &= ~bad_ratio
        drops[f"length ratio above {max_ratio}"] = int(bad_ratio.sum())
    return keep, drops
