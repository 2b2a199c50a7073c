"""The typed settings of the commands: each key of conf/ that they read, with its type, in one place. Hydra
composes the YAML files onto them (configs.py), so a wrong type or an unknown key is refused as the command line is
read, in one line naming it; ranges are checked where the values are used. The groups trainer (Lightning's
arguments, which +trainer.<key>=... extends) and logger keep their own keys; decoding's are decoding.Decoding's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass
class DataSettings:
    """conf/data: the corpus (corpus.Corpus's fields), its vocabulary and filters, and the batches (datamodule.py)."""

    name: str
    src_lang: str
    tgt_lang: str
    path: str | None
    hub_name: str | None
    hub_config: str | None
    text_files: Any  # {split: file prefix} or null: a typed dict could not be set from the command line
    vocab_size: int
    spm_max_sentences: int
    max_len: int
    max_len_ratio: float | None
    max_tokens: Any  # a number of tokens, or "auto"
    max_tokens_fallback: int
    tokens_per_update: int | None
    num_workers: int
    seed: int
    cache_dir: str


@dataclass
class Optim:
    lr_factor: float
    warmup_steps: int
    betas: tuple[float, float]
    eps: float


@dataclass
class Budget:
    warmup: float
    cooldown: float
    average_span: float
    margin: float


@dataclass
class Checkpoint:
    every_n_train_steps: int | None
    train_time_interval_minutes: float | None
    every_n_epochs: int | None
    keep_last: int
    best_monitor: str | None
    best_mode: str


@dataclass
class Final:
    enabled: bool
    average_last: int
    splits: list[str]


@dataclass
class TrainSettings:
    """conf/train.yaml, its values and comments; its groups model, data, trainer, logger and decoding."""

    seed: int
    label_smoothing: float
    optim: Optim
    budget: Budget
    val_bleu_sentences: int
    checkpoint: Checkpoint
    early_stopping_patience: int | None
    progress_every_n_updates: int
    progress_every_seconds: float
    ema_decay: float | None
    final: Final
    table3_row: Any
    ckpt_path: str | None
    model: ModelSettings
    data: DataSettings
    trainer: dict[str, Any]
    logger: Any
    decoding: Any  # decoding.Decoding (configs.py stores it as the group decoding)


@dataclass
class InferenceSettings:
    """conf/inference.yaml: what make evaluate, translate and tune share."""

    ckpt: str
    device: str
    threads: int
    n_best: int
    tokens_per_batch: int
    engine: str
    compile: bool
    tuned: Any  # auto or false
    ct2_compute_type: str
    decoding: Any  # decoding.Decoding


@dataclass
class EvaluateSettings(InferenceSettings):
    src: str | None
    ref: str | None
    testset: str | None
    langpair: str | None
    data_path: str | None
    split: str


@dataclass
class TranslateSettings(InferenceSettings):
    batch_lines: int


@dataclass
class TuneSettings(InferenceSettings):
    split: str
    data_path: str | None
    sentences: int
    alphas: list[float]
    beams: list[int]
    significance: float
