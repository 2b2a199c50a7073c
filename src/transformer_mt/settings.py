"""The model's settings, typed in one place: conf/model's keys. Hydra composes the model's YAML files onto them
(configs.py stores them as the group's `schema`), so a value of the wrong type is refused as the command line is
read, in one line naming the key; model.py's TransformerConfig checks the values and adds the vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

CHOICES = {  # the model's switches and their values; the first is the paper's
    "positions": ("sinusoidal", "learned"),
    "norm": ("post", "pre"),
    "share_embeddings": ("all", "decoder", "none"),
}


@dataclass
class ModelSettings:
    """conf/model: the Transformer's shape and switches (the paper's base model by default)."""

    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1  # P_drop (§5.4): residual branches and embedding sums
    max_positions: int = 1024
    d_k: int | None = None  # query/key size per head; None: d_model / n_heads (§3.2.2)
    d_v: int | None = None  # value size per head; None: d_model / n_heads
    positions: str = "sinusoidal"  # §3.5; or "learned": a trained table of max_positions rows (Table 3 row E)
    norm: str = "post"  # §3.1 LayerNorm(x + Sublayer(x)); or "pre": x + Sublayer(LayerNorm(x)), final LayerNorms
    share_embeddings: str = "all"  # §3.4 one matrix; "decoder": decoder input = output; "none": three matrices
