"""Attention weights made visible, for looking inside the model (tools/attention_maps.py).

Inside `record_attention(model)` every attention layer computes §3.2.1 written out (explicit_attention) and
keeps its weights; outside it, SDPA computes the same without keeping them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> tuple[Tensor, Tensor]:
    """§3.2.1 written out, softmax(Q K^T / sqrt(d_k)) V, also returning the weights (B, H, Lq, Lk).

    Only for looking inside the model (record_attention): SDPA computes the same without keeping
    the weights. A row whose keys are all masked gets zero weights and a zero output, as in SDPA.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, Lq, Lk)
    allowed = mask
    if causal:
        below = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        allowed = below if allowed is None else allowed & below
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all -inf row: NaN -> 0
    return weights @ v, weights


@contextlib.contextmanager
def record_attention(model: nn.Module) -> Iterator[dict[str, list[nn.Module]]]:  # model.Transformer's layers
    """Inside the block, every attention layer computes its weights explicitly and keeps those of
    its last call in `.weights`. Yields the layers by kind, each list in layer order:
    "encoder" (self-attention), "decoder" (masked self-attention), "cross" (encoder-decoder)."""
    kinds = {
        "encoder": [layer.self_attn for layer in model.encoder_layers],
        "decoder": [layer.self_attn for layer in model.decoder_layers],
        "cross": [layer.cross_attn for layer in model.decoder_layers],
    }
    layers = [attn for group in kinds.values() for attn in group]
    for attn in layers:
        attn.recording = True
    try:
        yield kinds
    finally:
        for attn in layers:
            attn.recording, attn.weights = False, None
