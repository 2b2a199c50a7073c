"""The paper's objective and schedule as pure functions: label smoothing (§5.4), the teacher-forced
loss of a batch, the Noam learning rate (§5.3), and a time budget's Noam schedule with a cool-down."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor

from transformer_mt.model import Transformer
from transformer_mt.tokenizer import PAD_ID


def label_smoothed_nll(
    logits: Tensor, target: Tensor, epsilon: float, pad_id: int = PAD_ID
) -> tuple[Tensor, Tensor, Tensor]:
    """§5.4 label smoothing. Returns (smoothed loss, NLL, token count), summed over non-pad targets.

    Target distribution q = (1 - eps) * onehot(y) + eps / V, uniform over the whole vocabulary,
    as in F.cross_entropy(label_smoothing=eps) (fairseq instead gives the true class exactly
    1 - eps). Loss = -sum_k q_k log p_k = (1 - eps) * NLL + eps * mean_k(-log p_k).
    """
    pad = target.eq(pad_id)
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (..., V)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (...)
    smooth = -lprobs.mean(-1)  # (...)
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss.masked_fill(pad, 0.0).sum(), nll.masked_fill(pad, 0.0).sum(), (~pad).sum()


def sequence_losses(
    model: Transformer, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, epsilon: float, positions: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher-forced label_smoothed_nll of a batch, projecting only the non-pad target positions.
    positions: where they are in the flattened (B * T) batch (collate's target_positions, computed on the
    host); without it they are found on the device, which makes a GPU wait (a boolean mask's size)."""
    hidden = model.features(src, tgt_in)  # (B, T, d)
    if positions is None:
        positions = tgt_out.ne(model.cfg.pad_id).flatten().nonzero().squeeze(1)
    logits = model.project(hidden.flatten(0, 1).index_select(0, positions))  # (N, V): no work for padding
    return label_smoothed_nll(logits, tgt_out.flatten().index_select(0, positions), epsilon, model.cfg.pad_id)


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
