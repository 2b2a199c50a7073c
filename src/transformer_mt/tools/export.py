"""make export CKPT=... FORMAT=hf|ct2 OUT=<new folder>: a checkpoint as transformers' MarianMTModel or CTranslate2
(the `export` extra), checked against ours. Marian's positions are all sines, then all cosines, where ours interleave
them (§3.5): every weight that reads or writes the residual (d_model) dimension is reordered."""

from __future__ import annotations

import copy
import importlib
import json
import os
import re
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from transformer_mt.checkpoint import load_for_inference
from transformer_mt.decoding import HF_LENGTH_PENALTY, PAPER
from transformer_mt.errors import CommandParser, InputError, UserError, exit_on_user_error
from transformer_mt.files import atomic_write, remove_stale_temporaries
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.search import translate_ids
from transformer_mt.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from transformer_mt.tools.model_card import LICENSE_NAME, model_card

PROBE = [  # sentences the export is checked on (any vocabulary covers them: unseen characters become bytes)
    "A man in a blue shirt is standing on a ladder.", "The European Parliament adopted the resolution on Tuesday.",
    "Zwei Hunde spielen im Schnee - 42 Grad, ça va?",
]  # fmt: skip
EXACT = 1e-6  # max abs logit difference in float64 (rounding alone: ~1e-10)


def optional(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f'exporting needs the Python package {module!r}: install the extra with pip install -e ".[export]"'
        ) from None


def marian_order(d_model: int) -> Tensor:
    """Marian's residual feature m is our feature order[m]: its sines (our even features), then its cosines (odd)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


RENAMES = [  # our parameter names -> Marian's (applied in order)
    ("embed.tokens.weight", "shared.weight"), ("encoder_layers.", "encoder.layers."),
    ("decoder_layers.", "decoder.layers."), ("self_attn_res.norm", "self_attn_layer_norm"),
    ("cross_attn_res.norm", "encoder_attn_layer_norm"), ("cross_attn.", "encoder_attn."),
    ("ffn_res.norm", "final_layer_norm"), ("ffn.w1", "fc1"), ("ffn.w2", "fc2"),
    ("encoder_norm", "encoder.layer_norm"), ("decoder_norm", "decoder.layer_norm"),  # pre-norm's, for CTranslate2
]  # fmt: skip
READS_RESIDUAL = ("q_proj", "k_proj", "v_proj", "w1")  # input features are d_model: reorder columns
WRITES_RESIDUAL = ("out_proj", "w2")  # output features are d_model: reorder rows and bias


def inexpressible(cfg: TransformerConfig, fmt: str) -> list[str]:
    """The model's switches that Marian (fmt hf) or CTranslate2 (ct2) has no setting for (model.py's defaults are all
    Marian's; CTranslate2 has pre-norm too)."""
    d_k, d_v = cfg.head_sizes
    found = []
    if not d_k * cfg.n_heads == d_v * cfg.n_heads == cfg.d_model:
        found.append(f"d_k={d_k}, d_v={d_v} with {cfg.n_heads} heads (Marian's heads are d_model / n_heads wide)")
    if cfg.positions != "sinusoidal":
        found.append(f"positions={cfg.positions} (Marian's positions are sinusoids)")
    if cfg.norm != "post" and fmt == "hf":
        found.append(f"norm={cfg.norm} (Marian's layers are post-norm)")
    if cfg.share_embeddings != "all":
        found.append(f"share_embeddings={cfg.share_embeddings} (this export ties all three matrices, as §3.4)")
    return found


def marian_state_dict(model: Transformer) -> dict[str, Tensor]:
    """Our weights under Marian's names (MarianModel, without the "model." prefix), residual dimension reordered."""
    order = marian_order(model.cfg.d_model)
    state = {}
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            weights = {"weight": module.weight[:, order]}
        elif isinstance(module, nn.LayerNorm):
            weights = {"weight": module.weight[order], "bias": module.bias[order]}
        elif isinstance(module, nn.Linear) and module_name.endswith(READS_RESIDUAL):
            weights = {"weight": module.weight[:, order], "bias": module.bias}
        elif isinstance(module, nn.Linear) and module_name.endswith(WRITES_RESIDUAL):
            weights = {"weight": module.weight[order], "bias": module.bias[order]}
        else:
            continue
        for kind, tensor in weights.items():
            name = f"{module_name}.{kind}"
            for ours, theirs in RENAMES:
                name = name.replace(ours, theirs)
            state[name] = tensor.detach().clone()
    return state


def marian_model(model: Transformer):
    """transformers' MarianMTModel of the same shape, holding our weights (in train mode, as a new model). A pre-norm
    model's final LayerNorms ride along unused (Marian is post-norm), for CTranslate2's converter."""
    transformers, cfg = optional("transformers"), model.cfg
    config = transformers.MarianConfig(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        encoder_layers=cfg.n_encoder_layers,
        decoder_layers=cfg.n_decoder_layers,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function="relu",
        max_position_embeddings=cfg.max_positions,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,  # §3.4
        dropout=cfg.dropout,
        attention_dropout=0.0,
        activation_dropout=0.0,  # for fine-tuning: ours
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        forced_eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,  # ours starts from BOS (Marian's own models from pad)
    )
    hf = transformers.MarianMTModel(config)
    if cfg.norm == "pre":
        hf.model.encoder.layer_norm = nn.LayerNorm(cfg.d_model)
        hf.model.decoder.layer_norm = nn.LayerNorm(cfg.d_model)
    hf.model.load_state_dict(marian_state_dict(model), strict=False)  # its own sinusoids; check_hf/check_ct2 compare
    return hf


def write_hf(model: Transformer, tokenizer: Tokenizer, directory: Path, languages: tuple[str, str]):
    """MarianMTModel + MarianTokenizer files in `directory` (which exists and is empty)."""
    transformers = optional("transformers")
    hf = marian_model(model).eval()
    # Beam 4 (§6.1), the |Y|^a closest to our length penalty, pad never generated, and a search that stops only
    # when no live hypothesis can win, as ours.
    hf.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        forced_eos_token_id=EOS_ID,
        bad_words_ids=[[PAD_ID]],
        num_beams=PAPER.beam_size,
        length_penalty=HF_LENGTH_PENALTY,
        early_stopping="never",
        max_length=model.cfg.max_positions,
    )
    try:
        hf.save_pretrained(directory)
    except Exception as e:  # safetensors' own error for an OSError in its Rust writer: "... (os error 28)"
        if number := re.search(r"\(os error (\d+)\)", str(e)):
            raise OSError(int(number[1]), os.strerror(int(number[1])), str(directory)) from None
        raise
    # The tokenizer: our SentencePiece model for both sides, and its pieces in id order.
    spm_file = tokenizer.save(directory)
    vocab = {tokenizer.sp.id_to_piece(i): i for i in range(len(tokenizer))}
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    piece = tokenizer.sp.id_to_piece
    transformers.MarianTokenizer(
        source_spm=str(spm_file),
        target_spm=str(spm_file),
        vocab=str(directory / "vocab.json"),
        source_lang=languages[0],
        target_lang=languages[1],
        unk_token=piece(UNK_ID),
        eos_token=piece(EOS_ID),
        pad_token=piece(PAD_ID),
        bos_token=piece(BOS_ID),  # special: decode(skip_special_tokens=True) drops it
        model_max_length=model.cfg.max_positions - 1,  # room for the EOS
    ).save_pretrained(directory)
    spm_file.unlink()  # the tokenizer saved it as source.spm and target.spm


def check_hf(model: Transformer, tokenizer: Tokenizer, directory: Path) -> str:
    """The export loaded as a user would, against ours: its tokenizer's ids, its logits in float32 and float64 (which
    shows the mapping exact); says what it checked."""
    transformers = optional("transformers")
    hf_tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    batch = hf_tokenizer(PROBE, return_tensors="pt", padding=True)
    ours = [ids + [EOS_ID] for ids in tokenizer.encode(PROBE)]
    theirs = [[i for i in row if i != PAD_ID] for row in batch.input_ids.tolist()]
    if theirs != ours:
        raise AssertionError(f"the exported tokenizer gives other ids than ours: {theirs} vs {ours}")
    tgt_in = torch.cat([torch.full((len(PROBE), 1), BOS_ID), batch.input_ids[:, :-1]], dim=1)  # any target will do
    diffs = []
    for dtype in (torch.float32, torch.float64):
        hf = transformers.MarianMTModel.from_pretrained(directory, dtype=dtype).eval()
        with torch.no_grad():
            expected = copy.deepcopy(model).to(dtype)(batch.input_ids, tgt_in)
            diffs.append((expected - hf(**batch, decoder_input_ids=tgt_in).logits).abs().max().item())
    if not diffs[1] <= EXACT:
        raise AssertionError(f"{directory}: exported logits differ from ours by {diffs[1]:.2e} in float64 (> {EXACT})")
    return (
        f"checked: the exported tokenizer gives our ids and the model our logits (max abs difference "
        f"{diffs[0]:.1e} in float32, {diffs[1]:.1e} in float64)"
    )


def write_ct2(model: Transformer, hf_directory: Path, directory: Path, quantization: str | None) -> None:
    """Through CTranslate2's Marian converter, told ours: post- or pre-norm, the decoder starts from BOS's embedding
    (Marian's from zeros) and pad is id 0 (Marian's is last, which its converter drops)."""
    transformers, converters = optional("transformers"), optional("ctranslate2.converters.transformers")
    pre_norm = model.cfg.norm == "pre"

    class Loader(converters.BartLoader):  # Marian's, less its zero start embedding and its dropped pad row
        def get_model_spec(self, model):
            model.config.normalize_before = pre_norm
            model.config.normalize_embedding = False
            return super().get_model_spec(model)

        def set_config(self, config, model, tokenizer):
            converters.MarianMTLoader.set_config(self, config, model, tokenizer)
            config.bos_token = config.decoder_start_token = tokenizer.bos_token
            config.add_source_eos = True  # callers pass SentencePiece pieces, as our model takes ids + EOS

    spec = Loader()(marian_model(model).eval(), transformers.MarianTokenizer.from_pretrained(hf_directory))
    spec.validate()
    spec.optimize(quantization=quantization)
    spec.save(str(directory))
    (directory / "sentencepiece.model").write_bytes((hf_directory / "source.spm").read_bytes())


def check_ct2(model: Transformer, tokenizer: Tokenizer, directory: Path) -> str:
    translator = optional("ctranslate2").Translator(str(directory), device="cpu", compute_type="float32")
    pieces = [tokenizer.sp.encode(text, out_type=str) for text in PROBE]
    n = 30  # tokens at most, EOS included, for both
    results = translator.translate_batch(pieces, beam_size=1, max_decoding_length=n)
    theirs = [tokenizer.sp.piece_to_id(r.hypotheses[0]) for r in results]
    ours = translate_ids(model, tokenizer.encode(PROBE), beam_size=1, max_len_a=0, max_len_b=n)
    if theirs != ours:
        raise AssertionError(f"{directory}: CTranslate2's greedy tokens differ from ours: {theirs} vs {ours}")
    return "checked: CTranslate2's greedy translations of the probe sentences are ours, token for token"


def export(ckpt: str, fmt: str, out: str, quantization: str | None = None) -> Path:
    if quantization and fmt != "ct2":
        raise InputError("--quantization applies to FORMAT=ct2 only")
    out_dir = Path(out)
    remove_stale_temporaries(out_dir.parent, print)
    if out_dir.exists():
        raise InputError(f"OUT={out_dir} exists; remove it or choose another folder (nothing was written)")
    optional("transformers").utils.logging.disable_progress_bar()
    if fmt == "ct2":
        optional("ctranslate2")
    model, tokenizer, checkpoint = load_for_inference(ckpt)
    kind = "MarianMTModel" if fmt == "hf" else "CTranslate2"
    if cannot := inexpressible(model.cfg, fmt):
        raise InputError(
            f"{ckpt}: cannot be exported as {kind}: {'; '.join(cannot)}. Translate and evaluate it with "
            "make translate / make evaluate (nothing was written)"
        )
    data = checkpoint["hyper_parameters"]["config"]["data"]
    languages = data["src_lang"], data["tgt_lang"]
    print(f"exporting {ckpt} as {kind} (the weights, the tokenizer, then a check against ours) ...", flush=True)
    with atomic_write(out_dir) as tmp:  # a folder that appears whole or not at all
        tmp.mkdir()
        if fmt == "hf":
            write_hf(model, tokenizer, tmp, languages)
            checked = check_hf(model, tokenizer, tmp)
        else:
            with tempfile.TemporaryDirectory() as hf_dir:
                write_hf(model, tokenizer, Path(hf_dir), languages)
                write_ct2(model, Path(hf_dir), tmp, quantization)
            if not quantization or quantization == "float32":
                checked = check_ct2(model, tokenizer, tmp)
            else:
                checked = f"not checked against ours: {quantization} weights change the outputs a little"
        print(checked)
        (tmp / "README.md").write_text(model_card(Path(ckpt), checkpoint, fmt, checked), encoding="utf-8")
    print(f"exported {ckpt} as {kind} -> {out_dir} (and its model card, README.md)")
    return out_dir


def main() -> None:
    parser = CommandParser(__doc__)
    parser.add_argument("ckpt", help="a training or averaged checkpoint")
    parser.add_argument("--format", default="hf", choices=["hf", "ct2"], help="hf: transformers; ct2: CTranslate2")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist)")
    parser.add_argument("--quantization", help="ct2 only: int8, int8_float16, float16, ... (default: float32)")
    args = parser.parse()
    out = exit_on_user_error(export, args.ckpt, args.format, args.out, args.quantization)
    # said to a user's export only (not engine=ct2's, nor make bench's)
    print(f"the model card's license is `other` ({LICENSE_NAME}): set it to the terms of the training data before you")
    print(f"upload it (license: in {out / 'README.md'})")


if __name__ == "__main__":
    main()
