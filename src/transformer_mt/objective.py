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


# Rows of logits smoothed_cross_entropy handles at a time outside torch.compile: 2^24 values (453 rows of base's
# 37,000-word vocabulary: a 64 MiB fp32 temporary), instead of every row's fp32 log-probabilities at once.
CHUNK_VALUES = 2**24


def smoothed_rows(logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """label_smoothed_nll's terms per row from logits (N, V) of any dtype, in fp32: (loss, NLL), each (N,).
    With lse = logsumexp(x): -log p_k = lse - x_k, so lse = x_y + NLL and mean_k(-log p_k) = lse - mean(x)."""
    log_p_target = F.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    nll = -log_p_target  # under torch.compile the (N, V) log-probabilities are never written: one value a row is read
    lse = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1).float() + nll
    return (1.0 - epsilon) * nll + epsilon * (lse - logits.mean(-1, dtype=torch.float32)), nll


def smoothed_gradient(
    logits: Tensor, target: Tensor, nll: Tensor, epsilon: float, grad_loss: Tensor, grad_nll: Tensor, out=None
) -> Tensor:
    """d(grad_loss * sum(loss) + grad_nll * sum(NLL)) / d logits, in the logits' dtype. With p = softmax(x):
    d loss_i / dx = p - eps / V - (1 - eps) onehot(y) and d NLL_i / dx = p - onehot(y). Off the target the
    gradient is a p - c (p in the logits' dtype, computed in fp32); at the target, where p_y - (1 - eps) may cancel,
    it is computed in fp32 from p_y = exp(-NLL) and rounded once."""
    vocab = logits.shape[-1]
    scale, uniform = grad_loss + grad_nll, grad_loss * (epsilon / vocab)
    grad = torch.addcmul(-uniform, torch.softmax(logits, dim=-1), scale, out=out)  # (N, V): a p - c
    at_target = scale * torch.exp(-nll) - uniform - (grad_loss * (1 - epsilon) + grad_nll)  # (N,) fp32
    return grad.scatter_(-1, target.unsqueeze(-1), at_target.to(grad.dtype).unsqueeze(-1))


class SmoothedCrossEntropy(torch.autograd.Function):
    """Summed label_smoothed_nll of rows with no padding, and its gradient, without fp32 (N, V) tensors kept
    between forward and backward (the logits themselves and one NLL a row): eagerly in chunks of CHUNK_VALUES
    (24 bytes moved per bf16 logit, forward and backward, on a CPU; ~16 on CUDA, where log_softmax with an fp32
    dtype is one kernel), under torch.compile whole (inductor fuses each
    direction into passes over the logits: 8 bytes per logit; scripts/step_projection.py counts both)."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        # Compiled: whole, and no Python loop over the rows (a range() of the row count would make dynamo
        # specialise on it: one graph per batch)
        step = None if torch.compiler.is_compiling() else max(CHUNK_VALUES // max(logits.shape[-1], 1), 1)
        if step is None or step >= len(logits):
            loss, nll = smoothed_rows(logits, target, epsilon)
        else:
            parts = [
                smoothed_rows(logits[i : i + step], target[i : i + step], epsilon) for i in range(0, len(logits), step)
            ]
            loss, nll = (torch.cat(terms) for terms in zip(*parts))
        ctx.save_for_backward(logits, target, nll)
        ctx.epsilon, ctx.step = epsilon, step
        return loss.sum(), nll.sum()

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor):
        logits, target, nll = ctx.saved_tensors
        if ctx.step is None or ctx.step >= len(logits):
            return smoothed_gradient(logits, target, nll, ctx.epsilon, grad_loss, grad_nll), None, None
        grad = torch.empty_like(logits)
        for i in range(0, len(logits), ctx.step):
            rows = slice(i, i + ctx.step)  # each chunk written in place: no copy
            smoothed_gradient(logits[rows], target[rows], nll[rows], ctx.epsilon, grad_loss, grad_nll, grad[rows])
        return grad, None, None


def smoothed_cross_entropy(logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """(summed smoothed loss, summed NLL) of logits (N, V) whose targets (N,) are all real tokens: the values
    of label_smoothed_nll, and its gradient, through SmoothedCrossEntropy."""
    return SmoothedCrossEntropy.apply(logits, target, epsilon)


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
    target = tgt_out.flatten().index_select(0, positions)  # (N,), no padding
    loss, nll = smoothed_cross_entropy(logits, target, epsilon)
    return loss, nll, target.ne(model.cfg.pad_id).sum()


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
