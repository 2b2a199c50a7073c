"""The LightningDataModule: corpus -> shared SentencePiece -> cached token ids -> token buckets.

Reading and cleaning text is in corpus.py, batching in batching.py; this file builds and
caches the tokenized splits and hands Lightning its loaders.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path

import datasets
import lightning as L
import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from transformer_mt.data.batching import TokenBucketSampler, TokenizedSplit, collate, update_shape
from transformer_mt.data.corpus import SPLITS, Corpus, RawSplit, drop_empty, length_filter
from transformer_mt.errors import InputError, UserError
from transformer_mt.files import atomic_write, remove_stale_temporaries
from transformer_mt.runtime import die_with_parent, launched_rank
from transformer_mt.tokenizer import MODEL_FILE, Tokenizer, cache_key, train_tokenizer

log = logging.getLogger(__name__)

CACHE_FILE = "pairs.arrow"  # one tokenized split: Arrow IPC stream, read memory-mapped by datasets
SIZE_FILE = "pairs.size"  # pairs.arrow's size as written: a cut-short file is noticed when opened


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


class TranslationDataModule(L.LightningDataModule):
    """Loads a corpus, trains/loads the shared SentencePiece model, caches token ids, batches."""

    chunk_size = 50_000  # pairs read, tokenized and written at a time: memory follows the chunk, not the corpus

    def __init__(
        self,
        name: str,
        src_lang: str = "en",
        tgt_lang: str = "de",
        path: str | None = None,
        hub_name: str | None = None,
        hub_config: str | None = None,
        text_files: dict[str, str] | None = None,
        vocab_size: int = 8000,
        spm_max_sentences: int = 10_000_000,
        max_len: int = 250,
        max_len_ratio: float | None = None,
        max_tokens: int | str = 4096,
        max_tokens_fallback: int = 4096,
        tokens_per_update: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        cache_dir: str = "~/.cache/transformer_mt",
    ):
        super().__init__()
        numbers = dict(
            max_tokens=max_tokens, max_tokens_fallback=max_tokens_fallback, vocab_size=vocab_size, max_len=max_len
        )
        for key, value in numbers.items():
            if (not isinstance(value, int) or value < 1) and not (key == "max_tokens" and value == "auto"):
                raise InputError(f"data.{key}={value}: must be a positive whole number" + (
                    " or auto (the largest batch the device fits)" if key == "max_tokens" else ""))  # fmt: skip
        if tokens_per_update is not None and (not isinstance(tokens_per_update, int) or tokens_per_update < 1):
            raise InputError(f"data.tokens_per_update={tokens_per_update}: a positive number of tokens, or null")
        self.corpus = Corpus(name, src_lang, tgt_lang, path, hub_name, hub_config, dict(text_files or {}))
        self.vocab_size, self.spm_max_sentences = vocab_size, spm_max_sentences
        self.max_len, self.max_len_ratio = max_len, max_len_ratio
        self.max_tokens, self.tokens_per_update = max_tokens, tokens_per_update
        self.max_tokens_fallback = max_tokens_fallback
        self.num_workers, self.seed = num_workers, seed
        self.cache_dir = Path(os.path.expanduser(cache_dir))
        self.tokenizer: Tokenizer | None = None
        self.raw: dict[str, RawSplit] = {}
        self.splits: dict[str, TokenizedSplit] = {}
        self.train_sampler: TokenBucketSampler | None = None
        self.timings: dict[str, tuple[str, float]] = {}  # split -> (how, seconds)
        self.watch = Stopwatch()

    # -- building and caching

    def prepare_data(self) -> None:
        if not self.splits:  # train.py builds before the Trainer exists (the vocabulary size sizes the model)
            self.build()

    def setup(self, stage: str | None = None) -> None:
        if not self.splits:
            self.build()

    def build(self, stage: Callable[[str], AbstractContextManager] = lambda name: nullcontext()) -> None:
        """Tokenizer and tokenized splits: from the cache when present, else built and cached.

        Each step runs inside `with stage("<what it does>")`: a hook for measuring them one at a time
        (scripts/scale_report.py), named by what the step will do (load or build). Before SentencePiece
        trains, every split's files are opened (Parquet/JSON converted to Arrow), so that a bad
        validation or test file fails before the long step, not after it. A cache that cannot be
        written (read-only, full, not ours) ends in one line naming data.cache_dir and the fix.
        """
        try:
            self._build(stage)
        except OSError as e:
            faults = (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG)
            elsewhere = e.filename and not Path(e.filename).resolve().is_relative_to(self.cache_dir.resolve())
            if e.errno not in faults or elsewhere:  # e.g. a corpus file that cannot be read: not the cache's
                raise
            where = next(p for p in (self.cache_dir, *self.cache_dir.parents) if p.exists())
            free = shutil.disk_usage(where).free / 2**20
            raise InputError(
                f"data.cache_dir={self.cache_dir}: the data cache cannot be written there ({e.strerror}: "
                f"{e.filename or where}; {free:,.0f} MiB free). Point data.cache_dir at a writable folder with "
                "room for the tokenized corpus (a few GB for WMT14), or free space there"
            ) from None

    def _build(self, stage: Callable[[str], AbstractContextManager]) -> None:
        for folder in ("sentencepiece", "corpus"):  # what a killed build left half-written
            for path in remove_stale_temporaries(self.cache_dir / folder):
                log.info("removed %s (an unfinished cache write of a killed run)", path)
        with stage("hash the raw files, open the splits"):
            self.raw = {split: self.corpus.load(split) for split in SPLITS}
        tokenizer_cached = (self.tokenizer_directory(self.raw["train"]) / MODEL_FILE).exists()
        if not tokenizer_cached:
            with stage("datasets: convert the files to Arrow"):
                for raw in self.raw.values():
                    raw.open()
        with stage("SentencePiece: load" if tokenizer_cached else "SentencePiece: read, sample, train"):
            self.tokenizer = self.load_or_train_tokenizer(self.raw["train"])
        for split in SPLITS:
            how = "loaded from cache" if self.split_directory(self.raw[split]).exists() else "tokenized"
            with stage(f"{split}: {how}"):
                self.splits[split] = self.load_or_tokenize(self.raw[split])

    def build_when_cached(self, poll_seconds: float = 5.0, timeout_seconds: float = 6 * 3600) -> None:
        """build() once another process (rank 0 of a launched job) has written every cache: the other
        ranks wait instead of each training SentencePiece and tokenizing the corpus themselves."""
        # A warning: ranks other than 0 log nothing below (training.logs), and this is where a rank's start goes.
        log.warning("rank %d: reading the data caches that rank 0 builds under %s", launched_rank(), self.cache_dir)
        raw = {split: self.corpus.load(split) for split in SPLITS}
        waited = 0.0
        while True:
            if self.caches_ready(raw):
                break
            if waited >= timeout_seconds:
                raise InputError(
                    f"waited {waited / 3600:.1f} h for rank 0 to write the data caches under {self.cache_dir}; "
                    "did it fail? (several nodes need data.cache_dir on a shared file system)"
                )
            time.sleep(poll_seconds)
            waited += poll_seconds
        self.build()

    def caches_ready(self, raw: dict[str, RawSplit]) -> bool:
        """Every cache of `raw` written and readable (rank 0 may still be building or repairing one)."""
        try:
            self.tokenizer = Tokenizer(self.tokenizer_directory(raw["train"]) / MODEL_FILE)
            for split in raw.values():
                open_cache(self.split_directory(split))
        except (UserError, DamagedCache, FileNotFoundError):
            return False
        return True

    def tokenizer_directory(self, train: RawSplit) -> Path:
        key = cache_key(
            data=train.fingerprint,
            langs=[self.corpus.src_lang, self.corpus.tgt_lang],
            vocab=self.vocab_size,
            max_sentences=self.spm_max_sentences,
            seed=self.seed,
            sampling=2,  # SentencePiece's reservoir sample of the streamed sentences
        )
        return self.cache_dir / "sentencepiece" / key

    def load_or_train_tokenizer(self, train: RawSplit) -> Tokenizer:
        directory = self.tokenizer_directory(train)
        if (directory / MODEL_FILE).exists():
            try:
                return Tokenizer(directory / MODEL_FILE)
            except InputError as e:  # damaged after it was written (a disk fault, a stray copy): build it again
                log.warning("damaged cache, built again: %s", e)
                shutil.rmtree(directory)
        sentences = self.sentences(train)
        first = next(sentences, None)
        if first is None:
            raise InputError(
                f"{train.describe()}: no training pair with text on both sides; check data.path (and data.text_files)"
            )
        return train_tokenizer(
            itertools.chain([first], sentences), directory, self.vocab_size, self.spm_max_sentences, self.seed
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

    def split_directory(self, raw: RawSplit) -> Path:
        """Where one split's token ids are cached: keyed by its text, the tokenizer and the cleaning rules."""
        filtered = raw.split == "train"  # validation and test sets are kept whole, as published
        key = cache_key(
            data=raw.fingerprint,
            tokenizer=hashlib.sha256(self.tokenizer.proto).hexdigest(),
            langs=[self.corpus.src_lang, self.corpus.tgt_lang],
            max_len=self.max_len if filtered else None,
            ratio=self.max_len_ratio if filtered else None,
            layout=3,  # pairs.arrow with columns src, tgt, row (+ src_text, tgt_text)
        )
        return self.cache_dir / "corpus" / f"{self.corpus.name}-{raw.split}-{key}"

    def load_or_tokenize(self, raw: RawSplit) -> TokenizedSplit:
        """One split's token ids from its cache, written first if missing; one log line per split."""
        split, filtered = raw.split, raw.split == "train"
        directory = self.split_directory(raw)
        start, cached, tokenized = time.perf_counter(), directory.exists(), None
        if cached:
            try:
                tokenized = open_cache(directory)
            except DamagedCache as e:  # damaged after it was written: tokenized again
                log.warning("damaged cache, built again: %s", e)
                shutil.rmtree(directory)
                cached = False
        dropped = "" if cached else self.write_tokenized(raw, directory, filtered)
        tokenized = tokenized or open_cache(directory)
        how = "loaded from cache" if cached else "tokenized"
        self.timings[split] = (how, time.perf_counter() - start)
        log.info(
            "%s %s: %s pairs %s in %.2f s%s (%s)",
            self.corpus.name,
            split,
            f"{len(tokenized):,}",
            how,
            self.timings[split][1],
            dropped,
            directory,
        )
        return tokenized

    def write_tokenized(self, raw: RawSplit, directory: Path, filtered: bool) -> str:
        """Clean, tokenize and cache one split as an Arrow file, chunk by chunk (memory follows the chunk,
        not the corpus); returns what was dropped, for the log. Each pair keeps its row in the raw split
        (`row`), so that later checks can name the line; validation and test keep their text for BLEU."""
        with_text = raw.split != "train"
        schema = pa.schema(
            [("src", pa.list_(pa.int32())), ("tgt", pa.list_(pa.int32())), ("row", pa.int64())]
            + ([("src_text", pa.string()), ("tgt_text", pa.string())] if with_text else [])
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
                    batch = self.tokenize_chunk(raw_src, raw_tgt, first_row, filtered, with_text, drops)
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
        self, raw_src: list[str], raw_tgt: list[str], first_row: int, filtered: bool, with_text: bool, drops: Counter
    ) -> list[pa.Array]:
        """The cache's columns for consecutive raw rows from `first_row`; counts what it drops in `drops`."""
        with self.watch("cleaning"):
            src, tgt, rows = drop_empty(raw_src, raw_tgt)
        drops["empty side"] += len(raw_src) - len(src)
        rows = np.asarray(rows, dtype=np.int64) + first_row
        with self.watch("tokenizing"):
            (src_ids, src_lens), (tgt_ids, tgt_lens) = self.tokenizer.encode_flat(src), self.tokenizer.encode_flat(tgt)
        keep = np.ones(len(rows), dtype=bool)
        if filtered:
            rule = length_filter(src_lens, tgt_lens, self.max_len, self.max_len_ratio)
            keep = rule["keep"]
            drops.update(rule["drops"])
        columns = [ragged(src_ids, src_lens, keep), ragged(tgt_ids, tgt_lens, keep), pa.array(rows[keep])]
        if with_text:
            columns += [pa.array(list(itertools.compress(side, keep)), pa.string()) for side in (src, tgt)]
        return columns

    def check_lengths(self, max_positions: int) -> None:
        """Every pair of every split fits the model's position table (with EOS, or BOS for the decoder
        input): found now, not at the first validation after hours of training."""
        for split, data in self.splits.items():
            longest = np.maximum(data.src_lens, data.tgt_lens) + 1
            too_long = np.flatnonzero(longest > max_positions)
            if not len(too_long):
                continue
            i = too_long[0]
            side = "source" if data.src_lens[i] >= data.tgt_lens[i] else "target"
            fix = (
                f"lower data.max_len to {max_positions - 1} or less (longer training pairs are dropped)"
                if split == "train"
                else "shorten or remove it (validation and test sets are used whole)"
            )
            raise InputError(
                f"{self.raw[split].describe(int(data.rows[i]))}: the {side} sentence has {longest[i] - 1} tokens, "
                f"more than model.max_positions={max_positions} allows with EOS ({len(too_long) - 1} more such "
                f"pairs in {split}); {fix}, or raise model.max_positions"
            )

    # -- batching

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def longest_training_pair(self) -> int:
        """Tokens of the longer side of the longest training pair, with EOS (BOS): data.max_tokens=auto's probe."""
        split = self.splits["train"]
        return int(max(split.src_lens.max(), split.tgt_lens.max())) + 1

    def known_max_tokens(self) -> int:
        """max_tokens, or max_tokens_fallback while auto is unresolved: the probe (training/batch_fit.py) sets
        max_tokens in the processes that train, not in ddp_spawn's main process nor in the data tools."""
        return self.max_tokens_fallback if self.max_tokens == "auto" else self.max_tokens

    def update_shape(self, world_size: int) -> tuple[int, int]:
        """(training tokens per micro-batch and device, micro-batches per update): batching.update_shape."""
        return update_shape(self.tokens_per_update, self.known_max_tokens(), world_size)

    def sampler(self, split: str, shuffle: bool, whole: bool = False) -> TokenBucketSampler:
        """Token buckets of a split (this rank's share; `whole`: all of it). A training pair longer than
        max_tokens (with EOS/BOS) is left out, and counted in the log; a validation or test sentence that
        long is kept, in a batch of its own."""
        rank, world = (0, 1) if whole else self._rank_world()
        data = self.splits[split]
        # training: the per-device share of the update; validation and test: max_tokens
        max_tokens = self.update_shape(world)[0] if split == "train" else self.known_max_tokens()
        fits = np.maximum(data.src_lens, data.tgt_lens) + 1 <= max_tokens
        indices = np.flatnonzero(fits) if split == "train" else None
        if not fits.all():
            if split == "train" and not fits.any():
                raise InputError(
                    f"no training pair fits {max_tokens} tokens per batch (from data.max_tokens, "
                    f"data.tokens_per_update and {world} device(s); the shortest needs "
                    f"{int(np.maximum(data.src_lens, data.tgt_lens).min()) + 1}); raise data.max_tokens"
                )
            (log.info if split == "train" else log.warning)(
                "%s: %s pairs are longer than a batch's %d tokens: %s",
                split,
                f"{int((~fits).sum()):,}",
                max_tokens,
                "left out of training" if split == "train" else "each is batched alone, over the limit",
            )
        return TokenBucketSampler(
            data.src_lens, data.tgt_lens, max_tokens, shuffle, self.seed, rank, world, indices=indices
        )

    def _loader(self, split: str, sampler: TokenBucketSampler) -> DataLoader:
        data = self.splits[split]
        # Validation and test batches carry their raw references: the module scores BLEU from batches alone.
        collate_fn = collate if split == "train" else partial(collate, references=data.texts("tgt_text"))
        kwargs = dict(
            batch_sampler=sampler,
            collate_fn=collate_fn,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            # Each iter() over a loader draws a seed for its workers; from the global generator, that draw
            # would shift dropout's random numbers by whether a validation or an epoch start came between
            # a checkpoint and the next update, so a resumed run would not match. Collation draws nothing.
            generator=torch.Generator().manual_seed(self.seed),
            worker_init_fn=die_with_parent,
            pin_memory=self._on_cuda(),
        )
        if split == "train":
            return ResumableLoader(data, batches_done=self._batches_done, **kwargs)
        return DataLoader(data, **kwargs)

    def _on_cuda(self) -> bool:
        """Whether the Trainer's device is a GPU: its loaders then pin their batches (page-locked host memory),
        which Lightning copies to the GPU without blocking (non_blocking=True). On a CPU pinning only costs."""
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"

    def _batches_done(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        self.train_sampler = self.sampler("train", shuffle=True)
        return self._loader("train", self.train_sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", self.sampler("validation", shuffle=False))

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.sampler("test", shuffle=False))

    def whole_split_loader(self, split: str) -> DataLoader:
        """Every batch of a validation or test split, for one process (the end-of-run evaluation)."""
        return self._loader(split, self.sampler(split, shuffle=False, whole=True))


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


class ResumableLoader(DataLoader):
    """The training loader, resumable inside an epoch: Lightning keeps the state_dict of such a loader
    in every checkpoint and hands it back on resume (and warns about loaders without one).

    The state is the epoch and the number of its batches that training has processed. The sampler
    itself runs ahead of training (Lightning and the workers prefetch), so that number comes from
    the trainer (`batches_done`), not from how far the sampler got.
    """

    def __init__(self, *args, batches_done: Callable[[], int], **kwargs):
        super().__init__(*args, **kwargs)
        self.batches_done = batches_done

    def state_dict(self) -> dict:
        """Where the next batch comes from. After an epoch's last batch that is the next epoch: with worker
        processes the loader's iterator is created (and starts prefetching) before Lightning calls
        set_epoch for the new epoch, so the restored state must already name it."""
        epoch, done = self.batch_sampler.epoch, self.batches_done()
        return (
            {"epoch": epoch + 1, "position": 0}
            if done >= len(self.batch_sampler)
            else {"epoch": epoch, "position": done}
        )

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)
