"""Translate a test set with beam search and score it: `make evaluate CKPT=<checkpoint>`."""

from __future__ import annotations

import json
import logging
import sys
from functools import partial
from pathlib import Path
from urllib.error import URLError

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from transformer_mt.commandline import chosen_decoding, hydra_command
from transformer_mt.data.corpus import Corpus, read_text_pair
from transformer_mt.errors import InputError
from transformer_mt.evaluation.engines import open_engine
from transformer_mt.files import read_lines
from transformer_mt.scoring import evaluate_translations
from transformer_mt.translate import nbest_lines

log = logging.getLogger(__name__)


def test_set(cfg: DictConfig, data_cfg: dict) -> tuple[str, list[str], list[str]]:
    """(name, sources, references) from files, a sacreBLEU test set, or the data config's split."""
    if cfg.src or cfg.ref:
        if not (cfg.src and cfg.ref):
            raise InputError("give both src and ref (SRC=... REF=...), or neither")
        src, ref = read_text_pair(cfg.src, cfg.ref)
        return f"{cfg.src} / {cfg.ref}", src, ref
    if cfg.testset:
        langpair = cfg.langpair or f"{data_cfg['src_lang']}-{data_cfg['tgt_lang']}"
        return f"{cfg.testset} ({langpair})", *sacrebleu_test_set(cfg.testset, langpair)
    corpus = Corpus.from_config(data_cfg, **({"path": cfg.data_path} if cfg.data_path else {}))
    return f"{corpus.name} {cfg.split}", *corpus.texts(cfg.split)


def sacrebleu_test_set(name: str, langpair: str) -> tuple[list[str], list[str]]:
    """(sources, references), downloaded on first use; offline, one line naming the fix."""
    from sacrebleu.dataset import DATASETS  # noqa: PLC0415 (downloads)
    from sacrebleu.utils import get_reference_files, get_source_file  # noqa: PLC0415

    if name not in DATASETS:
        raise InputError(f"testset={name}: not a sacreBLEU test set (e.g. wmt14/full; `sacrebleu --list` lists them)")
    if langpair not in (pairs := DATASETS[name].langpairs):
        raise InputError(f"langpair={langpair}: not in testset={name}, whose pairs are {', '.join(pairs)}")
    try:
        return read_lines(get_source_file(name, langpair)), read_lines(get_reference_files(name, langpair)[0])
    except (URLError, TimeoutError) as e:  # URLError: no network, no name resolution, an HTTP error
        dataset = DATASETS[name]  # sacreBLEU has no public name for where its download goes
        where = ", ".join(
            f"{url} at {Path(dataset._rawdir) / dataset._get_tarball_filename(url)}" for url in dataset.data
        )
        raise InputError(
            f"testset={name}: sacreBLEU could not download it ({getattr(e, 'reason', e)}). Offline, score aligned "
            "local files instead: src=<source file> ref=<reference file> (make evaluate SRC=... REF=...), or put "
            f"sacreBLEU's download {where} (SACREBLEU=<folder> moves its folder)"
        ) from None


def evaluate(cfg: DictConfig) -> dict:
    with open_engine(cfg) as (translate_lines, config):
        data_cfg = config.get("data", {})
        name, sources, references = test_set(cfg, data_cfg)
        decoding = chosen_decoding(cfg, say=print)
        options = dict(n_best=cfg.n_best, tokens_per_batch=cfg.tokens_per_batch, **decoding.settings())
        report = None if sys.stderr.isatty() else print  # in a log or a pipe, a line at least once a minute (no bar)
        translate = partial(translate_lines, warn=log.warning, progress=report is None, report=report, **options)
        outputs, hyps, scores = evaluate_translations(translate, sources, references, data_cfg.get("tgt_lang", "de"))
    engine = f"ct2 {cfg.ct2_compute_type}" if cfg.engine == "ct2" else "torch compiled" if cfg.compile else "torch"
    result = dict(checkpoint=str(cfg.ckpt), test_set=name, decoding=decoding.settings(), engine=engine) | scores
    result["code"] = config.get("code")  # the training's code record (runtime.code_record; None: written before it)
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "hypotheses.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    (out / "scores.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if cfg.n_best:
        (out / "nbest.txt").write_text("".join(map(nbest_lines, range(len(outputs)), outputs)), encoding="utf-8")
        print(f"wrote the {cfg.n_best} best translations per sentence to {out / 'nbest.txt'}")
    print(
        f"{name}: {len(hyps)} sentences, {decoding.text()}, {result['seconds']:.1f} s, engine {result['engine']}\n"
        f"sacreBLEU {result['bleu']:.2f}  {result['bleu_signature']}\n           {result['bleu_detail']}\n"
        f"chrF      {result['chrf']:.2f}  {result['chrf_signature']}\ntokenized BLEU with compound splitting (the "
        f"paper's metric, NOT comparable with sacreBLEU): {result['tokenized_bleu_compound_split']:.2f}\n"
        f"wrote {out / 'hypotheses.txt'} and {out / 'scores.json'}"
    )
    return result


main = hydra_command("evaluate", evaluate)  # make evaluate, transformer-mt-evaluate


if __name__ == "__main__":
    main()
