"""The same model run by other libraries, for comparisons (scripts/benchmark.py, scripts/compare_exports.py).

- `TorchPeer`: torch.nn.Transformer with our sizes, embedding and tied projection (training only).
- export.marian_model: transformers' MarianMTModel holding our weights.
- `hf_translate`, `ct2_translate`: translate text with an exported MarianMTModel / CTranslate2 model,
  in length-sorted batches, at most source + 50 tokens (§6.1), as ours.
"""

from __future__ import annotations

import torch

from transformer_mt.model import Transformer
from transformer_mt.tokenizer import PAD_ID


class TorchPeer(torch.nn.Module):
    """torch.nn.Transformer (post-norm, ReLU) with our embedding/positions and tied output projection."""

    def __init__(self, ours: Transformer):
        super().__init__()
        cfg = self.cfg = ours.cfg
        self.embed = ours.embed
        self.stack = torch.nn.Transformer(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_encoder_layers,
            cfg.n_decoder_layers,
            cfg.d_ff,
            cfg.dropout,
            batch_first=True,
            norm_first=False,
        )

    def features(self, src, tgt_in):
        causal = torch.ones(tgt_in.size(1), tgt_in.size(1), dtype=torch.bool, device=src.device).triu(1)
        pad = src.eq(PAD_ID)
        return self.stack(
            self.embed(src), self.embed(tgt_in), tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad
        )

    def project(self, h):
        return h @ self.embed.tokens.weight.T


def hf_translate(hf, hf_tokenizer, sources: list[str], beam: int, alpha: float, batch: int = 64) -> list[str]:
    """MarianMTModel.generate; beam > 1 stops only when no live hypothesis can win, as ours."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out = [""] * len(sources)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        inputs = hf_tokenizer([sources[i] for i in rows], return_tensors="pt", padding=True)
        # (num_beams=1 must be said: the exported generation_config.json defaults to beam 4)
        search = dict(num_beams=beam, length_penalty=alpha, early_stopping="never") if beam > 1 else {"num_beams": 1}
        with torch.no_grad():
            generated = hf.generate(**inputs, **search, do_sample=False, max_length=inputs.input_ids.size(1) + 51)
        for i, text in zip(rows, hf_tokenizer.batch_decode(generated, skip_special_tokens=True)):
            out[i] = text
    return out


def ct2_translate(translator, sp, sources: list[str], beam: int, alpha: float, batch: int = 64) -> list[str]:
    """CTranslate2's translate_batch on SentencePiece pieces (it sorts by length inside)."""
    pieces = [sp.encode(s.strip(), out_type=str) for s in sources]
    results = translator.translate_batch(
        pieces,
        beam_size=beam,
        length_penalty=alpha,
        max_batch_size=batch,
        batch_type="examples",
        max_decoding_length=max(map(len, pieces)) + 51,
    )
    return [sp.decode_pieces(r.hypotheses[0]) for r in results]
