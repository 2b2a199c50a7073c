"""Tools around a trained checkpoint: export to transformers and CTranslate2 (export.py), attention
pictures (attention_maps.py), learning curves from a run's metrics (plot.py)."""
