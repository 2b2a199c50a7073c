"""Data: corpora (corpus.py), token buckets (batching.py), the cache (cache.py), the DataModule (datamodule.py)."""
