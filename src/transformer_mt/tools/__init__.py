"""Tools for looking at and shipping a trained model, and at a sweep's results. A map of the wing:

export.py           export to transformers (MarianMT) and CTranslate2, each checked against ours
model_card.py       the README.md model card of every export (Hub front matter, the run's scores, usage)
attention_maps.py   attention pictures of a checkpoint for one sentence
plot.py             learning curves from a run's metrics
table3.py           a Table 3 sweep's results.json files as one table, beside the paper's
"""
