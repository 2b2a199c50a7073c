"""Tools for looking at and shipping a trained model: export to transformers and CTranslate2 (export.py),
attention pictures of a checkpoint (attention_maps.py), learning curves from a run's metrics (plot.py)."""
