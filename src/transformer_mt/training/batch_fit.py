"""data.max_tokens=auto: the largest per-device batch that fits the device's memory, found at the start (as
Marian's --mini-batch-fit). The update keeps its size: data.tokens_per_update still sets it, and the
accumulation follows from the batch found (batching.update_shape, the same rules on any number of devices).

The probe trains on batches of the longest training sentence (both sides: the worst case of a token
budget, attention's memory grows with the square of the length) and grows the number of sentences while
a forward and backward step, plus the optimizer's state that Adam allocates at its first update, stays
under the device's memory less a margin: doubling first, then halving the last interval.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import lightning as L
import torch

from transformer_mt.objective import sequence_losses

log = logging.getLogger(__name__)

MARGIN = 0.15  # of the budget, left for the allocator's fragmentation and what varies between batches


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
    """data.max_tokens for this device: the sentences of `longest` tokens that fit, x longest. On a CPU
    (memory is rarely what limits its batch) `fallback` (data.max_tokens_fallback), with a line saying so."""
    if device.type != "cuda":
        log.info(
            "data.max_tokens=auto on %s: %s (data.max_tokens_fallback; the probe measures CUDA memory)",
            device.type, f"{fallback:,}",
        )  # fmt: skip
        return fallback
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
    return sentences * longest


class FitBatch(L.Callback):
    """data.max_tokens=auto: at the start of fit, in every process once the process group exists, the
    probe on this process's device; every rank takes the smallest result (ranks must agree on the update's
    shape), then the update's shape follows (shape_updates)."""

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        datamodule, device = trainer.datamodule, trainer.strategy.root_device
        longest = datamodule.longest_training_pair()
        tokens = fit_max_tokens(module, device, trainer.precision, longest, datamodule.max_tokens_fallback)
        if trainer.world_size > 1:
            tokens = least_over_ranks(tokens, device)
        datamodule.max_tokens = tokens
        if trainer.is_global_zero:
            log.info(
                "data.max_tokens=auto: %s tokens per batch and device (%d sentences of %d tokens, the longest "
                "training pair, in a forward and backward step with Adam's state, under the memory of %s less %d%%)",
                f"{tokens:,}", tokens // longest, longest, device, round(100 * MARGIN),
            )  # fmt: skip
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
