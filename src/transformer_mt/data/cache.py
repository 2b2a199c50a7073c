"""The cache under data.cache_dir: SentencePiece and each split's ids, keyed by what made them; rank 0 builds it."""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from transformer_mt.data.batching import TokenizedSplit
from transformer_mt.data.corpus import SPLITS, Corpus, RawSplit, drop_empty, length_filter
from transformer_mt.errors import WRITE_FAULTS, InputError, UserError
from transformer_mt.files import atomic_write, file_digest, remove_stale_temporaries
from transformer_mt.launcher import launched_rank
from transformer_mt.tokenizer import MODEL_FILE, Tokenizer, train_tokenizer

log = logging.getLogger(__name__)
ENTRY_FILE = "entry.json"  # beside a cache entry's sentencepiece.model: its SHA-256 and the settings that made it
CACHE_FILE = "pairs.arrow"  # one tokenized split: Arrow IPC stream, read memory-mapped by datasets
DIGEST_FILE = "pairs.sha256"  # pairs.arrow's SHA-256 and size as written: a changed or cut-short file is noticed
CACHE_BYTES_PER_RAW_BYTE = 1.5  # an estimate (measured 1.19-1.26: docs/data.md)

Stage = Callable[[str], AbstractContextManager]  # build()'s hook around each step, given the step's name


@dataclass
class TokenCache:
    """A corpus' tokenizer and tokenized splits under `directory`: loaded when cached, else built and cached."""

    corpus: Corpus
    directory: Path
    vocab_size: int
    spm_max_sentences: int
    max_len: int
    max_len_ratio: float | None
    seed: int
    chunk_size: int = 50_000  # pairs read, tokenized and written at a time: memory follows the chunk, not the corpus
    timings: dict[str, tuple[str, float]] = field(default_factory=dict)  # split -> (how, seconds)
    watch: Stage = nullcontext  # around each part of tokenizing a split (scripts/scale_report.py times them)

    def build(self, stage: Stage) -> tuple[dict[str, RawSplit], Tokenizer, dict[str, TokenizedSplit]]:
        """(raw splits, tokenizer, tokenized splits); a cache that cannot be written is one line naming the fix."""
        try:
            for folder in ("sentencepiece", "corpus"):
                remove_stale_temporaries(self.directory / folder, log.info)
            # a bad validation or test file fails before SentencePiece
            with stage("hash the raw files, open the splits"):
                raw = {split: self.corpus.load(split) for split in SPLITS}
            self.check_room(raw)
            tokenizer_cached = (self.tokenizer_directory(raw["train"]) / MODEL_FILE).exists()
            if not tokenizer_cached:
                with stage("datasets: convert the files to Arrow"):
                    for split in raw.values():
                        split.open()
            with stage("SentencePiece: load" if tokenizer_cached else "SentencePiece: read, sample, train"):
                tokenizer = self.load_or_train_tokenizer(raw["train"])
            splits = {}
            for split in SPLITS:
                how = "loaded from cache" if self.split_directory(raw[split], tokenizer).exists() else "tokenized"
                with stage(f"{split}: {how}"):
                    splits[split] = self.load_or_tokenize(raw[split], tokenizer)
            return raw, tokenizer, splits
        except OSError as e:
            elsewhere = e.filename and not Path(e.filename).resolve().is_relative_to(self.directory.resolve())
            if e.errno not in (*WRITE_FAULTS, errno.ENOTDIR) or elsewhere:  # e.g. an unreadable corpus file
                raise
            raise self.unwritable(f"cannot be written there ({e.strerror}: {e.filename or self.directory})") from None

    def unwritable(self, why: str) -> InputError:
        where = next(p for p in (self.directory, *self.directory.parents) if p.exists())
        return InputError(
            f"data.cache_dir={self.directory}: the data cache {why}, {shutil.disk_usage(where).free / 2**20:,.1f} MiB "
            "free there. Point data.cache_dir at a writable folder with room (data.cache_dir=<folder with space>), "
            "or free space there"
        )

    def missing(self, raw: dict[str, RawSplit]) -> list[RawSplit]:
        """The splits whose cache is not there (all of them without the tokenizer: every split's key needs it)."""
        try:
            tokenizer = Tokenizer(self.tokenizer_directory(raw["train"]) / MODEL_FILE)
        except UserError:
            return list(raw.values())
        return [split for split in raw.values() if not self.split_directory(split, tokenizer).exists()]

    def check_room(self, raw: dict[str, RawSplit]) -> None:
        """Before anything is built: a probe file, and room for what is missing (a complete cache may be read-only)."""
        if not (missing := self.missing(raw)):
            return
        self.directory.mkdir(parents=True, exist_ok=True)  # an OSError here is build()'s one line
        with tempfile.TemporaryFile(dir=self.directory, buffering=0) as probe:  # unbuffered: a full disk fails here
            probe.write(b"probe")
        raw_bytes = sum(split.raw_bytes for split in missing)
        needed, free = int(CACHE_BYTES_PER_RAW_BYTE * raw_bytes), shutil.disk_usage(self.directory).free
        estimate = (
            f"about {needed / 2**20:,.1f} MiB ({CACHE_BYTES_PER_RAW_BYTE}x the {raw_bytes / 2**20:,.1f} MiB of raw "
            f"{'/'.join(split.split for split in missing)} text, an estimate)"
        )
        if free < needed:
            raise self.unwritable(f"needs {estimate}")
        log.info("data cache: %s to write under %s, %s MiB free", estimate, self.directory, f"{free / 2**20:,.0f}")

    def wait_for_rank_0(self, poll_seconds: float = 5.0, timeout_seconds: float = 6 * 3600) -> None:
        """Return once another process (rank 0 of a launched job) has written every cache."""
        # A warning: ranks other than 0 log nothing below (training.logs), and this is where a rank's start goes.
        log.warning("rank %d: reading the data caches that rank 0 builds under %s", launched_rank(), self.directory)
        raw = {split: self.corpus.load(split) for split in SPLITS}
        deadline = time.monotonic() + timeout_seconds
        while self.missing(raw):
            if time.monotonic() >= deadline:
                raise InputError(
                    f"waited {timeout_seconds / 3600:.1f} h for rank 0 to write the data caches under "
                    f"{self.directory}; did it fail? (several nodes need data.cache_dir on a shared file system)"
                )
            time.sleep(poll_seconds)

    def tokenizer_settings(self, train: RawSplit) -> dict:
        return {
            "data": train.fingerprint,
            "langs": [self.corpus.src_lang, self.corpus.tgt_lang],
            "vocab": self.vocab_size,
            "max_sentences": self.spm_max_sentences,
            "seed": self.seed,
        }

    def tokenizer_directory(self, train: RawSplit) -> Path:
        return self.directory / "sentencepiece" / cache_key(**self.tokenizer_settings(train))

    def load_or_train_tokenizer(self, train: RawSplit) -> Tokenizer:
        """The entry's model if its SHA-256 is the one recorded; trained and recorded when missing or damaged."""
        directory = self.tokenizer_directory(train)
        if (directory / MODEL_FILE).exists():
            try:
                tokenizer = Tokenizer(directory / MODEL_FILE)
                record = json.loads((directory / ENTRY_FILE).read_text(encoding="utf-8"))
                recorded, settings = record["sha256"], record["settings"]
            except (OSError, ValueError, KeyError, TypeError) as e:  # InputError is a ValueError
                log.warning("damaged cache, built again: %s", e)
                shutil.rmtree(directory)
            else:
                rebuild = (
                    f"Remove the entry to train it again: rm -r {directory} (its tokenized splits follow), or "
                    "point data.cache_dir elsewhere"
                )
                if (found := hashlib.sha256(tokenizer.proto).hexdigest()) != recorded:
                    raise InputError(
                        f"{directory / MODEL_FILE}: not the SentencePiece model this cache entry made (SHA-256 "
                        f"{found[:12]}, recorded {str(recorded)[:12]}; data.vocab_size={self.vocab_size}); a changed "
                        f"or copied file. {rebuild}"
                    )
                if settings != self.tokenizer_settings(train) or len(tokenizer) != self.vocab_size:
                    raise InputError(
                        f"{directory / ENTRY_FILE}: this cache entry holds a {len(tokenizer):,}-word SentencePiece "
                        f"model, recorded as made with {settings}; these settings ask for {self.vocab_size:,} words "
                        f"({self.tokenizer_settings(train)}): a changed or copied entry. {rebuild}"
                    )
                return tokenizer
        sentences = self.sentences(train)
        if (first := next(sentences, None)) is None:
            raise InputError(
                f"{train.describe()}: no training pair with text on both sides; check data.path (and data.text_files)"
            )
        tokenizer = train_tokenizer(
            itertools.chain([first], sentences), directory, self.vocab_size, self.spm_max_sentences, self.seed
        )
        record = {"sha256": hashlib.sha256(tokenizer.proto).hexdigest(), "settings": self.tokenizer_settings(train)}
        with atomic_write(directory / ENTRY_FILE) as tmp:
            tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        return tokenizer

    def sentences(self, train: RawSplit) -> Iterator[str]:
        """Both sides of every training pair with text on both sides, stripped, read in chunks."""
        desc = f"SentencePiece sample from {self.corpus.name} train"
        with tqdm(desc=desc, unit=" pairs", disable=None, leave=False) as bar:
            for src, tgt in train.batches(self.chunk_size):
                src, tgt, _ = drop_empty(src, tgt)
                yield from itertools.chain.from_iterable(zip(src, tgt))
                bar.update(len(src))

    def split_directory(self, raw: RawSplit, tokenizer: Tokenizer) -> Path:
        filtered = raw.split == "train"  # validation and test sets are kept whole, as published
        key = cache_key(
            data=raw.fingerprint,
            tokenizer=hashlib.sha256(tokenizer.proto).hexdigest(),
            langs=[self.corpus.src_lang, self.corpus.tgt_lang],
            max_len=self.max_len if filtered else None,
            ratio=self.max_len_ratio if filtered else None,
        )
        return self.directory / "corpus" / f"{self.corpus.name}-{raw.split}-{key}"

    def load_or_tokenize(self, raw: RawSplit, tokenizer: Tokenizer) -> TokenizedSplit:
        """One split's token ids from its cache, written first if missing or damaged; one log line per split."""
        directory, start, tokenized = self.split_directory(raw, tokenizer), time.perf_counter(), None
        if directory.exists():
            try:
                tokenized = open_cache(directory, len(tokenizer))
            except DamagedCache as e:
                log.warning("damaged cache, built again: %s", e)
                shutil.rmtree(directory)
        how, dropped = "loaded from cache", ""
        if tokenized is None:
            how, dropped = "tokenized", self.write_tokenized(raw, tokenizer, directory)
            tokenized = open_cache(directory, len(tokenizer))
        seconds = time.perf_counter() - start
        self.timings[raw.split] = (how, seconds)
        log.info(
            f"{self.corpus.name} {raw.split}: {len(tokenized):,} pairs {how} in {seconds:.2f} s{dropped} ({directory})"
        )
        return tokenized

    def write_tokenized(self, raw: RawSplit, tokenizer: Tokenizer, directory: Path) -> str:
        """One split cleaned, tokenized and written chunk by chunk, with each pair's raw row; what was dropped."""
        train = raw.split == "train"
        schema = pa.schema(
            [("src", pa.list_(pa.int32())), ("tgt", pa.list_(pa.int32())), ("row", pa.int64())]
            + ([] if train else [("src_text", pa.string()), ("tgt_text", pa.string())])
        )
        drops, kept, first_row = Counter(), 0, 0
        bar = tqdm(desc=f"tokenizing {self.corpus.name} {raw.split}", unit=" pairs", disable=None, leave=False)
        with atomic_write(directory) as tmp, bar:  # a crash never leaves a half-written cache
            tmp.mkdir()
            chunks = raw.batches(self.chunk_size)
            with pa.ipc.new_stream(str(tmp / CACHE_FILE), schema) as writer:
                while True:
                    with self.watch("reading"):
                        raw_src, raw_tgt = next(chunks, ([], []))
                    if not raw_src:
                        break
                    batch = self.tokenize_chunk(tokenizer, raw_src, raw_tgt, first_row, train, drops)
                    with self.watch("writing"):
                        writer.write_batch(pa.record_batch(batch, schema=schema))
                    kept += len(batch[2])
                    first_row += len(raw_src)
                    bar.update(len(raw_src))
            (tmp / DIGEST_FILE).write_text(f"{file_digest(tmp / CACHE_FILE)} {(tmp / CACHE_FILE).stat().st_size}\n")
            if not kept:
                raise InputError(
                    f"{raw.describe()}: the {raw.split} split is empty after cleaning (dropped: {dict(drops)}); "
                    "check data.path and data.max_len"
                )
        return "; dropped " + ", ".join(f"{n:,} ({why})" for why, n in drops.items())

    def tokenize_chunk(
        self, tokenizer: Tokenizer, raw_src: list[str], raw_tgt: list[str], first_row: int, train: bool, drops: Counter
    ) -> list[pa.Array]:
        """The cache's columns for consecutive raw rows from `first_row` (training pairs length-filtered)."""
        with self.watch("cleaning"):
            src, tgt, rows = drop_empty(raw_src, raw_tgt)
        drops["empty side"] += len(raw_src) - len(src)
        rows = np.asarray(rows, dtype=np.int64) + first_row
        with self.watch("tokenizing"):
            (src_ids, src_lens), (tgt_ids, tgt_lens) = tokenizer.encode_flat(src), tokenizer.encode_flat(tgt)
        columns = [ragged(src_ids, src_lens), ragged(tgt_ids, tgt_lens), pa.array(rows)]
        if not train:  # validation and test sets are kept whole, with their texts
            return columns + [pa.array(side, pa.string()) for side in (src, tgt)]
        keep, dropped = length_filter(src_lens, tgt_lens, self.max_len, self.max_len_ratio)
        drops.update(dropped)
        return [column.filter(keep) for column in columns]


def cache_key(**inputs) -> str:
    """A short stable hash of JSON-serialisable inputs (file hashes, options)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


class DamagedCache(Exception):
    """A cache entry that does not read back as it was written."""


def open_cache(directory: Path, vocab_size: int) -> TokenizedSplit:
    """A split's cache, checked: pairs.arrow has the size and SHA-256 written beside it (~0.8 s for WMT14's 1.2 GB),
    opens, and holds ids of the vocabulary only (an entry that differs from what it claims: refused in one line)."""
    path = directory / CACHE_FILE
    try:
        digest, written = (directory / DIGEST_FILE).read_text().split()
        if (size := path.stat().st_size) != int(written):
            raise DamagedCache(f"{path} holds {size:,} bytes, {int(written):,} were written")
        if file_digest(path) != digest:
            raise DamagedCache(f"{path}: not the file this cache entry wrote (its SHA-256 differs; a changed file)")
        split = TokenizedSplit(datasets.Dataset.from_file(str(path)))
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DamagedCache(f"{path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    for side, chunks in (("src", split.src_chunks), ("tgt", split.tgt_chunks)):
        ids = [values for _, values in chunks if len(values)]
        low, high = min(v.min() for v in ids), max(v.max() for v in ids)
        if low < 0 or high >= vocab_size:
            raise InputError(
                f"{path}: {side} token ids from {low} to {high}, outside the vocabulary of {vocab_size:,} of this "
                f"cache entry's SentencePiece model (a changed or copied entry). Remove it to tokenize again: "
                f"rm -r {directory}, or point data.cache_dir elsewhere"
            )
    return split


def ragged(values: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    """A list<int32> column from the items' flat values and lengths."""
    offsets = pa.array(np.append(0, np.cumsum(lengths)), pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(values, pa.int32()))
