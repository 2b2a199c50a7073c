"""The data tests' shared corpus and DataModule: a synthetic text corpus on disk, small settings."""

from conftest import write_corpus
from transformer_mt.data.datamodule import TranslationDataModule

TEXT_FILES = {"train": "train", "validation": "valid", "test": "test"}


def text_datamodule(tmp_path, n_train=400, **overrides) -> TranslationDataModule:
    corpus = tmp_path / "corpus"
    if not corpus.exists():  # written once per test; later modules reuse (or see edits to) it
        write_corpus(corpus, n_train)
    args = dict(
        name="synthetic",
        path=str(corpus),
        text_files=TEXT_FILES,
        vocab_size=400,
        max_len=64,
        max_tokens=256,
        cache_dir=str(tmp_path / "cache"),
    )
    args.update(overrides)
    return TranslationDataModule(**args)
