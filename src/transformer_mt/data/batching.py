"""Token ids of a split -> padded batches of at most `max_tokens` tokens per side, in the one layout
every model input has (collate; its source side is search.source_batch, as in decoding)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from transformer_mt.errors import InputError
from transformer_mt.search import padded, source_batch
from transformer_mt.tokenizer import BOS_ID, EOS_ID

if TYPE_CHECKING:
    import datasets


class TokenizedSplit(Dataset):
    """Token ids of one split, read straight from the cached Arrow columns: memory-mapped, never copied
    (WMT14's ids are ~1 GB). The columns come in chunks (as written); an item is found by its chunk."""

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

    def texts(self, column: str) -> list[str]:
        """Raw text of the validation/test split ('src_text' or 'tgt_text'), for BLEU."""
        return self.dataset[column]


def collate(items: list[tuple[Sequence[int], Sequence[int], int]], references: list[str] | None = None) -> dict:
    """The one layout of a training batch: (source, target, index) items -> src = x + EOS;
    tgt_in = BOS + y; tgt_out = y + EOS (§3: the decoder input is the output shifted right),
    right-padded; index = position in the split. With `references` (the split's raw target text),
    batches carry theirs for BLEU.

    Counted here, on the host, so that training never asks the device: src_lengths and tgt_lengths (Python
    ints with the EOS: the tokens/s and model FLOPs), and target_positions, where tgt_out's real tokens are
    in the flattened (B * T) batch (the loss projects only those, without a boolean mask's device sync)."""
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
        indices: np.ndarray | None = None,
    ):
        """indices: the items to batch (default: all)."""
        self.indices = np.arange(len(src_lens)) if indices is None else np.asarray(indices)
        if len(self.indices) == 0:
            raise InputError("cannot batch an empty split")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.src_lens = np.asarray(src_lens, dtype=np.int64) + 1
        self.tgt_lens = np.asarray(tgt_lens, dtype=np.int64) + 1
        # The epoch's sort keys, in 16 bits where they fit: numpy sorts those by radix (4.5M pairs: 0.3 s, not 1 s)
        key = np.uint16 if len(self.src_lens) and (self.src_lens + self.tgt_lens).max() <= 65535 else np.int64
        self._longest = np.maximum(self.src_lens, self.tgt_lens).astype(key)
        self._total = (self.src_lens + self.tgt_lens).astype(key)
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._resume_at = 0  # where the next pass starts: a restored position, else 0
        self._cache: tuple[int, list[np.ndarray]] | None = None

    @property
    def sampler(self) -> TokenBucketSampler:
        """Lightning calls `dataloader.batch_sampler.sampler.set_epoch(epoch)` at every epoch (as for a
        DistributedSampler inside a BatchSampler), never `batch_sampler.set_epoch`: this is how it reaches ours."""
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._resume_at = epoch, 0

    def all_batches(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of `epoch`, in order; rank r takes items r, r + world, ..."""
        rng = np.random.default_rng(self.seed + epoch)
        order = self.indices[rng.permutation(len(self.indices))] if self.shuffle else self.indices
        # Sort by the longer side (what a batch pays for), then by the total; stable, so ties stay shuffled: two
        # stable sorts, the minor key first (np.lexsort's order).
        by_total = np.argsort(self._total[order], kind="stable")
        longest = self._longest[order[by_total]]
        by_longest = np.argsort(longest, kind="stable")
        order, longest = order[by_total[by_longest]], longest[by_longest]  # longest: non-decreasing
        batches = np.split(order, batch_starts(longest, self.max_tokens)[1:])
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        sizes = [len(b) for b in batches]
        while len(batches) % self.world_size:  # equal shares: split the largest batch in two
            largest = int(np.argmax(sizes))
            if sizes[largest] < 2:
                raise InputError(f"{len(self.indices)} sentences cannot fill {self.world_size} ranks")
            half = sizes[largest] // 2
            batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
            sizes[largest : largest + 1] = [half, sizes[largest] - half]
        return batches

    def rank_batches(self) -> list[np.ndarray]:
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, self.all_batches(self.epoch)[self.rank :: self.world_size])
        return self._cache[1]

    def __len__(self) -> int:
        return len(self.rank_batches())

    def __iter__(self):
        batches = self.rank_batches()
        # A restored position applies to the next pass only; any other pass is whole, also after one
        # that was abandoned (Lightning's sanity check stops the validation loader after 2 batches).
        # The epoch only changes through set_epoch() (Lightning calls it every epoch).
        start, self._resume_at = (self._resume_at if self._resume_at < len(batches) else 0), 0
        for i in range(start, len(batches)):
            yield batches[i].tolist()

    def load_state_dict(self, state: dict) -> None:
        """Resume at batch `position` of `epoch` (ResumableLoader saves how many batches training processed:
        the sampler itself runs ahead of training)."""
        self.epoch, self._resume_at = state["epoch"], state["position"]


def batch_starts(longest: np.ndarray, max_tokens: int) -> np.ndarray:
    """Where each batch starts when sentences sorted by `longest` (their longer side, non-decreasing) fill
    batches greedily: a sentence joins the open batch while (batch size) x (its longest) <= max_tokens; a
    sentence longer than max_tokens makes a batch alone. Walks the distinct lengths, not the sentences: inside
    a run of one length L the batches are runs of max_tokens // L sentences."""
    if len(longest) == 0:
        return np.zeros(0, dtype=np.int64)
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
    """(tokens per micro-batch and device, micro-batches per update) for an update of ~tokens_per_update
    padded tokens per side on `world_size` devices: as few micro-batches as max_tokens allows, each
    as large as the update needs. The update then holds tokens_per_update plus less than one token per
    micro-batch and device, on 1 device as on 64 (past tokens_per_update / max_tokens devices the
    per-device batch shrinks; the update does not grow). Without tokens_per_update: (max_tokens, 1)."""
    if not tokens_per_update:
        return max_tokens, 1
    accumulation = math.ceil(tokens_per_update / (max_tokens * world_size))
    return math.ceil(tokens_per_update / (accumulation * world_size)), accumulation


def padding_efficiency(sampler: TokenBucketSampler) -> float:
    """Real tokens / padded tokens over both sides of every batch of the current epoch."""
    real = padded = 0
    for batch in sampler.rank_batches():
        s, t = sampler.src_lens[batch], sampler.tgt_lens[batch]
        real += s.sum() + t.sum()
        padded += len(batch) * (s.max() + t.max())
    return float(real / padded)
