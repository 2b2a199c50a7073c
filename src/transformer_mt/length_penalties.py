"""Beam search's length penalty, ours and theirs, importable without torch (engines.py's CTranslate2 path).

Ours is GNMT's (Wu et al., 2016), as §6.1 uses: a hypothesis Y scores log P(Y) / ((5 + |Y|) / 6)^alpha
(search.length_penalty). transformers and CTranslate2 divide by |Y|^a instead, a different function (so is
fairseq's --lenpen); the exports use the a that comes closest to ours (docs/inference.md).
"""

PAPER_ALPHA = 0.6  # §6.1; the alpha at which HF_LENGTH_PENALTY was measured
# On Multi30k test2016, |Y|^0.45 with early_stopping="never" picked our alpha-0.6 translation for 99.2% of the
# sentences (|Y|^0.6: 96.7%): docs/inference.md.
HF_LENGTH_PENALTY = 0.45
