"""sacreBLEU and chrF on detokenized text, and the paper's tokenized, compound-split BLEU, labelled as such."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest
from sacremoses import MosesTokenizer

from transformer_mt.errors import InputError


def split_compounds(line: str) -> str:
    """get_ende_bleu.sh: perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'."""
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)


def tokenized_bleu(hyps: list[str], refs: list[str], lang: str = "de") -> float:
    """BLEU on Moses tokens, compounds split: the paper's metric (sacreBLEU reads ~0.7-1.5 lower)."""
    moses = MosesTokenizer(lang=lang)
    hyps, refs = ([split_compounds(moses.tokenize(line, return_str=True)) for line in lines] for lines in (hyps, refs))
    return BLEU(tokenize="none", force=True).corpus_score(hyps, [refs]).score


def corpus_scores(hyps: list[str], refs: list[str], signatures: bool = False) -> dict:
    """{"bleu", "chrf"} (with `signatures`: "<name>_signature", "<name>_detail"), for validation and evaluation."""
    if len(hyps) != len(refs):
        raise InputError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if not hyps:
        raise InputError("nothing to score: the test set is empty")
    result = {}
    for name, metric in {"bleu": BLEU(), "chrf": CHRF()}.items():
        corpus = metric.corpus_score(hyps, [refs])
        result[name] = corpus.score
        if signatures:
            result[f"{name}_signature"], result[f"{name}_detail"] = str(metric.get_signature()), str(corpus)
    return result


def paired_bootstrap_p(baseline: list[str], system: list[str], refs: list[str]) -> float:
    """sacreBLEU's paired bootstrap test (1,000 resamples, its fixed seed): the p-value of the BLEU difference."""
    sacrebleu_log = logging.getLogger("sacrebleu")  # its progress lines would sit between make tune's own
    level = sacrebleu_log.level
    sacrebleu_log.setLevel(logging.WARNING)
    try:
        test = PairedTest([("baseline", baseline), ("system", system)], {"BLEU": BLEU()}, [refs], test_type="bs")
        return test()[1]["BLEU"][1].p_value
    finally:
        sacrebleu_log.setLevel(level)


def score(hyps: list[str], refs: list[str], tgt_lang: str = "de") -> dict:
    """corpus_scores with signatures (rounded), plus the labelled tokenized BLEU, and bleu_tokens: BLEU over the
    texts' own whitespace tokens (sacreBLEU tokenize="none"), fairseq generate.py's BLEU4 for pre-tokenized text
    such as multi30k_mmt's (Wu et al. 2021's metric)."""
    scores = {k: round(v, 2) if isinstance(v, float) else v for k, v in corpus_scores(hyps, refs, True).items()}
    return {
        **scores,
        "bleu_tokens": round(BLEU(tokenize="none", force=True).corpus_score(hyps, [refs]).score, 2),
        "tokenized_bleu_compound_split": round(tokenized_bleu(hyps, refs, tgt_lang), 2),
        "tokenized_bleu_note": "Moses-tokenized, compounds split (tensor2tensor get_ende_bleu.sh); "
        "the paper's metric, not comparable with sacreBLEU",
        "sentences": len(hyps),
    }


def evaluate_translations(
    translate: Callable[[list[str]], list], sources: Sequence[str], references: Sequence[str], tgt_lang: str
) -> tuple[list, list[str], dict]:
    """The one way a split is scored: `translate`'s outputs (n-best: lists), the best ones, their timed scores."""
    start = time.perf_counter()
    outputs = translate(list(sources))
    seconds = time.perf_counter() - start
    best = [out[0][0] if isinstance(out, list) else out for out in outputs]
    result = score(best, [ref.strip() for ref in references], tgt_lang)
    result |= {"seconds": round(seconds, 1), "sentences_per_second": round(len(best) / seconds, 2)}
    return outputs, best, result
