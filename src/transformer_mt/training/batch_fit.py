"""data.max_tokens=auto: the per-device batch, found at the start (a resumed run keeps its run's choice); the update
keeps data.tokens_per_update. On a GPU the largest that fits (as Marian's --mini-batch-fit), on a CPU the fastest."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable

import lightning as L
import numpy as np
import torch

from transformer_mt.data.batching import TokenBucketSampler, collate
from transformer_mt.data.cache import cache_key
from transformer_mt.files import atomic_write
from transformer_mt.objective import sequence_losses
from transformer_mt.runtime import cpuinfo, sentence_attention

log = logging.getLogger(__name__)

MARGIN = 0.15  # of the budget, left for the allocator's fragmentation and what varies between batches
CPU_SHARES = (1, 2, 4)  # a CPU tries data.max_tokens_fallback divided by each
CPU_ROUNDS = 2  # each size timed this many times, taking turns; its fastest counts
CPU_TIE = 0.05  # a smaller batch is chosen only when this much faster per token than the larger
PROBES = "batch_probe.json"  # in data.cache_dir: the CPU probe's choices, by probe_key


def largest_fitting(step_bytes: Callable[[int], int], budget: int, ceiling: int) -> int:
    """The most sentences n <= ceiling whose step_bytes(n) stays under budget x (1 - margin) without running out of
    memory (doubling, then bisecting); 0 when not even one fits."""

    def fits(n: int) -> bool:
        try:
            return step_bytes(n) <= budget * (1 - MARGIN)
        except torch.OutOfMemoryError:
            return False

    if not fits(1):
        return 0
    good = 1
    while good < ceiling and fits(min(2 * good, ceiling)):
        good = min(2 * good, ceiling)
    bad = min(2 * good, ceiling + 1)
    while bad - good > 1:  # fits(good), not fits(bad)
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def measure_step_bytes(module, device: torch.device, precision: str, sentences: int, length: int) -> int:
    """Peak CUDA memory of a training step on `sentences` random pairs of `length` tokens, plus Adam's fp32 moments."""
    model = module.model
    ids = torch.randint(4, model.cfg.vocab_size, (sentences, length), device=device)  # ids 0-3: PAD, UNK, BOS, EOS
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(precision).startswith("bf16")):
        loss, _, _ = sequence_losses(model, ids, ids, ids, 0.1)
    loss.backward()
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    return peak + 2 * sum(p.numel() * 4 for p in model.parameters())


def fit_max_tokens(module, device: torch.device, precision: str, longest: int) -> int:
    """data.max_tokens on a GPU: the sentences of the longest training pair's length that fit, x that length."""
    budget = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device)  # free, and what we hold
    module.to(device)
    step_bytes = lambda n: measure_step_bytes(module, device, precision, n, longest)  # noqa: E731
    sentences = largest_fitting(step_bytes, budget, 2**20 // longest)
    torch.cuda.empty_cache()
    if sentences == 0:
        raise torch.OutOfMemoryError(
            f"data.max_tokens=auto: not even one training sentence of {longest} tokens fits in "
            f"{budget / 2**30:.1f} GiB of {torch.cuda.get_device_name(device)}; lower data.max_len"
        )
    log.info(
        f"data.max_tokens=auto: {sentences * longest:,} tokens per batch and device ({sentences} sentences of "
        f"{longest} tokens, the longest training pair, with Adam's state, under {device}'s memory less {MARGIN:.0%})"
    )
    return sentences * longest


def fastest(seconds: dict[int, float]) -> int:
    """The batch size whose step took the fewest seconds for the same tokens; a smaller one only when CPU_TIE faster."""
    chosen, *smaller = sorted(seconds, reverse=True)
    for size in smaller:
        if seconds[size] < seconds[chosen] * (1 - CPU_TIE):
            chosen = size
    return chosen


def probe_sentences(split, tokens: int) -> np.ndarray:
    """~`tokens` target tokens of the pairs nearest the median lengths: no batch size pads more than another."""
    src, tgt = np.asarray(split.src_lens), np.asarray(split.tgt_lens)
    order = np.argsort(np.abs(src - np.median(src)) + np.abs(tgt - np.median(tgt)), kind="stable")
    return order[: int(np.searchsorted(np.cumsum(tgt[order] + 1), tokens)) + 1]


def probe_key(module, precision: str, sizes: list[int], longest: int) -> str:
    """What the CPU probe's choice depends on: the CPU (its model and features), its threads, the precision, the
    model's shape and the sizes tried."""
    first = cpuinfo().split("\n\n")[0].splitlines()
    cpu = [line for line in first if line.partition(":")[0].strip() in ("vendor_id", "cpu family", "model", "flags")]
    shape = dataclasses.asdict(module.model.cfg)
    return cache_key(
        cpu=cpu, threads=torch.get_num_threads(), precision=str(precision), sizes=sizes, longest=longest, shape=shape
    )


def kept_probes(path) -> dict:
    """The CPU probe's earlier choices (none: an empty dict)."""
    with contextlib.suppress(OSError, ValueError):
        if isinstance(probes := json.loads(path.read_text(encoding="utf-8")), dict):
            return probes
    return {}


def fastest_max_tokens(module, datamodule, precision: str, fallback: int) -> int:
    """data.max_tokens on a CPU: the fastest per token of fallback / CPU_SHARES; the random generators untouched."""
    split, longest = datamodule.splits["train"], datamodule.longest_training_pair()
    fallback = min(fallback, datamodule.tokens_per_update or fallback)  # no micro-batch larger than the update
    sizes = sorted({fallback // share for share in CPU_SHARES if fallback // share >= longest}, reverse=True)
    if len(sizes) < 2:
        return fallback
    kept, key = datamodule.cache_dir / PROBES, probe_key(module, precision, sizes, longest)
    if (chosen := kept_probes(kept).get(key)) in sizes:
        log.info(
            f"data.max_tokens=auto on cpu: {chosen:,} tokens per batch, measured fastest on this CPU for this model "
            f"and precision at an earlier start (kept in {kept}; data.max_tokens=<tokens> skips the probe)"
        )
        return chosen
    sample = probe_sentences(split, fallback)
    batches = {
        size: [
            collate([split[i] for i in b])
            for b in TokenBucketSampler(split.src_lens, split.tgt_lens, size, shuffle=False, indices=sample)
        ]
        for size in sizes
    }
    tokens = sum(sum(b["tgt_lengths"]) for b in batches[sizes[0]])
    log.info(
        f"data.max_tokens=auto on cpu: timing a training step on {tokens:,} target tokens at each batch size "
        f"({', '.join(f'{size:,}' for size in sizes)} tokens), {CPU_ROUNDS} rounds after a warm-up"
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=str(precision).startswith("bf16"))
    model, best = module.model, {size: float("inf") for size in sizes}
    with torch.random.fork_rng(devices=[]), autocast, sentence_attention(torch.device("cpu"), precision):
        model.train()
        for round_ in range(CPU_ROUNDS + 1):  # the first round warms up (allocations, caches): not counted
            for size in sizes:
                start = time.perf_counter()
                for b in batches[size]:
                    loss, _, _ = sequence_losses(model, b["src"], b["tgt_in"], b["tgt_out"], 0.1, b["target_positions"])
                    loss.backward()
                if round_:
                    best[size] = min(best[size], time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    chosen = fastest(best)
    with contextlib.suppress(OSError), atomic_write(kept) as tmp:  # the next start, a sweep's next job, reuse it
        tmp.write_text(json.dumps({**kept_probes(kept), key: chosen}, indent=1) + "\n", encoding="utf-8")
    speeds = ", ".join(f"{size:,}: {tokens / best[size]:,.0f}" for size in sizes)
    log.info(
        f"data.max_tokens=auto on cpu: {chosen:,} tokens per batch, the fastest per token here (target tok/s of a "
        f"training step on {tokens:,} tokens, by batch size: {speeds}; a smaller one must be {CPU_TIE:.0%} faster)"
    )
    return chosen


class FitBatch(L.Callback):
    """data.max_tokens=auto once the process group exists (a resumed CPU run: its `saved` choice)."""

    def __init__(self, saved: int | None = None):
        self.saved = saved

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:  # the Trainer only fits
        datamodule, device = trainer.datamodule, trainer.strategy.root_device
        if device.type == "cuda":
            tokens = fit_max_tokens(module, device, trainer.precision, datamodule.longest_training_pair())
        elif self.saved:
            tokens = self.saved
            log.info("data.max_tokens=auto on cpu: %s tokens per batch, as the run chose at its start", f"{tokens:,}")
        else:
            tokens = fastest_max_tokens(module, datamodule, trainer.precision, datamodule.max_tokens_fallback)
        if trainer.world_size > 1:
            tokens = least_over_ranks(tokens, device)
        datamodule.max_tokens = tokens
        shape_updates(trainer, datamodule, module)


def least_over_ranks(tokens: int, device: torch.device) -> int:
    """The smallest of every rank's `tokens`: ranks must agree on the update's shape."""
    least = torch.tensor([tokens], device=device)
    torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
    return int(least.item())


def shape_updates(trainer: L.Trainer, datamodule, module) -> int:
    """Micro-batches per update, validation's interval in micro-batches; returns the update's padded tokens per side."""
    batch_tokens, module.accumulation = datamodule.update_shape(trainer.world_size)
    datamodule.update_tokens = module.accumulation * batch_tokens * trainer.world_size
    if isinstance(trainer.val_check_interval, int):
        trainer.val_check_interval *= module.accumulation
    if trainer.is_global_zero:
        log.info(
            f"tokens per update: accumulation {module.accumulation} x {batch_tokens} tokens x "
            f"{trainer.world_size} device(s) = {datamodule.update_tokens:,} padded tokens per side "
            f"(data.tokens_per_update: {datamodule.tokens_per_update})"
        )
    return datamodule.update_tokens
