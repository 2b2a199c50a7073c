"""Parallel corpora -> shared SentencePiece ids (cached) -> token-bucketed batches.

Sources: the Hugging Face Hub through `datasets` (WMT14, Multi30k), a local copy of the
Hub's layout, or aligned plain-text files. Splits are always named train/validation/test.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from transformer_mt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, cache_key, train_tokenizer

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")


# ---------------------------------------------------------------- reading raw text


def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 file, split on '\\n' only (str.splitlines() also splits on U+0085)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}, line {line}: invalid UTF-8 ({e.reason} at byte {e.start}); "
            "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line, it does not start a new one
    return lines


def read_text_pair(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise ValueError(
            f"misaligned parallel files: {src_path} has {len(src)} lines but {tgt_path} has "
            f"{len(tgt)}; they must be aligned line by line"
        )
    return src, tgt


def hash_files(paths: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


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

    def text_paths(self, split: str) -> tuple[Path, Path] | None:
        if self.path is None or split not in self.text_files:
            return None
        prefix = Path(self.path).expanduser() / self.text_files[split]
        return Path(f"{prefix}.{self.src_lang}"), Path(f"{prefix}.{self.tgt_lang}")

    def local_files(self, split: str) -> list[Path]:
        """Parquet/JSON Lines files of `split` in the Hub's layout: [<config>/]<split>[-*].<ext>."""
        root = Path(self.path).expanduser()
        for folder in [root / self.hub_config, root] if self.hub_config else [root]:
            for ext in ("parquet", "jsonl", "json"):
                found = sorted(glob.glob(str(folder / f"{split}-*.{ext}")) + glob.glob(str(folder / f"{split}.{ext}")))
                if found:
                    return [Path(f) for f in found]
        return []

    def load(self, split: str) -> RawSplit:
        if self.path is None:
            if not self.hub_name:
                raise ValueError(f"data '{self.name}': set data.path to a local copy (no Hub name is configured)")
            ds = datasets.load_dataset(self.hub_name, self.hub_config, split=split)
            return RawSplit(self, split, ds._fingerprint, dataset=ds)
        root = Path(self.path).expanduser()
        if not root.exists():
            raise FileNotFoundError(f"data '{self.name}': data.path={root} does not exist")
        pair = self.text_paths(split)
        if pair and (pair[0].exists() or pair[1].exists()):
            for p in pair:
                if not p.is_file():
                    raise FileNotFoundError(f"data '{self.name}', split {split}: missing {p} (its pair is {pair})")
            return RawSplit(self, split, hash_files(list(pair)), text_pair=pair)
        if (root / "dataset_dict.json").exists():  # DatasetDict.save_to_disk
            ds = datasets.load_from_disk(str(root))[split]
            return RawSplit(self, split, ds._fingerprint, dataset=ds)
        files = self.local_files(split)
        if not files:
            looked = [str(p) for p in filter(None, [self.text_paths(split)])]
            raise FileNotFoundError(
                f"data '{self.name}': no {split} split under {root}; looked for "
                f"{' and '.join(looked) + ', ' if looked else ''}{split}-*.parquet / {split}.jsonl "
                f"(optionally under {self.hub_config}/) and a save_to_disk dataset_dict.json. "
                "scripts/make_wmt14_layout.py builds this layout from aligned text files."
            )
        builder = "parquet" if files[0].suffix == ".parquet" else "json"
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
        return RawSplit(self, split, hash_files(files), dataset=ds)


@dataclass
class RawSplit:
    """One split before tokenization; its fingerprint identifies the content for caching."""

    corpus: Corpus
    split: str
    fingerprint: str
    dataset: datasets.Dataset | None = None
    text_pair: tuple[Path, Path] | None = None

    def pairs(self) -> tuple[list[str], list[str]]:
        if self.text_pair is not None:
            return read_text_pair(*self.text_pair)
        src, tgt = self.corpus.src_lang, self.corpus.tgt_lang
        ds = self.dataset
        if "translation" in ds.column_names:  # the Hub's wmt14 schema
            rows = ds["translation"]
            try:
                return [r[src] for r in rows], [r[tgt] for r in rows]
            except KeyError as e:
                raise ValueError(f"data '{self.corpus.name}' {self.split}: no language {e} in 'translation'") from None
        missing = [lang for lang in (src, tgt) if lang not in ds.column_names]
        if missing:
            raise ValueError(
                f"data '{self.corpus.name}' {self.split}: columns {ds.column_names} have neither "
                f"'translation' nor {missing}"
            )
        return ds[src], ds[tgt]


# ---------------------------------------------------------------- cleaning


def drop_empty(src: list[str], tgt: list[str]) -> tuple[list[str], list[str], int]:
    """Strip both sides; drop pairs where either side is empty. Returns (src, tgt, dropped)."""
    kept = [(s, t) for s, t in zip((s.strip() for s in src), (t.strip() for t in tgt)) if s and t]
    return [s for s, _ in kept], [t for _, t in kept], len(src) - len(kept)


def length_filter(src_lens: np.ndarray, tgt_lens: np.ndarray, max_len: int, max_ratio: float | None) -> dict:
    """Boolean keep-mask and per-rule drop counts for token lengths (without BOS/EOS)."""
    too_long = (src_lens > max_len) | (tgt_lens > max_len)
    keep = ~too_long
    drops = {f"longer than {max_len} tokens": int(too_long.sum())}
    if max_ratio is not None:
        ratio = np.maximum(src_lens, tgt_lens) / np.maximum(np.minimum(src_lens, tgt_lens), 1)
        bad_ratio = keep & (ratio > max_ratio)
        keep &= ~bad_ratio
        drops[f"length ratio above {max_ratio}"] = int(bad_ratio.sum())
    return {"keep": keep, "drops": drops}


# ---------------------------------------------------------------- tokenized splits


class TokenizedSplit(Dataset):
    """Token ids of one split, read straight from the cached Arrow columns (memory-mapped)."""

    def __init__(self, ds: datasets.Dataset):
        self.dataset = ds
        table = ds.with_format("arrow")[:]  # the whole split as one Arrow table, no copy
        src, tgt = table.column("src").combine_chunks(), table.column("tgt").combine_chunks()
        self.src_offsets, self.src_values = src.offsets.to_numpy(), src.values.to_numpy()
        self.tgt_offsets, self.tgt_values = tgt.offsets.to_numpy(), tgt.values.to_numpy()
        self.src_lens = np.diff(self.src_offsets)
        self.tgt_lens = np.diff(self.tgt_offsets)

    def __len__(self) -> int:
        return len(self.src_lens)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        s0, s1 = self.src_offsets[i], self.src_offsets[i + 1]
        t0, t1 = self.tgt_offsets[i], self.tgt_offsets[i + 1]
        return self.src_values[s0:s1], self.tgt_values[t0:t1], i

    def texts(self, column: str) -> list[str]:
        """Raw text of the validation/test split ('src_text' or 'tgt_text'), for BLEU."""
        return self.dataset[column]


def collate(items: list[tuple[np.ndarray, np.ndarray, int]]) -> dict[str, torch.Tensor]:
    """Right-pad (source, target, index) items. src = x + EOS; tgt_in = BOS + y; tgt_out = y + EOS
    (§3: the decoder input is the output shifted right); index = position in the split."""
    B = len(items)
    S = max(len(s) for s, _, _ in items) + 1
    T = max(len(t) for _, t, _ in items) + 1
    src = np.full((B, S), PAD_ID, dtype=np.int64)
    tgt_in = np.full((B, T), PAD_ID, dtype=np.int64)
    tgt_out = np.full((B, T), PAD_ID, dtype=np.int64)
    for row, (s, t, _) in enumerate(items):
        src[row, : len(s)], src[row, len(s)] = s, EOS_ID
        tgt_in[row, 0], tgt_in[row, 1 : len(t) + 1] = BOS_ID, t
        tgt_out[row, : len(t)], tgt_out[row, len(t)] = t, EOS_ID
    return {"src": torch.from_numpy(src), "tgt_in": torch.from_numpy(tgt_in), "tgt_out": torch.from_numpy(tgt_out),
            "index": torch.tensor([i for _, _, i in items])}


# ---------------------------------------------------------------- token-bucket batching


class TokenBucketSampler(Sampler[list[int]]):
    """Batches of at most `max_tokens` padded tokens per side, sentences grouped by length.

    Each epoch: shuffle from seed + epoch, stable-sort by length (longer side, then total), fill
    batches greedily, shuffle the batch order. With several ranks, the batches are dealt
    round-robin, after splitting the largest ones until every rank gets the same number.
    Lengths count the EOS (source) and BOS/EOS (target) token that collate() adds.
    """

    def __init__(
        self,
        src_lens: np.ndarray,
        tgt_lens: np.ndarray,
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if len(src_lens) == 0:
            raise ValueError("cannot batch an empty split")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.src_lens = np.asarray(src_lens, dtype=np.int64) + 1
        self.tgt_lens = np.asarray(tgt_lens, dtype=np.int64) + 1
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0  # position: batches of this epoch already handed out
        self._cache: tuple[int, list[np.ndarray]] | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def all_batches(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of `epoch`, in order; rank r takes items r, r + world, ..."""
        rng = np.random.default_rng(self.seed + epoch)
        order = rng.permutation(len(self.src_lens)) if self.shuffle else np.arange(len(self.src_lens))
        # Sort by the longer side (what a batch pays for), then by the total; stable, so ties stay shuffled.
        src, tgt = self.src_lens[order], self.tgt_lens[order]
        order = order[np.lexsort((src + tgt, np.maximum(src, tgt)))]
        batches, start, max_s, max_t = [], 0, 0, 0
        src_lens, tgt_lens = self.src_lens[order].tolist(), self.tgt_lens[order].tolist()
        for i, (s, t) in enumerate(zip(src_lens, tgt_lens)):
            new_s, new_t = max(max_s, s), max(max_t, t)
            if i > start and (i - start + 1) * max(new_s, new_t) > self.max_tokens:
                batches.append(order[start:i])
                start, new_s, new_t = i, s, t
            max_s, max_t = new_s, new_t
        batches.append(order[start:])
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        while len(batches) % self.world_size:  # equal shares: split the largest batch in two
            largest = max(range(len(batches)), key=lambda i: len(batches[i]))
            if len(batches[largest]) < 2:
                raise ValueError(f"{len(self.src_lens)} sentences cannot fill {self.world_size} ranks")
            half = len(batches[largest]) // 2
            batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
        return batches

    def rank_batches(self) -> list[np.ndarray]:
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, self.all_batches(self.epoch)[self.rank :: self.world_size])
        return self._cache[1]

    def __len__(self) -> int:
        return len(self.rank_batches())

    def __iter__(self):
        batches = self.rank_batches()
        # A restored position applies to one pass; a finished pass starts over. The epoch only
        # changes through set_epoch() (Lightning calls it every epoch), as with DistributedSampler.
        start = self.position if self.position < len(batches) else 0
        for i in range(start, len(batches)):
            self.position = i + 1
            yield batches[i].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def accumulation_steps(tokens_per_update: int | None, max_tokens: int, world_size: int) -> int:
    """Micro-batches per optimizer update so that max_tokens x world x steps >= tokens_per_update."""
    if not tokens_per_update:
        return 1
    return max(1, math.ceil(tokens_per_update / (max_tokens * world_size)))


def padding_efficiency(sampler: TokenBucketSampler) -> float:
    """Real tokens / padded tokens over both sides of every batch of the current epoch."""
    real = padded = 0
    for batch in sampler.rank_batches():
        s, t = sampler.src_lens[batch], sampler.tgt_lens[batch]
        real += s.sum() + t.sum()
        padded += len(batch) * (s.max() + t.max())
    return float(real / padded)


# ---------------------------------------------------------------- the DataModule


class TranslationDataModule(L.LightningDataModule):
    """Loads a corpus, trains/loads the shared SentencePiece model, caches token ids, batches."""

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
        max_tokens: int = 4096,
        tokens_per_update: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        cache_dir: str = "~/.cache/transformer_mt",
    ):
        super().__init__()
        self.corpus = Corpus(name, src_lang, tgt_lang, path, hub_name, hub_config, dict(text_files or {}))
        self.vocab_size, self.spm_max_sentences = vocab_size, spm_max_sentences
        self.max_len, self.max_len_ratio = max_len, max_len_ratio
        self.max_tokens, self.tokens_per_update = max_tokens, tokens_per_update
        self.num_workers, self.seed = num_workers, seed
        self.cache_dir = Path(os.path.expanduser(cache_dir))
        self.tokenizer: Tokenizer | None = None
        self.splits: dict[str, TokenizedSplit] = {}
        self.train_sampler: TokenBucketSampler | None = None
        self._sampler_state: dict | None = None
        self.timings: dict[str, tuple[str, float]] = {}  # split -> (how, seconds)

    # -- building and caching

    def prepare_data(self) -> None:
        self.build()

    def setup(self, stage: str | None = None) -> None:
        if not self.splits:
            self.build()

    def build(self) -> None:
        """Tokenizer and tokenized splits: from the cache when present, else built and cached."""
        raw = {split: self.corpus.load(split) for split in SPLITS}
        self.tokenizer = self._tokenizer(raw["train"])
        self.splits = {split: self._tokenized(raw[split]) for split in SPLITS}

    def _tokenizer(self, train: RawSplit) -> Tokenizer:
        key = cache_key(
            data=train.fingerprint, langs=[self.corpus.src_lang, self.corpus.tgt_lang], vocab=self.vocab_size,
            max_sentences=self.spm_max_sentences, seed=self.seed,
        )
        directory = self.cache_dir / "sentencepiece" / key
        if (directory / "sentencepiece.model").exists():
            return Tokenizer(directory / "sentencepiece.model")
        src, tgt, _ = drop_empty(*train.pairs())
        return train_tokenizer([src, tgt], directory, self.vocab_size, self.spm_max_sentences, self.seed)

    def _tokenized(self, raw: RawSplit) -> TokenizedSplit:
        split = raw.split
        filtered = split == "train"  # validation and test sets are kept whole, as published
        key = cache_key(
            data=raw.fingerprint, tokenizer=hashlib.sha256(self.tokenizer.proto).hexdigest(),
            langs=[self.corpus.src_lang, self.corpus.tgt_lang],
            max_len=self.max_len if filtered else None, ratio=self.max_len_ratio if filtered else None,
        )
        directory = self.cache_dir / "corpus" / f"{self.corpus.name}-{split}-{key}"
        start, cached = time.perf_counter(), directory.exists()
        if not cached:
            self._tokenize_to(raw, directory, filtered)
        tokenized = TokenizedSplit(datasets.load_from_disk(str(directory)))
        how = "loaded from cache" if cached else "tokenized"
        self.timings[split] = (how, time.perf_counter() - start)
        log.info("%s %s: %d pairs %s in %.2f s (%s)", self.corpus.name, split, len(tokenized), how,
                 self.timings[split][1], directory)
        return tokenized

    def _tokenize_to(self, raw: RawSplit, directory: Path, filtered: bool) -> None:
        name, split = self.corpus.name, raw.split
        src, tgt, n_empty = drop_empty(*raw.pairs())
        src_ids, tgt_ids = [], []
        chunk = 20_000
        for i in tqdm(range(0, len(src), chunk), desc=f"tokenizing {name} {split}", unit="chunk"):
            src_ids += self.tokenizer.encode(src[i : i + chunk])
            tgt_ids += self.tokenizer.encode(tgt[i : i + chunk])
        drops = {"empty side": n_empty}
        if filtered:
            rule = length_filter(np.array([len(x) for x in src_ids]), np.array([len(x) for x in tgt_ids]),
                                 self.max_len, self.max_len_ratio)
            keep = rule["keep"].tolist()
            src_ids = [x for x, k in zip(src_ids, keep) if k]
            tgt_ids = [x for x, k in zip(tgt_ids, keep) if k]
            src = [x for x, k in zip(src, keep) if k]
            tgt = [x for x, k in zip(tgt, keep) if k]
            drops.update(rule["drops"])
        log.info("%s %s: kept %d pairs; dropped %s", name, split, len(src_ids),
                 ", ".join(f"{n} ({why})" for why, n in drops.items()))
        if not src_ids:
            raise ValueError(
                f"data '{name}' split {split} is empty after cleaning (dropped: {drops}); "
                "check data.path and data.max_len"
            )
        columns = {"src": src_ids, "tgt": tgt_ids}
        if split != "train":  # references for BLEU
            columns.update(src_text=src, tgt_text=tgt)
        features = datasets.Features({
            "src": datasets.Sequence(datasets.Value("int32")), "tgt": datasets.Sequence(datasets.Value("int32")),
            **({"src_text": datasets.Value("string"), "tgt_text": datasets.Value("string")} if split != "train" else {}),
        })
        tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(tmp))
        try:
            os.replace(tmp, directory)  # atomic: a crash never leaves a half-written cache
        except OSError:
            if not directory.exists():
                raise
            shutil.rmtree(tmp)  # another process (rank) wrote the same cache first

    # -- batching

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def accumulation(self, world_size: int) -> int:
        return accumulation_steps(self.tokens_per_update, self.max_tokens, world_size)

    def sampler(self, split: str, shuffle: bool) -> TokenBucketSampler:
        rank, world = self._rank_world()
        data = self.splits[split]
        return TokenBucketSampler(data.src_lens, data.tgt_lens, self.max_tokens, shuffle, self.seed, rank, world)

    def _loader(self, split: str, sampler: TokenBucketSampler) -> DataLoader:
        return DataLoader(self.splits[split], batch_sampler=sampler, collate_fn=collate,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        self.train_sampler = self.sampler("train", shuffle=True)
        if self._sampler_state is not None:
            self.train_sampler.load_state_dict(self._sampler_state)
            self._sampler_state = None
        return self._loader("train", self.train_sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", self.sampler("validation", shuffle=False))

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.sampler("test", shuffle=False))

    def state_dict(self) -> dict:
        """Where the training epoch stands, for resuming. The sampler itself runs ahead of
        training (loaders prefetch), so the position is the trainer's count of processed batches."""
        if self.train_sampler is None:
            return {}
        state = self.train_sampler.state_dict()
        if self.trainer is not None:
            state = {"epoch": self.trainer.current_epoch,
                     "position": self.trainer.fit_loop.epoch_loop.batch_progress.current.processed}
        return {"train_sampler": state}

    def load_state_dict(self, state: dict) -> None:
        self._sampler_state = state.get("train_sampler")
