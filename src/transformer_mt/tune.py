"""Decoding settings chosen on the development set (§6.1): `make tune CKPT=<checkpoint>`."""

from __future__ import annotations

import time
from functools import partial

from omegaconf import DictConfig, OmegaConf

from transformer_mt.commandline import hydra_command
from transformer_mt.data.corpus import Corpus
from transformer_mt.decoding import PAPER, Decoding
from transformer_mt.errors import InputError, required
from transformer_mt.evaluation.engines import open_engine
from transformer_mt.evaluation.grid import search_grid
from transformer_mt.evaluation.tuned import save_tuned


def tune(cfg: DictConfig) -> Decoding:
    if cfg.split == "test":
        raise InputError("split=test: settings are chosen on the development set, never on the test split (§6.1)")
    if cfg.n_best:
        raise InputError(f"n_best={cfg.n_best}: make tune scores each setting's best translation only; leave it out")
    if cfg.sentences < 0:  # its type is settings.TuneSettings'
        raise InputError(
            f"sentences={cfg.sentences}: the number of the split's first sentences to tune on, at least 1 "
            f"(0, the default: all of them)"
        )
    start = time.perf_counter()
    with open_engine(cfg) as (translate_lines, config):
        data_cfg = config.get("data", {})
        corpus = Corpus.from_config(data_cfg, **({"path": cfg.data_path} if cfg.data_path else {}))
        sources, references = corpus.texts(cfg.split)  # as the end of a run and make evaluate read it
        if cfg.sentences:
            sources, references = sources[: cfg.sentences], references[: cfg.sentences]
        alphas, beams = list(cfg.alphas), list(cfg.beams)
        decoding = Decoding.of(OmegaConf.to_container(cfg.decoding, resolve=True))
        decodes = len(alphas) + sum(b != decoding.beam_size for b in beams) + 1  # and the doubled length limit
        print(
            f"choosing decoding settings on {corpus.name} {cfg.split} ({len(sources):,} sentences): {len(alphas)} "
            f"length penalties at beam {decoding.beam_size}, beams {beams} at the best, then the length limit: "
            f"up to {decodes} rows",
            flush=True,
        )
        chosen, rows = search_grid(
            partial(translate_lines, tokens_per_batch=cfg.tokens_per_batch, report=partial(print, " ", flush=True)),
            sources,
            references,
            data_cfg.get("tgt_lang", "de"),
            decoding,
            alphas,
            beams,
            partial(print, flush=True),
            cfg.significance,
        )
    best = next(r for r in rows if Decoding.of(r) == chosen)
    paper = [r for r in rows if Decoding.of(r) == decoding.but(beam_size=PAPER.beam_size, alpha=PAPER.alpha)]
    seconds = time.perf_counter() - start
    if best["bleu"] is None:  # every row ran away (an undertrained model): nothing to choose from
        print(
            f"every row's translations ran away ({seconds:.0f} s): no setting chosen, no record written; make "
            f"translate and make evaluate keep conf/decoding's ({decoding.text()})"
        )
        return decoding
    print(f"signature: {best['bleu_signature']}; {seconds:.0f} s for {len(rows)} rows of the grid")
    print(
        f"chosen: {chosen.text()}: sacreBLEU {best['bleu']:.2f}"
        + (f" (the paper's beam 4, alpha 0.6: {paper[0]['bleu'] or 0:.2f})" if paper else "")
    )
    path = save_tuned(required(cfg, "ckpt"), chosen, rows, f"{corpus.name} {cfg.split}")
    print(f"wrote {path}: make translate and make evaluate use these settings for this checkpoint (tuned=false: not)")
    return chosen


main = hydra_command("tune", tune)  # make tune, transformer-mt-tune


if __name__ == "__main__":
    main()
