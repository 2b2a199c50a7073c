"""Data: where a corpus comes from and how it is cleaned (corpus.py), token-bucket batches in the
layout every model input uses (batching.py), and the LightningDataModule that builds, caches and
serves the tokenized splits (datamodule.py)."""
