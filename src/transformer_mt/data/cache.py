"""The data cache under data.cache_dir: the shared SentencePiece model and each split's token ids.

Built once (by rank 0 of a launched job; the other ranks wait for it) and reused while the text, the
tokenizer and the cleaning rules are unchanged: every entry is keyed by a fingerprint of them. An
entry that no longer reads back is built again with a warning; a folder that cannot be written (read
only, full, not ours) ends in one line naming data.cache_dir and the fix: checked before SentencePiece
trains (check_room), and again for what a write meets after that.
"""

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
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from transformer_mt.data.batching import TokenizedSplit
from transformer_mt.data.corpus import SPLITS, Corpus, RawSplit, drop_empty, length_filter
from transformer_mt.errors import InputError, UserError
from transformer_mt.files import atomic_write, remove_stale_temporaries
from transformer_mt.launcher import launched_rank
from transformer_mt.tokenizer import MODEL_FILE, Tokenizer, cache_key, train_tokenizer

log = logging.getLogger(__name__)
ENTRY_FILE = "entry.json"  # beside a cache entry's sentencepiece.model: its SHA-256 and the settings that made it

CACHE_FILE = "pairs.arrow"  # one tokenized split: Arrow IPC stream, read memory-mapped by datasets
SIZE_FILE = "pairs.size"  # pairs.arrow's size as written: a cut-short file is noticed when opened

Stage = Callable[[str], AbstractContextManager]  # build()'s hook around each step, given the step's name

# What the cache holds per byte of raw corpus (its files, or a Hub dataset's Arrow table), an estimate: measured 1.19
# (Multi30k's text files, 8,000 pieces: int32 ids, rows, validation/test text) and 1.26 (4.5M WMT14-like pairs from
# 845 MB of Parquet, 37,000 pieces); 1.5 for a smaller vocabulary's more tokens per byte.
CACHE_BYTES_PER_RAW_BYTE = 1.5


class Stopwatch:
    """Seconds spent per stage, summed over its calls (`with watch("tokenizing"): ...`): how a cold
    build's time divides between reading, cleaning, tokenizing and writing, for the log and scale report."""

    def __init__(self):
        self.seconds: Counter = Counter()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start


class TokenCache:
    """A corpus' tokenizer and tokenized splits under `directory`: loaded when cached, else built and cached."""

    chunk_size = 50_000  # pairs read, tokenized and written at a time: memory follows the chunk, not the corpus

    def __init__(
        self,
        corpus: Corpus,
        directory: Path,
        vocab_size: int,
        spm_max_sentences: int,
        max_len: int,
        max_len_ratio: float | None,
        seed: int,
    ):
        self.corpus, self.directory = corpus, directory
        self.vocab_size, self.spm_max_sentences, self.seed = vocab_size, spm_max_sentences, seed
        self.max_len, self.max_len_ratio = max_len, max_len_ratio
        self.timings: dict[str, tuple[str, float]] = {}  # split -> (how, seconds)
        self.watch = Stopwatch()

    def build(self, stage: Stage) -> tuple[dict[str, RawSplit], Tokenizer, dict[str, TokenizedSplit]]:
        """(raw splits, tokenizer, tokenized splits). A cache that cannot be written (read-only, full, not
        ours) ends in one line naming data.cache_dir and the fix."""
        try:
            return self._build(stage)
        except OSError as e:
            faults = (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG)
            elsewhere = e.filename and not Path(e.filename).resolve().is_relative_to(self.directory.resolve())
            if e.errno not in faults or elsewhere:  # e.g. a corpus file that cannot be read: not the cache's
                raise
            where = next(p for p in (self.directory, *self.directory.parents) if p.exists())
            free = shutil.disk_usage(where).free / 2**20
            raise InputError(
                f"data.cache_dir={self.directory}: the data cache cannot be written there ({e.strerror}: "
                f"{e.filename or where}; {free:,.0f} MiB free). Point data.cache_dir at a writable folder with "
                "room for the tokenized corpus (a few GB for WMT14), or free space there"
            ) from None

    def _build(self, stage: Stage) -> tuple[dict[str, RawSplit], Tokenizer, dict[str, TokenizedSplit]]:
        """Each step inside `with stage(<its name>)`. Before SentencePiece trains, every split's files are
        opened (Parquet/JSON converted to Arrow): a bad validation or test file fails before the long step."""
        for folder in ("sentencepiece", "corpus"):  # what a killed build left half-written
            for path in remove_stale_temporaries(self.directory / folder):
                log.info("removed %s (an unfinished cache write of a killed run)", path)
        with stage("hash the raw files, open the splits"):
            raw = {split: self.corpus.load(split) for split in SPLITS}
        self.check_room(raw)  # an unwritable or full cache ends here, not after SentencePiece or tokenizing
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

    def missing(self, raw: dict[str, RawSplit]) -> list[RawSplit]:
        """The splits whose token ids are not cached: all of them without a cached tokenizer (their keys need it)."""
        try:
            tokenizer = Tokenizer(self.tokenizer_directory(raw["train"]) / MODEL_FILE)
        except UserError:  # not built yet, or damaged (built again)
            return list(raw.values())
        return [split for split in raw.values() if not self.split_directory(split, tokenizer).exists()]

    def check_room(self, raw: dict[str, RawSplit]) -> None:
        """Before anything is built: the cache folder can be created and written (a probe file, written and
        removed), and its free space covers an estimate of what the missing caches will hold. A complete cache
        is only read, and not checked: it may be read-only."""
        missing = self.missing(raw)
        if not missing:
            return
        fix = "point data.cache_dir at a writable folder with room (data.cache_dir=<folder with space>)"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".write-probe-") as probe:
                probe.write(b"probe")
                probe.flush()
        except OSError as e:
            raise InputError(
                f"data.cache_dir={self.directory}: the data cache cannot be written there ({e.strerror}: "
                f"{e.filename or self.directory}); {fix}"
            ) from None
        raw_bytes = sum(split.raw_bytes for split in missing)
        needed, free = int(CACHE_BYTES_PER_RAW_BYTE * raw_bytes), shutil.disk_usage(self.directory).free
        estimate = (
            f"about {needed / 2**20:,.1f} MiB ({CACHE_BYTES_PER_RAW_BYTE}x the {raw_bytes / 2**20:,.1f} MiB of raw "
            f"{'/'.join(split.split for split in missing)} text, an estimate)"
        )
        if free < needed:
            raise InputError(
                f"data.cache_dir={self.directory}: the data cache needs {estimate} and {free / 2**20:,.1f} MiB is "
                f"free there; {fix}, or free space there"
            )
        log.info("data cache: %s to write under %s, %s MiB free", estimate, self.directory, f"{free / 2**20:,.0f}")

    # -- launched jobs: rank 0 builds, the other ranks wait

    def wait_for_rank_0(self, poll_seconds: float, timeout_seconds: float) -> None:
        """Return once another process (rank 0 of a launched job) has written every cache: the other ranks
        wait instead of each training SentencePiece and tokenizing the corpus themselves."""
        # A warning: ranks other than 0 log nothing below (training.logs), and this is where a rank's start goes.
        log.warning("rank %d: reading the data caches that rank 0 builds under %s", launched_rank(), self.directory)
        raw = {split: self.corpus.load(split) for split in SPLITS}
        waited = 0.0
        while not self.ready(raw):
            if waited >= timeout_seconds:
                raise InputError(
                    f"waited {waited / 3600:.1f} h for rank 0 to write the data caches under {self.directory}; "
                    "did it fail? (several nodes need data.cache_dir on a shared file system)"
                )
            time.sleep(poll_seconds)
            waited += poll_seconds

    def ready(self, raw: dict[str, RawSplit]) -> bool:
        """Every cache of `raw` written and readable (rank 0 may still be building or repairing one)."""
        try:
            tokenizer = Tokenizer(self.tokenizer_directory(raw["train"]) / MODEL_FILE)
            for split in raw.values():
                open_cache(self.split_directory(split, tokenizer))
        except (UserError, DamagedCache, FileNotFoundError):
            return False
        return True

    # -- the tokenizer

    def tokenizer_settings(self, train: RawSplit) -> dict:
        """What makes the SentencePiece model of a cache entry: the training text and the options."""
        return {
            "data": train.fingerprint,
            "langs": [self.corpus.src_lang, self.corpus.tgt_lang],
            "vocab": self.vocab_size,
            "max_sentences": self.spm_max_sentences,
            "seed": self.seed,
            "sampling": 2,  # SentencePiece's reservoir sample of the streamed sentences
        }

    def tokenizer_directory(self, train: RawSplit) -> Path:
        return self.directory / "sentencepiece" / cache_key(**self.tokenizer_settings(train))

    def load_or_train_tokenizer(self, train: RawSplit) -> Tokenizer:
        """The cache entry's SentencePiece model, checked against what made it (ENTRY_FILE: its SHA-256 and settings;
        a wrong model is one line naming the entry), or trained and recorded now."""
        directory = self.tokenizer_directory(train)
        if (directory / MODEL_FILE).exists():
            try:
                tokenizer = Tokenizer(directory / MODEL_FILE)
            except InputError as e:  # damaged after it was written (a disk fault, a stray copy): build it again
                log.warning("damaged cache, built again: %s", e)
                shutil.rmtree(directory)
            else:
                self.check_entry(directory, tokenizer)
                return tokenizer
        sentences = self.sentences(train)
        first = next(sentences, None)
        if first is None:
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

    def check_entry(self, directory: Path, tokenizer: Tokenizer) -> None:
        """The model in a cache entry is the one the entry made (its recorded SHA-256; an entry from before the
        record: its vocabulary size), or one line naming the entry and how to build it again."""
        try:
            recorded = json.loads((directory / ENTRY_FILE).read_text(encoding="utf-8"))["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            recorded = None
        found = hashlib.sha256(tokenizer.proto).hexdigest()
        if recorded == found or (recorded is None and len(tokenizer) == self.vocab_size):
            return
        what = f"SHA-256 {found[:12]}, recorded {recorded[:12]}" if recorded else f"{len(tokenizer):,} pieces"
        raise InputError(
            f"{directory / MODEL_FILE}: not the SentencePiece model this cache entry made ({what}; "
            f"data.vocab_size={self.vocab_size}); a changed or copied file. Remove the entry to train it again: "
            f"rm -r {directory} (its tokenized splits follow), or point data.cache_dir elsewhere"
        )

    def sentences(self, train: RawSplit) -> Iterator[str]:
        """Both sides of every training pair with text on both sides, stripped, read in chunks."""
        bar = tqdm(desc=f"SentencePiece sample from {self.corpus.name} train", unit=" pairs", disable=None, leave=False)
        with bar:
            for src, tgt in train.batches(self.chunk_size):
                src, tgt, _ = drop_empty(src, tgt)
                for pair in zip(src, tgt):
                    yield from pair
                bar.update(len(src))

    # -- the tokenized splits

    def split_directory(self, raw: RawSplit, tokenizer: Tokenizer) -> Path:
        """Where one split's token ids are cached: keyed by its text, the tokenizer and the cleaning rules."""
        filtered = raw.split == "train"  # validation and test sets are kept whole, as published
        key = cache_key(
            data=raw.fingerprint,
            tokenizer=hashlib.sha256(tokenizer.proto).hexdigest(),
            langs=[self.corpus.src_lang, self.corpus.tgt_lang],
            max_len=self.max_len if filtered else None,
            ratio=self.max_len_ratio if filtered else None,
            layout=3,  # pairs.arrow with columns src, tgt, row (+ src_text, tgt_text)
        )
        return self.directory / "corpus" / f"{self.corpus.name}-{raw.split}-{key}"

    def load_or_tokenize(self, raw: RawSplit, tokenizer: Tokenizer) -> TokenizedSplit:
        """One split's token ids from its cache, written first if missing; one log line per split."""
        directory = self.split_directory(raw, tokenizer)
        start, cached, tokenized = time.perf_counter(), directory.exists(), None
        if cached:
            try:
                tokenized = open_cache(directory)
            except DamagedCache as e:  # damaged after it was written: tokenized again
                log.warning("damaged cache, built again: %s", e)
                shutil.rmtree(directory)
                cached = False
        dropped = "" if cached else self.write_tokenized(raw, tokenizer, directory)
        tokenized = tokenized or open_cache(directory)
        how = "loaded from cache" if cached else "tokenized"
        self.timings[raw.split] = (how, time.perf_counter() - start)
        log.info(
            "%s %s: %s pairs %s in %.2f s%s (%s)",
            self.corpus.name,
            raw.split,
            f"{len(tokenized):,}",
            how,
            self.timings[raw.split][1],
            dropped,
            directory,
        )
        return tokenized

    def write_tokenized(self, raw: RawSplit, tokenizer: Tokenizer, directory: Path) -> str:
        """Clean, tokenize and cache one split as an Arrow file, chunk by chunk (memory follows the chunk,
        not the corpus); returns what was dropped, for the log. Each pair keeps its row in the raw split
        (`row`), so that later checks can name the line; validation and test keep their text for BLEU."""
        train = raw.split == "train"
        schema = pa.schema(
            [("src", pa.list_(pa.int32())), ("tgt", pa.list_(pa.int32())), ("row", pa.int64())]
            + ([] if train else [("src_text", pa.string()), ("tgt_text", pa.string())])
        )
        drops, kept, first_row = Counter(), 0, 0
        # A bar on a terminal only (disable=None); in a log file the split's line says how long it took.
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
            (tmp / SIZE_FILE).write_text(f"{(tmp / CACHE_FILE).stat().st_size}\n")
            if not kept:
                raise InputError(
                    f"{raw.describe()}: the {raw.split} split is empty after cleaning (dropped: {dict(drops)}); "
                    "check data.path and data.max_len"
                )
        return "; dropped " + ", ".join(f"{n:,} ({why})" for why, n in drops.items())

    def tokenize_chunk(
        self, tokenizer: Tokenizer, raw_src: list[str], raw_tgt: list[str], first_row: int, train: bool, drops: Counter
    ) -> list[pa.Array]:
        """The cache's columns for consecutive raw rows from `first_row`; counts what it drops in `drops`.
        Training pairs pass the length filter; validation and test pairs are all kept, with their text."""
        with self.watch("cleaning"):
            src, tgt, rows = drop_empty(raw_src, raw_tgt)
        drops["empty side"] += len(raw_src) - len(src)
        rows = np.asarray(rows, dtype=np.int64) + first_row
        with self.watch("tokenizing"):
            (src_ids, src_lens), (tgt_ids, tgt_lens) = tokenizer.encode_flat(src), tokenizer.encode_flat(tgt)
        keep = np.ones(len(rows), dtype=bool)
        if train:
            rule = length_filter(src_lens, tgt_lens, self.max_len, self.max_len_ratio)
            keep = rule["keep"]
            drops.update(rule["drops"])
        columns = [ragged(src_ids, src_lens, keep), ragged(tgt_ids, tgt_lens, keep), pa.array(rows[keep])]
        if not train:
            columns += [pa.array(list(itertools.compress(side, keep)), pa.string()) for side in (src, tgt)]
        return columns


class DamagedCache(Exception):
    """A cache entry that does not read back as it was written."""


def open_cache(directory: Path) -> TokenizedSplit:
    """A split's cache, checked first: pairs.arrow must have the size written beside it (caches written
    before that check have no size file and are only opened) and must open."""
    path, size_file = directory / CACHE_FILE, directory / SIZE_FILE
    try:
        size = path.stat().st_size
        if size_file.exists() and size != int(size_file.read_text()):
            raise DamagedCache(f"{path} holds {size:,} bytes, {int(size_file.read_text()):,} were written")
        return TokenizedSplit(datasets.Dataset.from_file(str(path)))
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DamagedCache(f"{path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def ragged(values: np.ndarray, lengths: np.ndarray, keep: np.ndarray) -> pa.ListArray:
    """A list<int32> column of the items where `keep` is set, from their flat values and lengths."""
    if not keep.all():
        values, lengths = values[np.repeat(keep, lengths)], lengths[keep]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32()))
