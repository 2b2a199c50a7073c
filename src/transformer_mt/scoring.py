"""Scores on detokenized text: sacreBLEU and chrF (report these), and the paper-comparable
tokenized BLEU with compound splitting (tensor2tensor's get_ende_bleu.sh), labelled as such."""

from __future__ import annotations

import re

from sacrebleu.metrics import BLEU, CHRF
from sacremoses import MosesTokenizer

COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(line: str) -> str:
    """get_ende_bleu.sh: perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'."""
    return COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def tokenized_bleu(hyps: list[str], refs: list[str], lang: str = "de") -> float:
    """Moses-tokenize, split hyphenated compounds, then multi-bleu (BLEU on the tokens as they are).

    This is how the paper's 27.3 / 28.4 were computed; it is NOT comparable with sacreBLEU,
    which scores detokenized text with its own 13a tokenization (usually ~0.7-1.5 lower).
    """
    moses = MosesTokenizer(lang=lang)

    def prepare(lines: list[str]) -> list[str]:
        return [split_compounds(moses.tokenize(line, return_str=True)) for line in lines]

    return BLEU(tokenize="none", force=True).corpus_score(prepare(hyps), [prepare(refs)]).score


def score(hyps: list[str], refs: list[str], tgt_lang: str = "de") -> dict:
    """sacreBLEU and chrF with their signatures, plus the labelled tokenized BLEU."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    bleu, chrf = BLEU(), CHRF()
    bleu_score, chrf_score = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {
        "sacrebleu": round(bleu_score.score, 2),
        "sacrebleu_signature": str(bleu.get_signature()),
        "sacrebleu_detail": str(bleu_score),
        "chrf": round(chrf_score.score, 2),
        "chrf_signature": str(chrf.get_signature()),
        "tokenized_bleu_compound_split": round(tokenized_bleu(hyps, refs, tgt_lang), 2),
        "tokenized_bleu_note": "Moses-tokenized, compounds split (tensor2tensor get_ende_bleu.sh); "
                               "the paper's metric, not comparable with sacreBLEU",
        "sentences": len(hyps),
    }
