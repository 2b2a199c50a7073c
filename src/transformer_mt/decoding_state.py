"""The incremental-decoding cache of model.Transformer (start_decoding -> decode_step): each decoder layer's
keys/values, extended in place at every step and reordered as beam search moves its hypotheses.

Shapes as in model.py: B sentences (memory rows), beam hypotheses each, H heads, t positions decoded so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn


class Stacked(NamedTuple):
    """Linear layers that read the same input, as one for decoding: their weights stacked and transposed, (d, sum of
    widths) contiguous (a few rows multiply faster by a contiguous (d, out) matrix: 1.2-1.9x on 2 cores), their
    biases, and the width of each."""

    weight: Tensor
    bias: Tensor
    widths: list[int]

    @classmethod
    def of(cls, *layers: nn.Linear, dtype: torch.dtype | None = None) -> Stacked:
        weight = torch.cat([layer.weight for layer in layers]).t().to(dtype).contiguous()
        bias = torch.cat([layer.bias for layer in layers]).to(dtype)
        return cls(weight, bias, [layer.out_features for layer in layers])


class LayerWeights(NamedTuple):
    """One decoder layer's projections stacked for decoding."""

    self_qkv: Stacked  # self-attention's W_q, W_k, W_v: one product per step
    memory_kv: Stacked  # cross-attention's W_k, W_v: one product per sentence, at the first step


def decoding_weights(model: nn.Module) -> tuple[Tensor, list[LayerWeights]]:
    """Decoding's copies of a Transformer's weights, laid out for a few rows at a time: the output projection
    transposed (d, V) and each decoder layer's LayerWeights, in autocast's format where autocast is on (cast once
    here, not at every step: autocast keeps casts of parameters only).

    A model being trained gets them made anew for each batch (start_decoding): fused Adam, which training uses,
    updates parameters in place without bumping their version counter, and a copy kept across batches went stale
    in training's validation (greedy BLEU 3.3 instead of ~9 after 300 Multi30k updates). A model for inference
    (no parameter requires a gradient: load_for_inference) keeps them while its parameters are the same tensors
    at the same version (load_state_dict's copy bumps it): the transposed output matrix alone is a copy of V x d
    (1.5 ms for Multi30k's, more for WMT14's 37,000 x 512), paid once instead of for every batch."""
    weight = model.output_weight
    on = torch.is_autocast_enabled(weight.device.type)
    dtype = torch.get_autocast_dtype(weight.device.type) if on else weight.dtype
    key = None
    if not any(p.requires_grad for p in model.parameters()):
        key = (dtype, *((p.data_ptr(), p._version) for p in model.parameters()))
        kept = model.__dict__.get("_decoding_weights")
        if kept is not None and kept[0] == key:
            return kept[1]
    with torch.no_grad():
        made = weight.t().to(dtype).contiguous(), [
            LayerWeights(
                Stacked.of(a.q_proj, a.k_proj, a.v_proj, dtype=dtype), Stacked.of(c.k_proj, c.v_proj, dtype=dtype)
            )
            for a, c in ((layer.self_attn, layer.cross_attn) for layer in model.decoder_layers)
        ]
    if key is not None:
        model.__dict__["_decoding_weights"] = (key, made)
    return made


@dataclass
class LayerCache:
    """One decoder layer's incremental-decoding state."""

    weights: LayerWeights
    self_kv: list[Tensor] = field(default_factory=list)  # [keys, values], (B * beam, H, t, dk or dv); grows
    memory_kv: tuple[Tensor, Tensor] | None = None  # the memory's (keys, values), (B, H, S, dk or dv); step 1 on


@dataclass
class DecoderState:
    """What incremental decoding carries between steps. With beam hypotheses per sentence (B * beam
    rows, B = memory rows), rows are grouped by sentence: sentence i owns rows i * beam ... (i + 1) * beam - 1."""

    src_mask: Tensor  # (B, 1, 1, S) bool
    memory: Tensor | None  # (B, S, d), the encoder's output: projected by each layer at the first step, then None
    layers: list[LayerCache]
    output: Tensor  # the output projection transposed, (d, V) (decoding_weights)
    length: int = 0  # target positions decoded so far

    def make_contiguous(self) -> None:
        """Every tensor in a contiguous layout (copies only those that are not): for a compiled step."""
        for layer in self.layers:
            layer.self_kv = [t.contiguous() for t in layer.self_kv]
            if layer.memory_kv is not None:
                layer.memory_kv = tuple(t.contiguous() for t in layer.memory_kv)
        self.src_mask = self.src_mask.contiguous()
        if self.memory is not None:
            self.memory = self.memory.contiguous()

    def select(self, rows: Tensor, sentences: Tensor | None = None) -> None:
        """Keep/reorder hypotheses in place (beam search): row i becomes the former row rows[i].
        When sentences leave, `sentences` names those kept, in order (and `rows` only their rows)."""
        for layer in self.layers:
            layer.self_kv = [t.index_select(0, rows) for t in layer.self_kv]
            if sentences is not None and layer.memory_kv is not None:
                layer.memory_kv = tuple(t.index_select(0, sentences) for t in layer.memory_kv)
        if sentences is not None:
            self.src_mask = self.src_mask.index_select(0, sentences)
            if self.memory is not None:
                self.memory = self.memory.index_select(0, sentences)
