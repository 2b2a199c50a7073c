"""The incremental-decoding cache of model.Transformer (start_decoding -> decode_step): each decoder layer's
keys/values, extended at every step by the layer itself and reordered as beam search moves its hypotheses.

Shapes as in model.py: B sentences (memory rows), beam hypotheses each, H heads, t positions decoded so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LayerCache:
    """One decoder layer's keys/values between steps."""

    self_kv: tuple[Tensor, Tensor] | None = None  # (B * beam, H, t, dk or dv) each; grows by a position per step
    memory_kv: tuple[Tensor, Tensor] | None = None  # the memory's, (B, H, S, dk or dv) each; from the first step on

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The step's keys and values (rows, H, 1, dk or dv) appended: every position's, kept for the next step."""
        if self.self_kv is not None:
            k, v = torch.cat([self.self_kv[0], k], dim=2), torch.cat([self.self_kv[1], v], dim=2)
        self.self_kv = k, v
        return k, v


@dataclass
class DecoderState:
    """What incremental decoding carries between steps. With beam hypotheses per sentence (B * beam
    rows, B = memory rows), rows are grouped by sentence: sentence i owns rows i * beam ... (i + 1) * beam - 1."""

    src_mask: Tensor  # (B, 1, 1, S) bool
    memory: Tensor | None  # (B, S, d), the encoder's output: projected by each layer at the first step, then None
    layers: list[LayerCache]
    length: int = 0  # target positions decoded so far

    def make_contiguous(self) -> None:
        """Every tensor in a contiguous layout (copies only those that are not): for a compiled step."""
        for layer in self.layers:
            for name in ("self_kv", "memory_kv"):
                if (kv := getattr(layer, name)) is not None:
                    setattr(layer, name, tuple(t.contiguous() for t in kv))
        self.src_mask = self.src_mask.contiguous()
        if self.memory is not None:
            self.memory = self.memory.contiguous()

    def select(self, rows: Tensor, sentences: Tensor | None = None) -> None:
        """Keep/reorder hypotheses in place (beam search): row i becomes the former row rows[i].
        When sentences leave, `sentences` names those kept, in order (and `rows` only their rows)."""
        for layer in self.layers:
            if layer.self_kv is not None:
                layer.self_kv = tuple(t.index_select(0, rows) for t in layer.self_kv)
            if sentences is not None and layer.memory_kv is not None:
                layer.memory_kv = tuple(t.index_select(0, sentences) for t in layer.memory_kv)
        if sentences is not None:
            self.src_mask = self.src_mask.index_select(0, sentences)
            if self.memory is not None:
                self.memory = self.memory.index_select(0, sentences)
