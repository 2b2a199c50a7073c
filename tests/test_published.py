"""The published-result recipe (experiment=multi30k_tiny, Wu et al. 2021's fairseq options) in small: validation and a
checkpoint at each epoch's end, early stopping on the validation loss, the average of the last epochs, beam search with
fairseq's length normalisation, BLEU4 on the text's own tokens in results.json; and its settings as published."""

import json

import pytest

from conftest import ROOT, train_in_process, write_corpus
from transformer_mt.checkpoint import read_checkpoint, run_checkpoints
from transformer_mt.configs import compose
from transformer_mt.data.corpus import Corpus
from transformer_mt.finish import stopped_early
from transformer_mt.objective import noam_lr

RECIPE = ["experiment=multi30k_tiny", "data=text", "trainer.val_check_interval=1.0", "val_bleu_sentences=0"]


def test_the_recipe_is_the_published_one():
    cfg = compose("train", ["experiment=multi30k_tiny"])
    model = cfg.model
    assert (model.n_encoder_layers, model.n_decoder_layers, model.d_model, model.d_ff, model.n_heads) == (
        4,
        4,
        128,
        256,
        4,
    )
    assert model.dropout == 0.3 and model.norm == "post" and model.share_embeddings == "all"
    assert noam_lr(2000, 128, cfg.optim.warmup_steps, cfg.optim.lr_factor) == pytest.approx(0.005, rel=1e-5)
    assert noam_lr(8000, 128, 2000, cfg.optim.lr_factor) == pytest.approx(0.005 * (2000 / 8000) ** 0.5, rel=1e-5)
    assert (cfg.data.max_tokens, cfg.data.tokens_per_update, cfg.trainer.max_steps) == (4096, 8192, 8000)
    assert cfg.early_stopping_patience == 10 and cfg.checkpoint.best_monitor == "val/loss"
    assert cfg.checkpoint.every_n_epochs == 1 and cfg.final.average_last == 10
    assert dict(cfg.decoding) == {
        "beam_size": 5,
        "alpha": 1.0,
        "max_len_a": 1.0,
        "max_len_b": 50,
        "length_penalty": "fairseq",
    }
    assert (ROOT / cfg.data.path).resolve() == (ROOT.parent / "shared" / "data" / "multi30k-mmt").resolve()


@pytest.mark.real_data
def test_the_recipes_data_is_the_published_text():
    """test2016 as Wu et al. scored it: 1,000 sentences, 12,103 reference tokens (their reflen), lowercased."""
    cfg = compose("train", ["experiment=multi30k_tiny"])
    corpus = Corpus.from_config(cfg.data, path=str(ROOT / cfg.data.path))
    sources, references = corpus.texts("test")
    assert len(sources) == 1000 and sum(len(r.split()) for r in references) == 12_103
    assert all(r == r.lower() for r in references) and len(corpus.texts("validation")[0]) == 1014


def test_the_recipe_stops_early_averages_its_last_epochs_and_scores_bleu4(tmp_path):
    """A frozen model (lr 0): every validation's loss equals the first, so patience 2 stops the run after 3 epochs,
    each with its checkpoint; the end averages those 3 and decodes with fairseq's |Y|^1."""
    corpus = tmp_path / "corpus"

    write_corpus(corpus)
    args = [
        *RECIPE,
        f"data.path={corpus}",
        "data.max_tokens=300",
        "data.tokens_per_update=600",
        "optim.lr_factor=0",
        "early_stopping_patience=2",
        "checkpoint.keep_last=3",
        "decoding.max_len_b=5",
        "final.splits=[test]",
    ]
    run = tmp_path / "run"
    train_in_process(args, tmp_path, run)
    last = read_checkpoint(run / "checkpoints" / "last.ckpt")
    assert stopped_early(last) is None  # make finish does not call it cut short
    periodic = run_checkpoints(run)
    assert [p.name.split("-")[0] for p in periodic] == ["epoch000", "epoch001", "epoch002"]
    per_epoch = last["global_step"] // 3
    assert [read_checkpoint(p)["global_step"] for p in periodic] == [per_epoch, 2 * per_epoch, 3 * per_epoch]
    results = json.loads((run / "results.json").read_text())
    assert results["decoding"]["length_penalty"] == "fairseq" and results["decoding"]["beam_size"] == 5
    test = results["models"]["average-last3"]["test"]
    assert 0 <= test["bleu_tokens"] <= 100 and test["sentences"] == 30
