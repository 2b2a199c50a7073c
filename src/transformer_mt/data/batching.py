"""Token ids of a split -> padded batches of at most `max_tokens` tokens per side."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from transformer_mt.errors import InputError
from transformer_mt.tokenizer import BOS_ID, EOS_ID, padded, source_batch

if TYPE_CHECKING:
    import datasets


class TokenizedSplit(Dataset):
    """One split's ids in the cache's Arrow chunks, memory-mapped, never copied (WMT14's are ~1 GB)."""

    def __init__(self, ds: datasets.Dataset):
        self.dataset = ds
        table = ds.with_format("arrow")[:]  # the whole split as one Arrow table, no copy
        self.src_chunks = [(c.offsets.to_numpy(), c.values.to_numpy()) for c in table.column("src").chunks]
        self.tgt_chunks = [(c.offsets.to_numpy(), c.values.to_numpy()) for c in table.column("tgt").chunks]
        self.src_lens = np.concatenate([np.diff(offsets) for offsets, _ in self.src_chunks])
        self.tgt_lens = np.concatenate([np.diff(offsets) for offsets, _ in self.tgt_chunks])
        # where each chunk starts (the same for both columns: they were written together)
        self.chunk_starts = np.cumsum([0] + [len(offsets) - 1 for offsets, _ in self.src_chunks])
        self.rows = table.column("row").to_numpy()  # where each pair is in the raw split (from 0)

    def __len__(self) -> int:
        return len(self.src_lens)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        chunk = int(np.searchsorted(self.chunk_starts, i, side="right")) - 1
        j = i - self.chunk_starts[chunk]
        (src_offsets, src_values), (tgt_offsets, tgt_values) = self.src_chunks[chunk], self.tgt_chunks[chunk]
        return src_values[src_offsets[j] : src_offsets[j + 1]], tgt_values[tgt_offsets[j] : tgt_offsets[j + 1]], i


def collate(items: list[tuple[Sequence[int], Sequence[int], int]], references: list[str] | None = None) -> dict:
    """(x, y, index) items -> src = x + EOS, tgt_in = BOS + y, tgt_out = y + EOS (§3), right-padded, and host counts:
    lengths with EOS, target_positions (tgt_out's real tokens in the flat B * T batch), no device read needed."""
    targets = [t for _, t, _ in items]
    tgt_out = padded(targets, suffix=[EOS_ID])
    tgt_lengths = [len(t) + 1 for t in targets]
    width = tgt_out.shape[1]
    batch = {
        "src": source_batch([s for s, _, _ in items]),
        "tgt_in": padded(targets, prefix=[BOS_ID]),
        "tgt_out": tgt_out,
        "index": torch.tensor([i for _, _, i in items]),
        "src_lengths": [len(s) + 1 for s, _, _ in items],
        "tgt_lengths": tgt_lengths,
        "target_positions": torch.from_numpy(
            np.concatenate([np.arange(row * width, row * width + n) for row, n in enumerate(tgt_lengths)])
        ),
    }
    if references is not None:
        batch["reference"] = [references[i] for _, _, i in items]
    return batch


class TokenBucketSampler(Sampler[list[int]]):
    """Batches of at most `max_tokens` padded tokens per side, by length, ties and batch order shuffled from seed +
    epoch, dealt round-robin to ranks. Cuts planned once; an epoch sorts keys in place (docs/measurements.md)."""

    CHUNK = 1 << 16  # keys are written this many at a time: small temporaries, no page faults

    def __init__(
        self,
        src_lens: np.ndarray,
        tgt_lens: np.ndarray,
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        indices: np.ndarray | None = None,  # the items to batch (default: all)
    ):
        count = len(src_lens) if indices is None else len(indices)
        index_type = np.int32 if len(src_lens) < 2**31 else np.int64
        self.indices = (np.arange(count) if indices is None else np.asarray(indices)).astype(index_type)
        self.src_lens = np.asarray(src_lens, dtype=np.int64) + 1
        self.tgt_lens = np.asarray(tgt_lens, dtype=np.int64) + 1
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._resume_at = 0  # where the next pass starts: a restored position, else 0
        self._cache: tuple[int, list[np.ndarray]] | None = None

        longest = np.maximum(self.src_lens, self.tgt_lens)[self.indices]
        total = (self.src_lens + self.tgt_lens)[self.indices]
        # Group g = the g-th smallest (longest, total): sorting by group is sorting by length.
        pairs, group = np.unique(longest * (int(total.max()) + 1) + total, return_inverse=True)
        self._group = group.astype(np.uint16 if len(pairs) <= 1 << 16 else np.int64)
        sorted_longest = np.repeat(pairs // (int(total.max()) + 1), np.bincount(group, minlength=len(pairs)))
        self._starts = batch_starts(sorted_longest, max_tokens)
        self._position_bits = max(count - 1, 1).bit_length()
        self._random_bits = 64 - self._position_bits - max(len(pairs) - 1, 1).bit_length()
        if self._random_bits < 16:
            raise InputError(
                f"{count:,} pairs of {len(pairs):,} distinct lengths leave {self._random_bits} bits of a 64-bit key "
                "to shuffle them: lower data.max_len"
            )
        self._keys = np.empty(count, dtype=np.uint64)  # the epoch's sort, kept between epochs

    @property
    def sampler(self) -> TokenBucketSampler:
        """Lightning calls `batch_sampler.sampler.set_epoch(epoch)` every epoch, never `batch_sampler.set_epoch`."""
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._resume_at = epoch, 0

    def all_batches(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of `epoch`, in order; rank r takes items r, r + world, ..."""
        rng = np.random.default_rng(self.seed + epoch)
        batches = np.split(self._order(rng), self._starts[1:])
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        while len(batches) % self.world_size:  # equal shares: split the largest batch in two
            largest = max(range(len(batches)), key=lambda i: len(batches[i]))  # the first of the largest
            if len(batches[largest]) < 2:
                raise InputError(f"{len(self.indices)} sentences cannot fill {self.world_size} ranks")
            half = len(batches[largest]) // 2
            batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
        return batches

    def _order(self, rng: np.random.Generator) -> np.ndarray:
        group_shift = np.uint64(self._position_bits + self._random_bits)
        for start in range(0, len(self._keys), self.CHUNK):
            end = min(start + self.CHUNK, len(self._keys))
            key = self._group[start:end].astype(np.uint64) << group_shift
            key |= np.arange(start, end, dtype=np.uint64)
            if self.shuffle:
                random = rng.integers(0, 1 << self._random_bits, end - start, dtype=np.uint64)
                key |= random << np.uint64(self._position_bits)
            self._keys[start:end] = key
        self._keys.sort()
        self._keys &= np.uint64((1 << self._position_bits) - 1)  # the positions, in the epoch's order
        return self.indices[self._keys.view(np.int64)]

    def rank_batches(self) -> list[np.ndarray]:
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, self.all_batches(self.epoch)[self.rank :: self.world_size])
        return self._cache[1]

    def __len__(self) -> int:
        return len(self.rank_batches())

    def __iter__(self):
        batches = self.rank_batches()
        # A restored position applies to the next pass only; any other pass is whole, also after an abandoned one
        # (Lightning's sanity check stops the validation loader after 2 batches).
        start, self._resume_at = (self._resume_at if self._resume_at < len(batches) else 0), 0
        yield from (batch.tolist() for batch in batches[start:])

    def load_state_dict(self, state: dict) -> None:
        """Resume at batch `position` of `epoch` (ResumableLoader's: the batches training processed)."""
        self.epoch, self._resume_at = state["epoch"], state["position"]


def batch_starts(longest: np.ndarray, max_tokens: int) -> np.ndarray:
    """Where greedy batches of sentences sorted by `longest` start (size x longest <= max_tokens), length by length."""
    lengths, firsts = np.unique(longest, return_index=True)
    ends = np.append(firsts[1:], len(longest))
    starts, open_at = [np.zeros(1, dtype=np.int64)], 0
    for length, first, end in zip(lengths.tolist(), firsts.tolist(), ends.tolist()):
        size = max(max_tokens // length, 1)  # sentences of this length a batch holds
        if open_at + size >= end:  # the open batch takes every sentence of this length
            continue
        new = np.arange(max(first, open_at + size), end, size)
        starts.append(new)
        open_at = int(new[-1])
    return np.concatenate(starts)


def update_shape(tokens_per_update: int | None, max_tokens: int, world_size: int) -> tuple[int, int]:
    """(tokens per micro-batch and device, micro-batches per update): as few, as large as ~tokens_per_update needs."""
    if not tokens_per_update:
        return max_tokens, 1
    accumulation = math.ceil(tokens_per_update / (max_tokens * world_size))
    return math.ceil(tokens_per_update / (accumulation * world_size)), accumulation
