"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), in plain PyTorch.

Read top to bottom: positions -> embeddings -> attention -> feed-forward -> layers ->
encoder/decoder -> the model. Section numbers (§) refer to the paper.

Shapes: B batch, S source length, T target length, d d_model, H heads, hd = d / H, V vocab.
Masks: `src_pad` is a bool (B, S) tensor, True where the source token is padding.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

LAYER_NORM_EPS = 1e-5  # the paper does not say; torch.nn.Transformer's default
FEW_QUERIES = 8  # on CPU, attention with at most this many queries per row (decoding) uses SDPA's fused kernel


@dataclass
class TransformerConfig:
    vocab_size: int
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1  # P_drop (§5.4): residual branches and embedding sums
    max_positions: int = 1024
    pad_id: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):  # values from YAML or the command line: "abc" and 1.5 fail here, by name
            value, whole = getattr(self, f.name), f.type == "int"
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
                raise ValueError(f"{f.name}={value!r}: must be a {'whole number' if whole else 'number'}")
            if f.name != "pad_id" and not (0 <= value < 1 if f.name == "dropout" else value > 0):
                raise ValueError(f"{f.name}={value}: must be {'in [0, 1)' if f.name == 'dropout' else 'positive'}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.d_model % 2:
            raise ValueError(f"d_model={self.d_model} must be even for sin/cos positions (§3.5)")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id={self.pad_id} is outside the vocabulary of {self.vocab_size}")


def sinusoidal_positions(n_positions: int, d_model: int) -> Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same), interleaved."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d/2,)
    angle = pos / 10000.0 ** (two_i / d_model)  # (P, d/2)
    pe = torch.empty(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.float()


class Embedding(nn.Module):
    """§3.4 + §3.5: token embedding * sqrt(d_model) + positions, then dropout (§5.4)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.register_buffer("positions", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False)
        self.scale = math.sqrt(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        # ids: (B, L) -> (B, L, d); `start` is the position of ids[:, 0] (incremental decoding)
        end = start + ids.size(1)
        if end > self.positions.size(0):
            raise ValueError(
                f"sequence of length {end} exceeds max_positions={self.positions.size(0)}; "
                "truncate the input or raise model.max_positions"
            )
        x = self.tokens(ids) * self.scale + self.positions[start:end]
        return self.dropout(x)


def key_mask(src_pad: Tensor) -> Tensor:
    """(B, S) pad mask -> (B, 1, 1, S) bool mask for SDPA, True where attention may look.

    A boolean mask (not an additive -inf bias) keeps every dtype finite: SDPA returns zeros,
    not NaN, for a row whose keys are all padding (tested in test_model.py).
    """
    return ~src_pad[:, None, None, :]


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


class MultiHeadAttention(nn.Module):
    """§3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_H) W^O, via scaled dot-product attention."""

    weights: Tensor | None = None  # (B, H, Lq, Lk) of the last call, kept while recording (record_attention)

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.recording = False
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def split_heads(self, x: Tensor) -> Tensor:
        B, L, d = x.shape
        return x.view(B, L, self.n_heads, d // self.n_heads).transpose(1, 2)  # (B, H, L, hd)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def forward(
        self,
        query: Tensor,
        kv: tuple[Tensor, Tensor],
        mask: Tensor | None = None,
        causal: bool = False,
    ) -> Tensor:
        # query: (B, Lq, d); kv: keys and values already projected, each (B, H, Lk, hd)
        q = self.split_heads(self.q_proj(query))  # (B, H, Lq, hd)
        k, v = kv
        if self.recording:
            out, self.weights = explicit_attention(q, k, v, mask, causal)
        else:
            # On CPU in bf16, SDPA's fused kernel was slower than its math backend for whole sentences
            # (a Multi30k training step on an AVX512-BF16 CPU: 2,595 vs 3,347 target tokens/s), so use
            # math there. In fp32, and for decoding's few queries per row, the fused kernel is faster
            # (small model, fp32, 2-core EPYC: training +12% target tokens/s; greedy decoding +23%).
            bf16_sentences = q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.size(-2) > FEW_QUERIES
            with sdpa_kernel(SDPBackend.MATH) if bf16_sentences else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # (B, H, Lq, hd)
        B, H, Lq, hd = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, Lq, H * hd))


class FeedForward(nn.Module):
    """§3.3: FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.relu(self.w1(x)))


class Residual(nn.Module):
    """§3.1 and §5.4, post-norm: LayerNorm(x + Dropout(Sublayer(x)))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.dropout = nn.Dropout(cfg.dropout)
        self.norm = nn.LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS)

    def forward(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        return self.norm(x + self.dropout(sublayer_out))


class EncoderLayer(nn.Module):
    """§3.1: self-attention, then feed-forward, each wrapped in a post-norm residual."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.self_attn_res = Residual(cfg)
        self.ffn = FeedForward(cfg)
        self.ffn_res = Residual(cfg)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.self_attn_res(x, self.self_attn(x, self.self_attn.project_kv(x), mask=src_mask))
        return self.ffn_res(x, self.ffn(x))


class DecoderLayer(nn.Module):
    """§3.1: masked self-attention, encoder-decoder attention, feed-forward; post-norm each."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.self_attn_res = Residual(cfg)
        self.cross_attn = MultiHeadAttention(cfg)
        self.cross_attn_res = Residual(cfg)
        self.ffn = FeedForward(cfg)
        self.ffn_res = Residual(cfg)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, cache: LayerCache | None = None) -> Tensor:
        # Training: x is the whole shifted target (B, T, d), causal mask, no cache.
        # Decoding: x is the newest position of every hypothesis (B * beam, 1, d); the cache holds the
        # keys/values of earlier positions, each (B * beam, H, t, hd), extended in place, and the memory's
        # keys/values from the first step on. The newest query may see every cached key: no mask.
        # Every projection happens here, inside this layer's forward: FSDP gathers a wrapped layer's
        # weights around its forward only (outside it they are flat shards).
        k, v = self.self_attn.project_kv(x)
        if cache is not None and cache.self_kv:
            k, v = torch.cat([cache.self_kv[0], k], dim=2), torch.cat([cache.self_kv[1], v], dim=2)
        if cache is not None:
            cache.self_kv = [k, v]
        x = self.self_attn_res(x, self.self_attn(x, (k, v), causal=cache is None))
        if cache is not None and cache.memory_kv is not None:
            memory_kv = cache.memory_kv
        else:
            memory_kv = self.cross_attn.project_kv(memory)  # (B, H, S, hd) each, once per sentence
            if cache is not None:
                cache.memory_kv = memory_kv
        # The hypotheses of one sentence share its memory and attend to it as one block of queries
        # (B, beam, d): the memory's keys/values are neither copied per beam nor reordered.
        queries = x.view(memory_kv[0].size(0), -1, x.size(-1))
        x = self.cross_attn_res(x, self.cross_attn(queries, memory_kv, mask=src_mask).view_as(x))
        return self.ffn_res(x, self.ffn(x))


@dataclass
class LayerCache:
    """One decoder layer's incremental-decoding state."""

    self_kv: list[Tensor] = field(default_factory=list)  # [keys, values] each (B * beam, H, t, hd); grows
    memory_kv: tuple[Tensor, Tensor] | None = None  # the memory's (keys, values), each (B, H, S, hd); step 1 on


@dataclass
class DecoderState:
    """What incremental decoding carries between steps. With beam hypotheses per sentence (B * beam
    rows, B = memory rows), rows are grouped by sentence: sentence i owns rows i * beam ... (i + 1) * beam - 1."""

    src_mask: Tensor  # (B, 1, 1, S) bool
    memory: Tensor | None  # (B, S, d), the encoder's output: projected by each layer at the first step, then None
    layers: list[LayerCache]
    length: int = 0  # target positions decoded so far

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


class Transformer(nn.Module):
    """§3: encoder-decoder with one embedding matrix shared by both inputs and the output (§3.4)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)  # shared by encoder and decoder inputs
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        self.reset_parameters()

    @property
    def output_weight(self) -> Tensor:
        """The pre-softmax projection (§3.4): the embedding matrix itself, not scaled by sqrt(d)."""
        return self.embed.tokens.weight

    def reset_parameters(self) -> None:
        """Xavier-uniform linear weights with zero biases; embeddings N(0, d^-0.5), pad row zero."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        emb = self.embed.tokens.weight
        nn.init.normal_(emb, mean=0.0, std=self.cfg.d_model**-0.5)
        with torch.no_grad():
            emb[self.cfg.pad_id].zero_()

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) ids -> memory (B, S, d) and the source pad mask (B, S)."""
        src_pad = src.eq(self.cfg.pad_id)
        src_mask = key_mask(src_pad)
        x = self.embed(src)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return x, src_pad

    def project(self, h: Tensor) -> Tensor:
        return F.linear(h, self.output_weight)  # (..., d) -> (..., V)

    def features(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing up to the last decoder layer: (B, S), (B, T) -> (B, T, d)."""
        memory, src_pad = self.encode(src)
        src_mask = key_mask(src_pad)
        x = self.embed(tgt_in)
        for layer in self.decoder_layers:
            x = layer(x, memory, src_mask)
        return x

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) = BOS + target[:-1] -> logits (B, T, V)."""
        return self.project(self.features(src, tgt_in))

    def start_decoding(self, memory: Tensor, src_pad: Tensor) -> DecoderState:
        """The state of incremental decoding: each layer projects the memory's keys/values at the first
        step, once per sentence (shared by its beam hypotheses), and keeps them."""
        return DecoderState(key_mask(src_pad), memory, [LayerCache() for _ in self.decoder_layers])

    def decode_step(self, prev: Tensor, state: DecoderState) -> Tensor:
        """prev (B * beam,) = the token at position state.length -> logits (B * beam, V) for the next one.

        Extends `state` in place; equal to forward()'s logits at that position.
        """
        x = self.embed(prev[:, None], start=state.length)  # (B * beam, 1, d)
        for layer, cache in zip(self.decoder_layers, state.layers):
            x = layer(x, state.memory, state.src_mask, cache=cache)
        state.length, state.memory = state.length + 1, None  # every layer holds its projection now
        return self.project(x[:, 0])


@contextlib.contextmanager
def record_attention(model: Transformer) -> Iterator[dict[str, list[MultiHeadAttention]]]:
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


def training_flops(cfg: TransformerConfig, src_lens: Tensor, tgt_lens: Tensor) -> float:
    """Model FLOPs of one training step (forward + backward) over sentences of these real lengths
    (source with EOS, target with EOS): useful work only, padding excluded. The one count behind every
    "model FLOP/s" and MFU figure.

    Forward, per token: 2 FLOPs per weight of each matrix product it passes through; per query-key
    pair, 2 * 2 * d for QK^T and AV. Backward costs twice the forward: x 3 in all.

      encoder layer:  S * (4 d^2 + 2 d d_ff) + 2 d * S^2
      decoder layer:  T * (6 d^2 + 2 d d_ff) + S * 2 d^2 (cross-attention keys/values over the source)
                      + 2 d * (T (T + 1) / 2 + T * S)  (self-attention is causal: T (T + 1) / 2 pairs)
      output:         T * d * V  (tied to the embedding, §3.4: no parameter of its own, but a product)
    """
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    S, T = src_lens.double(), tgt_lens.double()
    n_src, n_tgt = S.sum(), T.sum()
    encoder = n_src * (4 * d * d + 2 * d * f) + 2 * d * (S**2).sum()
    decoder = n_tgt * (6 * d * d + 2 * d * f) + n_src * 2 * d * d + 2 * d * (T * (T + 1) / 2 + T * S).sum()
    multiply_adds = cfg.n_encoder_layers * encoder + cfg.n_decoder_layers * decoder + n_tgt * d * v
    return float(3 * 2 * multiply_adds)
