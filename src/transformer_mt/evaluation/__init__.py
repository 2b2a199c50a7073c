"""Evaluation: everything done to a trained checkpoint, without Lightning. A map of the wing:

engines.py      the decoder behind make translate / evaluate / tune: ours (search.py) or CTranslate2 (engine=ct2)
ct2_worker.py   CTranslate2's process (engine=ct2), which never imports torch
grid.py         decoding settings chosen on the development set (§6.1): length penalty, beam, length limit
tuned.py        make tune's record beside a checkpoint (<name>.decoding.json) and whether it applies
protocol.py     the end-of-run protocol (§6.1): average, decode and score the splits, results.json

The settings themselves are core: decoding.Decoding (the paper's defaults, written once). A split's text comes
from one place, data.corpus.Corpus.texts, for the end of a run, make evaluate and make tune alike.
"""
