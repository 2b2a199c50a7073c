"""Checkpoints written before the package moved into data/, training/ and tools/ (commit 6f95e58) still
translate and resume. tests/data/pre-layout-step3.ckpt is update 3 of a tiny run made by that code;
pre-layout-step6-weights.pt holds the weights the same run reached at update 6, and
pre-layout-step3.nbest4.txt what that code's `make translate ARGS="n_best=4"` printed for SENTENCES."""

from pathlib import Path

import pytest
import torch

from conftest import run_translate, train_in_process, write_corpus
from transformer_mt.checkpoint import load_for_inference
from transformer_mt.errors import InputError

DATA = Path(__file__).resolve().parent / "data"
OLD = DATA / "pre-layout-step3.ckpt"
# The old run's settings besides TINY_RUN's (made with write_corpus(): the same synthetic text)
OLD_RUN = ["model.n_decoder_layers=2", "model.dropout=0.1", "trainer.precision=32-true", "trainer.max_steps=6"]


SENTENCES = "the cat sees a dog .\nthe big tree .\na small red house and a big dog .\n"


def nbest(text: str) -> list[tuple[int, str, float]]:
    return [(int(n), hyp, float(score)) for n, hyp, score in (line.split(" ||| ") for line in text.splitlines())]


def test_a_checkpoint_from_before_the_move_translates_as_the_code_that_wrote_it(monkeypatch, capsys):
    model, _, checkpoint = load_for_inference(OLD)
    assert checkpoint["global_step"] == 3 and model.cfg.n_decoder_layers == 2
    out, _ = run_translate(OLD, SENTENCES, "n_best=4", monkeypatch=monkeypatch, capsys=capsys)
    ours, theirs = nbest(out), nbest((DATA / "pre-layout-step3.nbest4.txt").read_text(encoding="utf-8"))
    assert [(n, hyp) for n, hyp, _ in ours] == [(n, hyp) for n, hyp, _ in theirs]
    for (_, _, score), (_, _, expected) in zip(ours, theirs):
        assert abs(score - expected) <= 2e-4  # printed with 4 decimals; another CPU may round the last one


def test_a_checkpoint_from_before_the_move_resumes_to_the_same_weights(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    train_in_process([f"data.path={corpus}", *OLD_RUN, f"ckpt_path={OLD}"], tmp_path, run)
    resumed = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    reached = torch.load(DATA / "pre-layout-step6-weights.pt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == reached["global_step"] == 6
    assert resumed["state_dict"].keys() == reached["state_dict"].keys()
    # Within float tolerance: another CPU's kernels round fp32 sums differently, and the loss is now
    # normalised per update (sum / tokens) rather than per micro-batch (mean), the same in exact arithmetic.
    # Not the key projections' biases: adding one to every key shifts all of a query's scores alike, which
    # softmax ignores, so their exact gradient is 0 and what they get is rounding noise, which Adam
    # scales up to steps of the learning rate's size.
    for key, value in reached["state_dict"].items():
        if not key.endswith("k_proj.bias"):
            torch.testing.assert_close(resumed["state_dict"][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_a_checkpoint_from_before_the_switches_refuses_to_resume_with_one_turned_on(tmp_path):
    """Its hyper-parameters lack the switches: they are the paper's, and turning one on is refused in one line."""
    corpus = write_corpus(tmp_path / "corpus")
    with pytest.raises(InputError, match=r"the checkpoint's model has norm post \(now pre\)"):
        train_in_process(
            [f"data.path={corpus}", *OLD_RUN, f"ckpt_path={OLD}", "model.norm=pre"], tmp_path, tmp_path / "run"
        )
