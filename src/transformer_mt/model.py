"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), in plain PyTorch.

Read top to bottom: positions -> embeddings -> attention -> feed-forward -> layers -> encoder/decoder -> the model.
Section numbers (§) refer to the paper. Beside it: decoding_state.py (the incremental-decoding cache these layers
fill) and attention_recording.py (attention weights made visible). Shapes: B batch, S source length, T target length,
d d_model, H heads, dk / dv the query-key / value size per head (d / H by default, §3.2.2), V vocab. `src_pad` is a
bool (B, S) tensor, True at source padding. The defaults are the paper's model; the switches of its Table 3 and of
later work are off by default: d_k / d_v apart from d_model / H (rows A, B), learned positions (row E), pre-norm
(fairseq's --encoder-normalize-before), and less embedding sharing than §3.4's three-way tie.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_mt.attention_recording import explicit_attention
from transformer_mt.decoding_state import DecoderState, LayerCache
from transformer_mt.settings import CHOICES, ModelSettings


@dataclass(kw_only=True)
class TransformerConfig(ModelSettings):
    """The model's settings (settings.py, conf/model) and what the data gives: the vocabulary's size and pad id."""

    vocab_size: int
    pad_id: int = 0

    def __post_init__(self) -> None:
        for f in fields(ModelSettings):  # their types are checked as Hydra composes the config (settings.py)
            value = getattr(self, f.name)
            if f.name in CHOICES:
                if value not in CHOICES[f.name]:
                    raise ValueError(f"{f.name}={value!r}: must be one of {', '.join(CHOICES[f.name])}")
            elif f.name == "dropout":
                if not 0 <= value < 1:
                    raise ValueError(f"dropout={value}: must be in [0, 1)")
            elif value is not None and value <= 0:  # a size (d_k and d_v may be None: d_model / n_heads)
                raise ValueError(f"{f.name}={value}: must be positive")
        if (self.d_k is None or self.d_v is None) and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; or set d_k and d_v per head"
            )
        if self.d_model % 2 and self.positions == "sinusoidal":
            raise ValueError(f"d_model={self.d_model} must be even for sin/cos positions (§3.5)")

    @property
    def head_sizes(self) -> tuple[int, int]:
        """(d_k, d_v): the query/key and value sizes of one head."""
        default = self.d_model // self.n_heads
        return self.d_k or default, self.d_v or default


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
    """§3.4 + §3.5: token embedding * sqrt(d_model) + positions, then dropout (§5.4). `sides`: the stacks it serves.
    Sinusoids are one fixed table; positions="learned" (Table 3 row E) trains one table per stack, as fairseq."""

    def __init__(self, cfg: TransformerConfig, sides: tuple[str, ...] = ("source", "target")):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.learned = cfg.positions == "learned"
        if self.learned:  # initialised in Transformer.reset_parameters
            self.positions = nn.ParameterDict({side: torch.empty(cfg.max_positions, cfg.d_model) for side in sides})
        else:
            self.register_buffer("positions", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False)
        self.max_positions = cfg.max_positions
        self.scale = math.sqrt(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: Tensor, start: int = 0, side: str = "target") -> Tensor:
        # ids: (B, L) -> (B, L, d); `start` is the position of ids[:, 0]
        table = self.positions[side] if self.learned else self.positions
        end = start + ids.size(1)
        if end > self.max_positions:
            raise ValueError(
                f"sequence of length {end} exceeds max_positions={self.max_positions}; "
                "truncate the input or raise model.max_positions"
            )
        x = self.tokens(ids) * self.scale + table[start:end]
        return self.dropout(x)


def key_mask(src_pad: Tensor) -> Tensor:
    """(B, S) pad mask -> (B, 1, 1, S) bool mask for SDPA, True where attention may look. A boolean mask (not an
    additive -inf bias) keeps every dtype finite: SDPA returns zeros, not NaN, for a row of padding keys only."""
    return ~src_pad[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """§3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_H) W^O, via scaled dot-product attention.
    W^Q_i, W^K_i are d x d_k and W^V_i is d x d_v, stored for all heads at once: (d, H dk), (d, H dv)."""

    weights: Tensor | None = None  # (B, H, Lq, Lk) of the last call, kept while recording (record_attention)

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.recording = False
        d_k, d_v = cfg.head_sizes
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * d_k)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_heads * d_k)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_heads * d_v)
        self.out_proj = nn.Linear(cfg.n_heads * d_v, cfg.d_model)

    def split_heads(self, x: Tensor) -> Tensor:
        B, L, width = x.shape  # width = H * dk (queries, keys) or H * dv (values)
        return x.view(B, L, self.n_heads, width // self.n_heads).transpose(1, 2)  # (B, H, L, dk or dv)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def forward(
        self, query: Tensor, kv: tuple[Tensor, Tensor], mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        # query: (B, Lq, d); kv: keys (B, H, Lk, dk) and values (B, H, Lk, dv), already projected
        q, (k, v) = self.split_heads(self.q_proj(query)), kv
        if self.recording:
            out, self.weights = explicit_attention(q, k, v, mask, causal)
        else:  # SDPA's kernel is the caller's choice (runtime.sentence_attention)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # (B, H, Lq, dv)
        B, H, Lq, d_v = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, Lq, H * d_v))


class FeedForward(nn.Module):
    """§3.3: FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.relu(self.w1(x)))


class Residual(nn.Module):
    """§3.1 and §5.4, post-norm: LayerNorm(x + Dropout(Sublayer(x))).
    norm="pre": x + Dropout(Sublayer(LayerNorm(x))), the residual stream itself never normalised."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.pre = cfg.norm == "pre"
        self.dropout = nn.Dropout(cfg.dropout)
        self.norm = nn.LayerNorm(cfg.d_model)  # eps 1e-5: the paper does not say; torch.nn.Transformer's default

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """§3.1: self-attention, then feed-forward, each wrapped in a residual."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.self_attn_res = Residual(cfg)
        self.ffn = FeedForward(cfg)
        self.ffn_res = Residual(cfg)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.self_attn_res(x, lambda h: self.self_attn(h, self.self_attn.project_kv(h), mask=src_mask))
        return self.ffn_res(x, self.ffn)


class DecoderLayer(nn.Module):
    """§3.1: masked self-attention, encoder-decoder attention, feed-forward; each in a residual."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.self_attn_res = Residual(cfg)
        self.cross_attn = MultiHeadAttention(cfg)
        self.cross_attn_res = Residual(cfg)
        self.ffn = FeedForward(cfg)
        self.ffn_res = Residual(cfg)

    def forward(self, x: Tensor, memory: Tensor | None, src_mask: Tensor, cache: LayerCache | None = None) -> Tensor:
        # Training: x is the whole shifted target (B, T, d), causal mask, no cache. Decoding: x is the newest position
        # of every hypothesis (B * beam, 1, d), which may see every cached key (no mask); the cache holds the earlier
        # positions' keys/values and from the first step on the memory's (then None). Every projection happens in
        # this forward: FSDP gathers a wrapped layer's weights around its forward only (outside it: flat shards).

        def self_attention(h: Tensor) -> Tensor:  # h: x, or LayerNorm(x) in pre-norm
            kv = self.self_attn.project_kv(h)
            if cache is not None:
                kv = cache.extend(*kv)
            return self.self_attn(h, kv, causal=cache is None)

        def cross_attention(h: Tensor) -> Tensor:
            kv = cache.memory_kv if cache is not None and memory is None else self.cross_attn.project_kv(memory)
            if cache is not None:
                cache.memory_kv = kv  # (B, H, S, dk), (B, H, S, dv): once per sentence
            # The hypotheses of one sentence share its memory and attend to it as one block of queries
            # (B, beam, d): the memory's keys/values are neither copied per beam nor reordered.
            return self.cross_attn(h.view(kv[0].size(0), -1, h.size(-1)), kv, mask=src_mask).view_as(h)

        x = self.self_attn_res(x, self_attention)
        x = self.cross_attn_res(x, cross_attention)
        return self.ffn_res(x, self.ffn)


class Transformer(nn.Module):
    """§3: encoder-decoder with one embedding matrix shared by both inputs and the output (§3.4).

    share_embeddings="decoder": the encoder has an embedding of its own (`src_embed`), the decoder's input
    is still the output projection; "none": the output projection too has its own matrix (`output`).
    norm="pre": each stack ends with a LayerNorm (`encoder_norm`, `decoder_norm`), as fairseq and
    torch.nn.Transformer(norm_first=True); without it the residual stream would reach the output unnormalised."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.share_embeddings == "all":
            self.embed = Embedding(cfg)  # both inputs (and the output)
        else:
            self.embed = Embedding(cfg, sides=("target",))  # the decoder's input
            self.src_embed = Embedding(cfg, sides=("source",))
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        if cfg.norm == "pre":
            self.encoder_norm = nn.LayerNorm(cfg.d_model)
            self.decoder_norm = nn.LayerNorm(cfg.d_model)
        if cfg.share_embeddings == "none":
            self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @property
    def encoder_embed(self) -> Embedding:
        return self.embed if self.cfg.share_embeddings == "all" else self.src_embed

    @property
    def output_weight(self) -> Tensor:
        """The pre-softmax projection (§3.4): the embedding matrix itself, not scaled by sqrt(d)."""
        return self.output.weight if self.cfg.share_embeddings == "none" else self.embed.tokens.weight

    def reset_parameters(self) -> None:
        """Xavier-uniform linear weights with zero biases; embedding matrices (and learned positions, and an
        untied output matrix) N(0, d^-0.5), pad rows zero."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        matrices = [self.embed.tokens.weight, self.encoder_embed.tokens.weight, self.output_weight]
        if self.cfg.positions == "learned":
            matrices += [self.encoder_embed.positions["source"], self.embed.positions["target"]]
        for weight in {id(w): w for w in matrices}.values():  # each matrix once, in this order
            nn.init.normal_(weight, mean=0.0, std=self.cfg.d_model**-0.5)
        with torch.no_grad():
            for tokens in {id(e): e.tokens for e in (self.embed, self.encoder_embed)}.values():
                tokens.weight[self.cfg.pad_id].zero_()

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) ids -> memory (B, S, d) and the source pad mask (B, S)."""
        src_pad = src.eq(self.cfg.pad_id)
        src_mask = key_mask(src_pad)
        x = self.encoder_embed(src, side="source")
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.final_norm(x, "encoder"), src_pad

    def final_norm(self, x: Tensor, stack: str) -> Tensor:
        """Pre-norm's LayerNorm after the last layer of a stack; post-norm's layers end normalised."""
        return getattr(self, f"{stack}_norm")(x) if self.cfg.norm == "pre" else x

    def project(self, h: Tensor) -> Tensor:
        return F.linear(h, self.output_weight)  # (..., d) -> (..., V)

    def features(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing up to the last decoder layer: (B, S), (B, T) -> (B, T, d)."""
        memory, src_pad = self.encode(src)
        src_mask = key_mask(src_pad)
        x = self.embed(tgt_in)
        for layer in self.decoder_layers:
            x = layer(x, memory, src_mask)
        return self.final_norm(x, "decoder")

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) = BOS + target[:-1] -> logits (B, T, V)."""
        return self.project(self.features(src, tgt_in))

    def start_decoding(self, memory: Tensor, src_pad: Tensor) -> DecoderState:
        """Incremental decoding's state: each layer keeps the memory's keys/values from the first step on."""
        return DecoderState(key_mask(src_pad), memory, [LayerCache() for _ in self.decoder_layers])

    def decode_step(self, prev: Tensor, state: DecoderState) -> Tensor:
        """prev (B * beam,) = the token at position state.length -> logits (B * beam, V) for the next one.
        Extends `state` in place; equal to forward()'s logits at that position."""
        x = self.embed(prev[:, None], start=state.length)  # (B * beam, 1, d)
        for layer, cache in zip(self.decoder_layers, state.layers):
            x = layer(x, state.memory, state.src_mask, cache=cache)
        state.length, state.memory = state.length + 1, None  # every layer holds the memory's projection now
        return self.project(self.final_norm(x[:, 0], "decoder"))


def training_flops(cfg: TransformerConfig, src_lens: Sequence[int] | Tensor, tgt_lens: Sequence[int] | Tensor) -> float:
    """Model FLOPs of one training step (forward + backward) over sentences of these real lengths (with EOS):
    padding excluded; the one count behind every "model FLOP/s" and MFU figure. Forward, per token: 2 FLOPs per
    weight of each matrix product it passes through; per query-key pair, 2 * (a + b) for QK^T and AV, where
    a = H d_k and b = H d_v (both d_model in the paper). Backward costs twice the forward: x 3 in all.

      encoder layer:  S * (2 d (a + b) + 2 d d_ff) + (a + b) * S^2
      decoder layer:  T * (3 d (a + b) + 2 d d_ff) + S * d (a + b) (cross-attention keys/values over the source)
                      + (a + b) * (T (T + 1) / 2 + T * S)  (self-attention is causal: T (T + 1) / 2 pairs)
      output:         T * d * V  (tied or not, a product)
    """
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    a, b = (cfg.n_heads * size for size in cfg.head_sizes)
    S, T = [float(n) for n in src_lens], [float(n) for n in tgt_lens]  # host numbers (training's come from collate)
    n_src, n_tgt = sum(S), sum(T)
    encoder = n_src * (2 * d * (a + b) + 2 * d * f) + (a + b) * sum(s * s for s in S)
    pairs = sum(t * (t + 1) / 2 + t * s for s, t in zip(S, T, strict=True))
    decoder = n_tgt * (3 * d * (a + b) + 2 * d * f) + n_src * d * (a + b) + (a + b) * pairs
    multiply_adds = cfg.n_encoder_layers * encoder + cfg.n_decoder_layers * decoder + n_tgt * d * v
    return float(3 * 2 * multiply_adds)
