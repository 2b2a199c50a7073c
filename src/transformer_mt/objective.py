"""The paper's objective and schedule as pure functions: label smoothing (§5.4), the teacher-forced
loss of a batch, the Noam learning rate (§5.3), and a time budget's Noam schedule with a cool-down."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_mt.model import Transformer
from transformer_mt.tokenizer import PAD_ID


def label_smoothed_nll(
    logits: Tensor, target: Tensor, epsilon: float, pad_id: int = PAD_ID
) -> tuple[Tensor, Tensor, Tensor]:
    """§5.4: (loss, NLL, token count), summed over non-pad targets. q = (1 - eps) onehot(y) + eps / V as in
    F.cross_entropy(label_smoothing=eps) (fairseq: 1 - eps on y), so loss = (1 - eps) NLL + eps mean_k(-log p_k)."""
    pad = target.eq(pad_id)
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (..., V)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (...)
    smooth = -lprobs.mean(-1)  # (...)
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss.masked_fill(pad, 0.0).sum(), nll.masked_fill(pad, 0.0).sum(), (~pad).sum()


# fp32 logits per chunk of linear_cross_entropy: 255 rows of 37,000 words, 1,887 of 5,000 (fewer, smaller products
# were slower). Rows from the vocabulary, not torch's choice from the row count, on which torch.compile would
# specialise (a graph per batch size).
CHUNK_BYTES = 36 * 2**20


def linear_smoothed_nll(hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """label_smoothed_nll's (loss, NLL) of logits z = hidden (N, d) @ weight (V, d)^T, never written: the NLL from
    torch's chunked linear_cross_entropy, and loss_i = (1 - eps) NLL_i + eps (lse_i - mean_k z_ik) with
    lse_i = NLL_i + z_iy, that is NLL_i + eps (z_iy - mean_k z_ik): two dot products a row."""
    # At least fp32: under CPU autocast the rows arrive in fp32 (a LayerNorm of the fp32 stream), under FSDP in bf16,
    # whose loss the op would sum in bf16 (0.3% off), giving W a bf16 gradient (on a CPU its math is fp32 anyway).
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    # Before the op, so that autograd runs the op's backward (gradients from its forward, scaled in place) first: W's
    # (V, d) gradients arrive one at a time (peak at 8,192 x 37,000: 214 MiB, 286 the other way round).
    gap = (hidden * (weight.index_select(0, target) - weight.mean(0))).sum()  # sum_i z_iy - mean_k z_ik
    # Chunked (the reference path, which writes the logits, would warn); under torch.compile the op runs eagerly and
    # would set allow_retain_graph itself, warning each step.
    chunked = torch.nn.LinearCrossEntropyOptions(
        allow_retain_graph=torch.compiler.is_compiling(),
        batch_chunk_size=CHUNK_BYTES // (4 * weight.size(0)),
        chunking_method=None,
    )
    nll = F.linear_cross_entropy(hidden, weight, target, reduction="sum", options=chunked)
    return nll + epsilon * gap, nll


def sequence_losses(
    model: Transformer, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, epsilon: float, positions: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher-forced (loss, NLL, token count) of a batch over its non-pad target positions: `positions` in the
    flattened (B * T) batch (collate's target_positions, found on the host), else found here (a GPU waits)."""
    hidden = model.features(src, tgt_in)  # (B, T, d)
    if positions is None:
        positions = tgt_out.ne(model.cfg.pad_id).flatten().nonzero().squeeze(1)
    rows = hidden.flatten(0, 1).index_select(0, positions)  # (N, d): no work for padding
    target = tgt_out.flatten().index_select(0, positions)  # (N,)
    return *linear_smoothed_nll(rows, model.output_weight, target, epsilon), target.ne(model.cfg.pad_id).sum()


def noam_lr(step: int, d_model: int, warmup_steps: int, factor: float = 1.0) -> float:
    """§5.3: lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step >= 1."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def budget_lr(step: int, start: tuple[int, float], peak: tuple[int, float], horizon: int, cool_from: int) -> float:
    """A time budget's learning rate (training/budget.py), the Noam schedule fitted to `horizon` updates: a line from
    `start` (update, rate) up to `peak` (update, rate), then Noam's decay rate x sqrt(peak update / step), then after
    update `cool_from` a line to 0 one update after the horizon. Given a `start` at or past the peak's
    update, the decay starts from `start` (a horizon fixed after the warmup)."""
    (first, low), (top, high) = start, peak
    if first >= top:
        top, high = first, low
    if step <= top:
        return low + (high - low) * max(step - first, 0) / max(top - first, 1)
    cool = max(cool_from, top)
    decayed = high * math.sqrt(top / min(step, cool))
    return decayed if step <= cool else decayed * max(horizon + 1 - step, 0) / (horizon + 1 - cool)
