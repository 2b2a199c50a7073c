"""The LightningDataModule: the data settings, the splits checked against the model, Lightning's loaders."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from transformer_mt.data.batching import TokenBucketSampler, TokenizedSplit, collate, update_shape
from transformer_mt.data.cache import Stage, TokenCache
from transformer_mt.data.corpus import Corpus, RawSplit
from transformer_mt.errors import InputError
from transformer_mt.stops import batches_done, die_with_parent
from transformer_mt.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class TranslationDataModule(L.LightningDataModule):
    """A data config's keys (conf/data/): `name` and `corpus` are the Corpus's (corpus.py), the others below."""

    def __init__(
        self,
        name: str,
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
        **corpus,
    ):
        super().__init__()
        if max_tokens != "auto" and not (isinstance(max_tokens, int) and max_tokens >= 1):  # a number or auto
            raise InputError(
                f"data.max_tokens={max_tokens}: must be a positive whole number or auto (the largest batch the "
                "device fits)"
            )
        for key, value in dict(max_tokens_fallback=max_tokens_fallback, vocab_size=vocab_size, max_len=max_len).items():
            if value < 1:  # their types are settings.DataSettings'
                raise InputError(f"data.{key}={value}: must be a positive whole number")
        if tokens_per_update is not None and tokens_per_update < 1:
            raise InputError(f"data.tokens_per_update={tokens_per_update}: a positive number of tokens, or null")
        self.corpus = Corpus.from_config({}, name=name, **corpus)  # an unknown key is a TypeError
        self.cache_dir = Path(cache_dir).expanduser()
        settings = (vocab_size, spm_max_sentences, max_len, max_len_ratio, seed)
        self.cache = TokenCache(self.corpus, self.cache_dir, *settings)
        self.max_tokens, self.max_tokens_fallback = max_tokens, max_tokens_fallback
        self.tokens_per_update, self.num_workers, self.seed = tokens_per_update, num_workers, seed
        self.tokenizer: Tokenizer | None = None
        self.raw: dict[str, RawSplit] = {}
        self.splits: dict[str, TokenizedSplit] = {}
        self.train_sampler: TokenBucketSampler | None = None
        self.update_tokens: int | None = None  # padded tokens per side of an update (training/batch_fit.shape_updates)

    def setup(self, stage: str | None = None) -> None:
        if not self.splits:  # train.py builds before the Trainer exists (the vocabulary size sizes the model)
            self.build()

    def build(self, stage: Stage = nullcontext) -> None:
        """Tokenizer and tokenized splits, cached (cache.py); each step inside `with stage(<its name>)`."""
        self.raw, self.tokenizer, self.splits = self.cache.build(stage)

    def check_lengths(self, max_positions: int) -> None:
        """Every pair fits the model's position table with EOS (BOS): found now, not at the first validation."""
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

    def longest_training_pair(self) -> int:
        """Tokens of the longer side of the longest training pair, with EOS (BOS): data.max_tokens=auto's probe."""
        split = self.splits["train"]
        return int(max(split.src_lens.max(), split.tgt_lens.max())) + 1

    def known_max_tokens(self) -> int:
        """max_tokens, or max_tokens_fallback until auto's probe (training/batch_fit.py) sets it."""
        return self.max_tokens_fallback if self.max_tokens == "auto" else self.max_tokens

    def update_shape(self, world_size: int) -> tuple[int, int]:
        """(training tokens per micro-batch and device, micro-batches per update)."""
        return update_shape(self.tokens_per_update, self.known_max_tokens(), world_size)

    def sampler(self, split: str, shuffle: bool) -> TokenBucketSampler:
        """This rank's buckets: a pair over max_tokens is left out of training, batched alone in validation and test."""
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        data = self.splits[split]
        max_tokens = self.update_shape(world)[0] if split == "train" else self.known_max_tokens()
        fits = np.maximum(data.src_lens, data.tgt_lens) + 1 <= max_tokens
        if not fits.all():
            if split == "train" and not fits.any():
                raise InputError(
                    f"no training pair fits {max_tokens} tokens per batch (from data.max_tokens, "
                    f"data.tokens_per_update and {world} device(s); the shortest needs "
                    f"{int(np.maximum(data.src_lens, data.tgt_lens).min()) + 1}); raise data.max_tokens"
                )
            (log.info if split == "train" else log.warning)(
                f"{split}: {int((~fits).sum()):,} pairs are longer than a batch's {max_tokens} tokens: "
                + ("left out of training" if split == "train" else "each is batched alone, over the limit")
            )
        indices = np.flatnonzero(fits) if split == "train" else None
        return TokenBucketSampler(data.src_lens, data.tgt_lens, max_tokens, shuffle, self.seed, rank, world, indices)

    def loader(self, split: str, shuffle: bool = False) -> DataLoader:
        sampler = self.sampler(split, shuffle)
        data = self.splits[split]
        # Validation and test batches carry their raw references: the module scores BLEU from batches alone.
        kwargs = dict(
            batch_sampler=sampler,
            collate_fn=collate if split == "train" else partial(collate, references=data.dataset["tgt_text"]),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            # the workers' seed, drawn at each iter(), not from the global generator: a resumed run's dropout matches
            generator=torch.Generator().manual_seed(self.seed),
            worker_init_fn=die_with_parent,
            pin_memory=self.trainer is not None and self.trainer.strategy.root_device.type == "cuda",  # GPU copies
        )
        if split != "train":
            return DataLoader(data, **kwargs)
        self.train_sampler = sampler
        return ResumableLoader(data, batches_done=lambda: batches_done(self.trainer), **kwargs)

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("validation")


class ResumableLoader(DataLoader):
    """The training loader, resumable inside an epoch at the batches training processed (the sampler runs ahead)."""

    def __init__(self, *args, batches_done: Callable[[], int], **kwargs):
        super().__init__(*args, **kwargs)
        self.batches_done = batches_done

    def state_dict(self) -> dict:
        """Where the next batch comes from (after an epoch's last: the next epoch, before Lightning's set_epoch)."""
        epoch, done = self.batch_sampler.epoch, self.batches_done()
        if done >= len(self.batch_sampler):
            epoch, done = epoch + 1, 0
        return {"epoch": epoch, "position": done}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)
