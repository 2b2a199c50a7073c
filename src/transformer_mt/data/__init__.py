"""Data: where a corpus comes from and how it is cleaned (corpus.py), token-bucket batches in the
layout every model input uses (batching.py), the cache of the shared SentencePiece model and each
split's token ids under data.cache_dir (cache.py), and the LightningDataModule that holds the data
settings and serves the splits' loaders (datamodule.py)."""
