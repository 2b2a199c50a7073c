"""Attention pictures of one sentence and the model's translation of it (or REF): make attention CKPT=...
TEXT="..." (or SRC=<file> LINE=<n>). Writes {encoder_self,decoder_self,encoder_decoder}_attention.png (layers x
heads; a decoder row reads input token r and writes output token r), alignment.png (the last layer's cross-attention,
mean of heads) and attention.npz (the weights, (layers, heads, rows, columns), and the SentencePiece pieces).
"""

from __future__ import annotations

import textwrap
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure  # not pyplot: no display, no global state

from transformer_mt.attention_recording import record_attention
from transformer_mt.checkpoint import start_inference
from transformer_mt.data.corpus import read_text_pair
from transformer_mt.decoding import PAPER
from transformer_mt.errors import CommandParser, InputError, exit_on_user_error
from transformer_mt.files import read_lines
from transformer_mt.model import Transformer
from transformer_mt.search import translate_ids
from transformer_mt.tokenizer import BOS_ID, EOS_ID, padded, source_batch


@torch.no_grad()
def attention_weights(model: Transformer, src_ids: list[int], tgt_ids: list[int]) -> dict[str, np.ndarray]:
    """Teacher-forced pass over BOS + tgt_ids -> per kind (layers, heads, rows, columns) float32 arrays."""
    device = next(model.parameters()).device
    src = source_batch([src_ids], device)
    tgt_in = padded([tgt_ids], prefix=[BOS_ID]).to(device)
    with record_attention(model) as kinds:
        model(src, tgt_in)
        return {
            kind: torch.stack([a.weights[0] for a in layers]).float().cpu().numpy() for kind, layers in kinds.items()
        }


def plot_grid(weights: np.ndarray, rows: list[str], columns: list[str], title: str, path: Path) -> None:
    """A heat map per layer (down) and head (across); token labels on the outer panels only."""
    n_layers, n_heads = weights.shape[:2]
    width, height = max(1.0, 0.13 * len(columns)), max(1.0, 0.13 * len(rows))  # inches per panel
    label = 0.07 * max(map(len, rows + columns))  # room for the longest piece
    fig = Figure(figsize=(n_heads * width + label + 0.8, n_layers * height + label + 0.9), layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer, head]
            ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            # Ticks only where labels are: thousands of unlabelled ticks take most of the drawing time.
            x, y = (columns if layer == n_layers - 1 else []), (rows if head == 0 else [])
            ax.set_xticks(range(len(x)), x, rotation=90, fontsize=6)
            ax.set_yticks(range(len(y)), y, fontsize=6)
            ax.set_title(f"head {head + 1}" if layer == 0 else "", fontsize=8)
            ax.set_ylabel(f"layer {layer + 1}" if head == 0 else "", fontsize=8)
    width_chars = int(fig.get_figwidth() * 11)  # characters of 9-point text per line, roughly
    fig.suptitle("\n".join(textwrap.wrap(title, width_chars)), fontsize=9)
    fig.savefig(path, dpi=80)


def plot_alignment(weights: np.ndarray, rows: list[str], columns: list[str], title: str, path: Path) -> None:
    fig = Figure(figsize=(2 + 0.3 * len(columns), 1.5 + 0.3 * len(rows)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(weights, cmap="Greys", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(columns)), columns, rotation=90)
    ax.set_yticks(range(len(rows)), rows)
    ax.set(xlabel="source", ylabel="output")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.03)
    fig.savefig(path, dpi=100)


def source_sentence(text: str | None, src: str | None, line: int, ref: str | None) -> tuple[str, str | None]:
    """(source, reference or None) from TEXT [REF=text], or SRC=<file> LINE=<n> [REF=<file>]."""
    if (text is None) == (src is None):
        raise InputError('give the sentence as TEXT="..." or as SRC=<file> LINE=<n>, not both')
    if text is not None:
        return text, ref
    lines, refs = read_text_pair(src, ref) if ref is not None else (read_lines(src), None)
    if not 1 <= line <= len(lines):
        raise InputError(f"LINE={line}: {src} has {len(lines)} lines (count from 1)")
    return lines[line - 1], None if refs is None else refs[line - 1]


def draw(ckpt: str, text: str | None, src: str | None, line: int, ref: str | None, out: str | None, device: str):
    source, reference = source_sentence(text, src, line, ref)
    model, tokenizer, _ = start_inference(ckpt, device)
    src_ids = tokenizer.encode([source.strip()])[0][: model.cfg.max_positions - 1]
    if not src_ids:
        raise InputError("the sentence is empty")
    if reference is not None:
        tgt_ids = tokenizer.encode([reference.strip()])[0][: model.cfg.max_positions - 1]
        origin = "the reference"
    else:
        tgt_ids = translate_ids(model, [src_ids], **PAPER.settings())[0]  # decoding=beam's
        origin = f"its own translation (beam {PAPER.beam_size})"
    weights = attention_weights(model, src_ids, tgt_ids)

    out_dir = Path(out or f"outputs/attention/{datetime.now():%Y-%m-%d_%H-%M-%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    src_tokens, tgt_in, tgt_out = (
        [tokenizer.sp.id_to_piece(i) for i in ids]
        for ids in ([*src_ids, EOS_ID], [BOS_ID, *tgt_ids], [*tgt_ids, EOS_ID])
    )
    translation = tokenizer.decode([tgt_ids])[0]
    pictures = {  # file: (kind, title, rows, columns)
        "encoder_self_attention.png": ("encoder", "encoder self-attention", src_tokens, src_tokens),
        "decoder_self_attention.png": ("decoder", "decoder self-attention (masked)", tgt_in, tgt_in),
        "encoder_decoder_attention.png": ("cross", "encoder-decoder attention", tgt_out, src_tokens),
    }
    for file_name, (kind, title, rows, columns) in pictures.items():
        plot_grid(weights[kind], rows, columns, f"{title}: {source!r} -> {translation!r}", out_dir / file_name)
    title = f"encoder-decoder attention, last layer, mean of {weights['cross'].shape[1]} heads\n{origin}"
    plot_alignment(weights["cross"][-1].mean(axis=0), tgt_out, src_tokens, title, out_dir / "alignment.png")
    np.savez(out_dir / "attention.npz", **weights, src_tokens=src_tokens, tgt_in_tokens=tgt_in, tgt_out_tokens=tgt_out)
    print(f"source:      {source}\n{'reference' if reference is not None else 'translation'}: {translation}")
    print(f"wrote {', '.join(pictures)}, alignment.png and attention.npz to {out_dir}")
    return out_dir


def main() -> None:
    parser = CommandParser(__doc__)
    parser.add_argument("ckpt", help="a training or averaged checkpoint")
    parser.add_argument("--text", help="the source sentence")
    parser.add_argument("--src", help="or a file of source sentences ...")
    parser.add_argument("--line", type=int, default=1, help="... and the line to picture (from 1)")
    parser.add_argument("--ref", help="a target to picture instead of the model's translation (a file with --src)")
    parser.add_argument("--out", help="the folder for the pictures (default: outputs/attention/<time>)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    args = parser.parse()
    exit_on_user_error(draw, args.ckpt, args.text, args.src, args.line, args.ref, args.out, args.device)


if __name__ == "__main__":
    main()
