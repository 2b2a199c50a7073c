"""Data: corpora and cleaning (corpus.py), token-bucket batches (batching.py), the tokenizer and token-id cache under
data.cache_dir (cache.py), and the LightningDataModule (datamodule.py)."""
