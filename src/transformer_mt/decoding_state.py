"""Decoding for model.Transformer (start_decoding -> decode_step): copies of its weights laid out for decoding's few
rows (Projection, decoding_weights), each decoder layer's step through them (LayerCache.step: the layer's
keys/values, extended at every step and reordered as beam search moves its hypotheses, and its attention over
them), and the encoder's layers through them for the sources of a batch (EncoderWeights). Decoding runs in eval
mode (search.start_decoding checks): no dropout here.

Two forms. By default the cache grows by a position each step and finished sentences leave the batch (search.py):
the least work, on a CPU the fastest. With constant shapes (DecoderState.capacity: Transformer.constant_shapes,
compile=static) every step has the same shapes: the cache is allocated for `capacity` positions and written at
the step's position (a tensor, not a Python number), attention masks the positions not yet written, and search.py
keeps finished sentences in the batch, masked; what a compiled step replayed as one CUDA graph needs.

Shapes as in model.py: B sentences (memory rows), beam hypotheses each, H heads, t positions decoded so far.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@functools.cache
def onednn_packs() -> bool:
    """Whether this torch can multiply by oneDNN's packed weights on the CPU (mkldnn::_linear_pointwise, what
    inductor's CPU linear uses)."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
    )


class Projection(NamedTuple):
    """Linear layers that read the same input, as one product for decoding: their weights stacked and laid out for a
    few rows at a time, their biases, and the width of each. On a CPU in fp32, the weight is packed in oneDNN's
    layout: a step multiplies 4-64 rows, where MKL reached 40-50% of its large-matrix speed (Multi30k's
    decoder step with the output layer, 4 rows, on a 2-core AVX-512 EPYC: 1.1 ms with MKL, 0.55 ms packed; the
    same results to ~1e-6). Elsewhere (a GPU, autocast, a compiled step) the weight is (d_in, sum of widths),
    contiguous: a few rows multiply faster by it than by nn.Linear's (out, d_in) (1.2-1.9x on 2 cores)."""

    weight: Tensor
    bias: Tensor | None
    widths: list[int]
    packed: bool

    @classmethod
    def of(cls, weights: list[Tensor], biases: list[Tensor] | None, dtype: torch.dtype, pack: bool) -> Projection:
        weight = torch.cat(weights).to(dtype)
        bias = torch.cat(biases).to(dtype) if biases else None
        pack = pack and weight.device.type == "cpu" and dtype == torch.float32 and onednn_packs()
        weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if pack else weight.t().contiguous()
        return cls(weight, bias, [w.size(0) for w in weights], pack)

    @classmethod
    def of_layers(cls, *layers: nn.Linear, dtype: torch.dtype, pack: bool) -> Projection:
        return cls.of([layer.weight for layer in layers], [layer.bias for layer in layers], dtype, pack)

    def __call__(self, x: Tensor, relu: bool = False) -> Tensor:
        """x (..., d_in) -> (..., sum of widths); relu: max(0, .) of it, in the same product where packed."""
        rows = x.reshape(-1, x.size(-1))
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "relu" if relu else "none", [], "")
        else:
            out = rows @ self.weight if self.bias is None else torch.addmm(self.bias, rows, self.weight)
            out = torch.relu(out) if relu else out
        return out.view(*x.shape[:-1], out.size(-1))

    def plus(self, x: Tensor, residual: Tensor) -> Tensor:
        """residual + x W + b, (rows, d_in), (rows, width) -> (rows, width): a sublayer's last product and its
        residual connection, one operation where packed."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        return residual + self(x)  # (promoted as the model's residual: fp32 + a bf16 product under autocast)

    def parts(self, x: Tensor) -> tuple[Tensor, ...]:
        """x through the product, cut into each layer's output (q, k, v for self-attention's)."""
        return self(x).split(self.widths, dim=-1)


class LayerWeights(NamedTuple):
    """One decoder layer's projections for decoding (Projection), stacked where they read the same input."""

    self_qkv: Projection  # self-attention's W_q, W_k, W_v: one product per step
    self_out: Projection  # self-attention's W_O
    cross_q: Projection  # encoder-decoder attention's W_q
    memory_kv: Projection  # its W_k, W_v: one product per sentence, at the first step
    cross_out: Projection
    ffn_in: Projection  # the feed-forward's W_1
    ffn_out: Projection  # and W_2


class EncoderWeights(NamedTuple):
    """One encoder layer's projections, as LayerWeights: for encoding the sources of a batch to decode."""

    self_qkv: Projection  # self-attention's W_q, W_k, W_v: one product
    self_out: Projection  # its W_O
    ffn_in: Projection  # the feed-forward's W_1
    ffn_out: Projection  # and W_2

    def layer(self, layer: nn.Module, x: Tensor, src_mask: Tensor) -> Tensor:
        """model.EncoderLayer.forward in eval mode through these copies: (B, S, d) -> (B, S, d)."""
        B, S, d = x.shape
        attention = layer.self_attn

        def attend(h: Tensor) -> Tensor:  # (B * S, d) -> (B * S, H dv), before W_O
            q, k, v = map(attention.split_heads, self.self_qkv.parts(h.view(B, S, d)))  # one product
            return attention.attend(q, k, v, mask=src_mask).view(B * S, -1)

        x = sublayer(layer.self_attn_res, x.reshape(B * S, d), attend, self.self_out)
        return sublayer(layer.ffn_res, x, lambda h: self.ffn_in(h, relu=True), self.ffn_out).view(B, S, d)


class Copies(NamedTuple):
    """Decoding's copies of a Transformer's weights (decoding_weights)."""

    output: Projection  # the output projection, (d) -> (V)
    decoder: list[LayerWeights]
    encoder: list[EncoderWeights]  # empty where made without (decoding_weights' encoder=False)


def decoding_weights(model: nn.Module, pack: bool = True, encoder: bool = True) -> Copies:
    """Decoding's copies of a Transformer's weights (Projection): the output projection, each decoder layer's
    LayerWeights and each encoder layer's EncoderWeights, in autocast's format where autocast is on (cast once here,
    not at every step: autocast keeps casts of parameters only); pack=False: never oneDNN's layout (a compiled step);
    encoder=False: no encoder copies (a compiled encode takes none). Only a model for inference packs.

    A model being trained gets them made anew for each batch (start_decoding): fused Adam, which training uses,
    updates parameters in place without bumping their version counter, and a copy kept across batches went stale
    in training's validation (greedy BLEU 3.3 instead of ~9 after 300 Multi30k updates). A model for inference
    (none of these weights requires a gradient: load_for_inference) keeps them while they are the same tensors
    at the same version (load_state_dict's copy bumps it): the output matrix alone is a copy of V x d (1.5 ms for
    Multi30k's, more for WMT14's 37,000 x 512), paid once instead of for every batch."""
    weight = model.output_weight
    on = torch.is_autocast_enabled(weight.device.type)
    dtype = torch.get_autocast_dtype(weight.device.type) if on else weight.dtype
    encoding = model.encoder_layers if encoder else []
    layers = [*map(decoder_linears, model.decoder_layers), *map(encoder_linears, encoding)]
    sources = [weight, *(t for groups in layers for group in groups for lin in group for t in (lin.weight, lin.bias))]
    sources = [t for t in sources if t is not None]  # (a layer without bias)
    inference = not any(t.requires_grad for t in sources)
    pack = pack and inference  # packing costs ~0.4 ms a matrix: only where the copies are kept
    key = (dtype, pack, encoder, *((t.data_ptr(), t._version) for t in sources)) if inference else None
    if key is not None and (kept := model.__dict__.get("_decoding_weights")) and kept[0] == key:
        return kept[1]
    with torch.no_grad():
        copies = [[Projection.of_layers(*group, dtype=dtype, pack=pack) for group in groups] for groups in layers]
    n = len(model.decoder_layers)
    made = Copies(
        Projection.of([weight], None, dtype, pack),
        [LayerWeights(*projections) for projections in copies[:n]],
        [EncoderWeights(*projections) for projections in copies[n:]],
    )
    if key is not None:
        model.__dict__["_decoding_weights"] = (key, made)
    return made


def decoder_linears(layer: nn.Module) -> tuple[tuple[nn.Linear, ...], ...]:
    """A model.DecoderLayer's linear layers, grouped as LayerWeights stacks them."""
    a, c, f = layer.self_attn, layer.cross_attn, layer.ffn
    self_attention = (a.q_proj, a.k_proj, a.v_proj), (a.out_proj,)
    return *self_attention, (c.q_proj,), (c.k_proj, c.v_proj), (c.out_proj,), (f.w1,), (f.w2,)


def encoder_linears(layer: nn.Module) -> tuple[tuple[nn.Linear, ...], ...]:
    """A model.EncoderLayer's, grouped as EncoderWeights stacks them."""
    a, f = layer.self_attn, layer.ffn
    return (a.q_proj, a.k_proj, a.v_proj), (a.out_proj,), (f.w1,), (f.w2,)


@dataclass
class LayerCache:
    """One decoder layer's incremental-decoding state, and its attention over it."""

    weights: LayerWeights
    self_kv: list[Tensor] = field(default_factory=list)  # [keys, values], (B * beam, H, t or capacity, dk or dv)
    memory_kv: tuple[Tensor, Tensor] | None = None  # the memory's (keys, values), (B, H, S, dk or dv); step 1 on
    capacity: int | None = None  # constant shapes: positions allocated (None: the cache grows)
    position: Tensor | None = None  # constant shapes: the position decoded now, (1,) int64

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """The step's keys and values (rows, H, 1, d) added: (every key, every value, the mask of those written
        so far or None where all are)."""
        if self.capacity is None:
            if self.self_kv:
                k, v = torch.cat([self.self_kv[0], k], dim=2), torch.cat([self.self_kv[1], v], dim=2)
            self.self_kv = [k, v]
            return k, v, None
        if not self.self_kv:  # allocated at the first step (before the beam expands the rows)
            self.self_kv = [t.new_zeros(*t.shape[:2], self.capacity, t.size(-1)) for t in (k, v)]
        for t, new in zip(self.self_kv, (k, v)):  # in place: the step writes its own position only
            t.index_copy_(2, self.position, new)
        written = (torch.arange(self.capacity, device=k.device) <= self.position)[None, :]  # (1, capacity)
        return *self.self_kv, written

    def step(self, layer: nn.Module, x: Tensor, memory: Tensor | None, src_mask: Tensor) -> Tensor:
        """model.DecoderLayer.forward for the newest position of every hypothesis, x (rows, d) -> (rows, d), through
        decoding's copies: each sublayer's last product adds its residual (Projection.plus), the LayerNorms are
        called as functions, and no module is called per step but the attention's `attend` (a step is a hundred
        small operations, and a module call costs as much as one)."""
        w = self.weights
        x = sublayer(layer.self_attn_res, x, lambda h: self.self_attention(layer.self_attn, h), w.self_out)
        x = sublayer(layer.cross_attn_res, x, lambda h: self.cross_attention(layer.cross_attn, h, memory, src_mask),
                     w.cross_out)  # fmt: skip
        return sublayer(layer.ffn_res, x, lambda h: w.ffn_in(h, relu=True), w.ffn_out)

    def self_attention(self, attention: nn.Module, h: Tensor) -> Tensor:
        """model.MultiHeadAttention over the cache, before W_O: the newest position of each hypothesis, h (rows, d),
        attends to every position decoded so far (no causal mask: nothing later is there) -> (rows, H dv)."""
        rows, heads = h.size(0), attention.n_heads
        q, k, v = (t.view(rows, heads, 1, -1) for t in self.weights.self_qkv.parts(h))  # one product
        k, v, written = self.extend(k, v)
        return attention.attend(q, k, v, mask=written).view(rows, -1)

    def cross_attention(self, attention: nn.Module, h: Tensor, memory: Tensor | None, src_mask: Tensor) -> Tensor:
        """Encoder-decoder attention, before W_O: the memory's keys/values projected at the first step, once per
        sentence. The hypotheses of one sentence share its memory and attend to it as one block of queries
        (B, beam, d): the memory's keys/values are neither copied per beam nor reordered."""
        if self.memory_kv is None:  # (B, H, S, dk), (B, H, S, dv)
            self.memory_kv = tuple(map(attention.split_heads, self.weights.memory_kv.parts(memory)))
        k, v = self.memory_kv
        q = attention.split_heads(self.weights.cross_q(h.view(k.size(0), -1, h.size(-1))))
        return attention.attend(q, k, v, mask=src_mask).view(h.size(0), -1)


def sublayer(residual: nn.Module, x: Tensor, inner: Callable[[Tensor], Tensor], last: Projection) -> Tensor:
    """model.Residual (its LayerNorm and norm switch) around a sublayer whose last product is `last`, in eval mode
    (no dropout): post-norm LayerNorm(x + last(inner(x))), pre-norm x + last(inner(LayerNorm(x)))."""
    norm = residual.norm
    if residual.pre:
        return last.plus(inner(F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)), x)
    return F.layer_norm(last.plus(inner(x), x), norm.normalized_shape, norm.weight, norm.bias, norm.eps)


@dataclass
class DecoderState:
    """What incremental decoding carries between steps. With beam hypotheses per sentence (B * beam
    rows, B = memory rows), rows are grouped by sentence: sentence i owns rows i * beam ... (i + 1) * beam - 1."""

    src_mask: Tensor  # (B, 1, 1, S) bool
    memory: Tensor | None  # (B, S, d), the encoder's output: projected by each layer at the first step, then None
    layers: list[LayerCache]
    output: Projection  # the output projection, (d) -> (V) (decoding_weights)
    length: int = 0  # target positions decoded so far (the cache that grows)
    position: Tensor | None = None  # constant shapes: the same, as a (1,) tensor, which a compiled step takes as input

    @classmethod
    def start(cls, src_mask: Tensor, memory: Tensor, layers: list[LayerWeights], output: Projection,
              capacity: int | None = None) -> DecoderState:  # fmt: skip
        """capacity: constant shapes, a cache of that many positions (at least the longest output and its EOS)."""
        state = cls(src_mask, memory, [LayerCache(weights, capacity=capacity) for weights in layers], output)
        if capacity is not None:
            state.at(torch.zeros(1, dtype=torch.long, device=memory.device))
        return state

    def start_position(self) -> int | Tensor:
        """Where the step's token is: a number, or with constant shapes a (1,) tensor."""
        return self.length if self.position is None else self.position

    def advance(self) -> None:
        """One position decoded: every layer holds the memory's projection, the next step writes one further."""
        self.memory = None
        if self.position is None:
            self.length += 1
        else:
            self.at(self.position + 1)

    def at(self, position: Tensor) -> None:
        self.position = position
        for layer in self.layers:
            layer.position = position

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
