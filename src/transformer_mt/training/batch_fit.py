"""data.max_tokens=auto: the per-device batch found at the start. The update keeps its size: data.tokens_per_update
still sets it, and the accumulation follows from the batch found (batching.update_shape, the same rules on any
number of devices).

On a GPU, the largest batch that fits its memory (as Marian's --mini-batch-fit): the probe trains on batches of
the longest training sentence (both sides: the worst case of a token budget, attention's memory grows with the
square of the length) and grows the number of sentences while a forward and backward step, plus the optimizer's
state that Adam allocates at its first update, stays under the device's memory less a margin: doubling first,
then halving the last interval.

On a CPU, memory rarely limits the batch and speed per token need not grow with it (caches, the allocator):
the fastest per target token among data.max_tokens_fallback (at most data.tokens_per_update) and its half and
quarter, each timed on the same training sentences (forward and backward, the run's precision). A resumed run
keeps its run's choice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import lightning as L
import numpy as np
import torch

from transformer_mt.data.batching import TokenBucketSampler, collate
from transformer_mt.objective import sequence_losses

log = logging.getLogger(__name__)

MARGIN = 0.15  # of the budget, left for the allocator's fragmentation and what varies between batches
CPU_SHARES = (1, 2, 4)  # a CPU tries data.max_tokens_fallback divided by each
CPU_ROUNDS = 2  # each size timed this many times, taking turns; its fastest counts
CPU_TIE = 0.05  # a smaller batch is chosen only when this much faster per token than the larger


def largest_fitting(step_bytes: Callable[[int], int], budget: int, ceiling: int, margin: float = MARGIN) -> int:
    """The largest number of sentences n <= ceiling whose step_bytes(n) (or OutOfMemoryError) stays under
    budget x (1 - margin); 0 when not even one fits. step_bytes must grow with n."""

    def fits(n: int) -> bool:
        try:
            return step_bytes(n) <= budget * (1 - margin)
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


def device_memory_budget(device: torch.device) -> int:
    """Bytes this process may use on a CUDA device: what is free, plus what it holds already."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_allocated(device)


def measure_step_bytes(module, device: torch.device, precision: str, sentences: int, length: int) -> int:
    """Peak CUDA memory of one training step (forward, backward) on `sentences` random pairs of `length`
    tokens per side, plus Adam's two moments (fp32, allocated at the first update). Gradients are dropped."""
    model = module.model
    vocab = model.cfg.vocab_size
    ids = torch.randint(4, vocab, (sentences, length), device=device)  # ids 0-3: PAD, UNK, BOS, EOS
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    dtype = torch.bfloat16 if str(precision).startswith("bf16") else torch.float16
    with torch.autocast("cuda", dtype=dtype, enabled=not str(precision).startswith("32")):
        loss, _, _ = sequence_losses(model, ids, ids, ids, 0.1)
    loss.backward()
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    del loss
    moments = 2 * sum(p.numel() * 4 for p in model.parameters())
    return peak + moments


def fit_max_tokens(
    module, device: torch.device, precision: str, longest: int, fallback: int = 4096, ceiling_tokens: int = 2**20
) -> int:
    """data.max_tokens on a GPU: the sentences of `longest` tokens that fit, x longest."""
    budget = device_memory_budget(device)
    module.to(device)
    sentences = largest_fitting(
        lambda n: measure_step_bytes(module, device, precision, n, longest), budget, ceiling_tokens // longest
    )
    torch.cuda.empty_cache()
    if sentences == 0:
        raise torch.OutOfMemoryError(
            f"data.max_tokens=auto: not even one training sentence of {longest} tokens fits in "
            f"{budget / 2**30:.1f} GiB of {torch.cuda.get_device_name(device)}; lower data.max_len"
        )
    log.info(
        "data.max_tokens=auto: %s tokens per batch and device (%d sentences of %d tokens, the longest training pair, "
        "in a forward and backward step with Adam's state, under the memory of %s less %d%%)",
        f"{sentences * longest:,}", sentences, longest, device, round(100 * MARGIN),
    )  # fmt: skip
    return sentences * longest


def fastest(seconds: dict[int, float], tie: float = CPU_TIE) -> int:
    """The batch size whose step took the fewest seconds for the same tokens; a smaller size wins over a larger only
    when `tie` faster (fewer micro-batches per update, and no choice decided by noise)."""
    chosen, *smaller = sorted(seconds, reverse=True)
    for size in smaller:
        if seconds[size] < seconds[chosen] * (1 - tie):
            chosen = size
    return chosen


def probe_sentences(split, tokens: int) -> np.ndarray:
    """~`tokens` target tokens of training pairs, those nearest the median lengths on both sides: what one bucket
    of the real sampler holds (sentences of about one length), so that no batch size pads more than another. (A
    random sample holds all lengths: its largest batch pads every sentence to the longest and is slower per token
    for that alone, which a training batch is not.)"""
    src, tgt = np.asarray(split.src_lens), np.asarray(split.tgt_lens)
    distance = np.abs(src - np.median(src)) + np.abs(tgt - np.median(tgt))
    order = np.argsort(distance, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(tgt[order] + 1), tokens)) + 1]


def fastest_max_tokens(module, datamodule, precision: str, fallback: int) -> int:
    """data.max_tokens on a CPU: the fastest per target token of fallback / CPU_SHARES that holds the longest training
    pair, each timed on the same training sentences (~fallback target tokens of median-length pairs, a forward and
    backward step). The random generators are left as they were (dropout draws from them): a run trains as it
    would without the probe."""
    split = datamodule.splits["train"]
    longest = datamodule.longest_training_pair()
    sizes = sorted({fallback // share for share in CPU_SHARES if fallback // share >= longest}, reverse=True)
    if len(sizes) < 2:
        return fallback
    sample = probe_sentences(split, fallback)
    batches = {
        size: [collate([split[i] for i in b]) for b in TokenBucketSampler(
            split.src_lens, split.tgt_lens, size, shuffle=False, indices=sample)]
        for size in sizes
    }  # fmt: skip
    tokens = sum(sum(b["tgt_lengths"]) for b in batches[sizes[0]])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=str(precision).startswith("bf16"))
    model, best = module.model, {size: float("inf") for size in sizes}
    with torch.random.fork_rng(devices=[]), autocast:
        model.train()
        for round_ in range(CPU_ROUNDS + 1):  # the first round warms up (allocations, caches): not counted
            for size in sizes:
                start = time.perf_counter()
                for b in batches[size]:
                    sequence_losses(model, b["src"], b["tgt_in"], b["tgt_out"], 0.1, b["target_positions"])[
                        0
                    ].backward()
                seconds = time.perf_counter() - start
                best[size] = min(best[size], seconds) if round_ else best[size]
        model.zero_grad(set_to_none=True)
    chosen = fastest(best)
    speeds = ", ".join(f"{size:,}: {tokens / best[size]:,.0f}" for size in sizes)
    log.info(
        "data.max_tokens=auto on cpu: %s tokens per batch, the fastest per token here (target tok/s of a forward "
        "and backward step on the same %s tokens of median-length pairs, by batch size: %s; a smaller batch must be "
        "%d%% faster)",
        f"{chosen:,}", f"{tokens:,}", speeds, round(100 * CPU_TIE),
    )  # fmt: skip
    return chosen


class FitBatch(L.Callback):
    """data.max_tokens=auto: at the start of fit, in every process once the process group exists, the
    probe on this process's device (a resumed CPU run: its run's choice, `saved`); every rank takes the smallest
    result (ranks must agree on the update's shape), then the update's shape follows (shape_updates)."""

    def __init__(self, saved: int | None = None):
        self.saved = saved

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        datamodule, device = trainer.datamodule, trainer.strategy.root_device
        fallback = datamodule.max_tokens_fallback
        if device.type == "cuda":
            tokens = fit_max_tokens(module, device, trainer.precision, datamodule.longest_training_pair(), fallback)
        elif self.saved:
            tokens = self.saved
            log.info("data.max_tokens=auto on cpu: %s tokens per batch, as the run chose at its start", f"{tokens:,}")
        else:  # no micro-batch larger than the update
            largest = min(fallback, datamodule.tokens_per_update or fallback)
            tokens = fastest_max_tokens(module, datamodule, trainer.precision, largest)
        if trainer.world_size > 1:
            tokens = least_over_ranks(tokens, device)
        datamodule.max_tokens = tokens
        shape_updates(trainer, datamodule)


def least_over_ranks(tokens: int, device: torch.device) -> int:
    """The smallest of every rank's `tokens`: ranks must agree on the update's shape."""
    least = torch.tensor([tokens], device=device)
    torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
    return int(least.item())


def shape_updates(trainer: L.Trainer, datamodule) -> int:
    """The update's shape from the per-device batch and the number of devices, known once the Trainer exists:
    micro-batches per update, and the validation interval in micro-batches (Lightning's unit). Returns the
    update's padded tokens per side, which every checkpoint keeps (datamodule.update_tokens)."""
    batch_tokens, trainer.accumulate_grad_batches = datamodule.update_shape(trainer.world_size)
    datamodule.update_tokens = trainer.accumulate_grad_batches * batch_tokens * trainer.world_size
    if isinstance(trainer.val_check_interval, int):
        trainer.val_check_interval *= trainer.accumulate_grad_batches
    if trainer.is_global_zero:
        log.info(
            "tokens per update: accumulation %d x %d tokens x %d device(s) = %s padded tokens per "
            "side (data.tokens_per_update: %s)",
            trainer.accumulate_grad_batches,
            batch_tokens,
            trainer.world_size,
            f"{datamodule.update_tokens:,}",
            datamodule.tokens_per_update,
        )
    return datamodule.update_tokens
