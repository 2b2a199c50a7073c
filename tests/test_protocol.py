"""The end of a run (evaluation/protocol.py, results.py, finish.py): averaging, beam search on the splits,
results.json and the log block, make finish; on conftest's variant_run (every switch on, a moving average)."""

import json
import logging
import re
import shutil

import pytest
import torch

from conftest import hydra_task
from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.decoding import PAPER
from transformer_mt.errors import InputError
from transformer_mt.evaluate import evaluate
from transformer_mt.evaluation.protocol import Protocol
from transformer_mt.files import RunFolder, RunFolderLock
from transformer_mt.finish import finish


def test_a_finished_run_ends_with_results_json_and_a_block_in_its_log(variant_run):
    results = json.loads((variant_run / "results.json").read_text())
    assert results["updates"] == 6 and results["parameters"] > 0 and results["seed"] == 0
    assert results["train_seconds"] > 0 and results["target_tokens"] > 0
    assert results["target_tokens_per_second"] > 0
    # Model FLOP/s over the run (the totals counted per update, test_module) and their share of the peak.
    totals = torch.load(variant_run / "checkpoints" / "last.ckpt", weights_only=True)["totals"]
    flops = results["model_flops_per_second"]
    assert flops == pytest.approx(totals["model_flops"] / totals["train_seconds"], rel=1e-3)
    # a CPU's peak is not known: no MFU (a GPU's: runtime.PEAK_TFLOPS, test_runtime)
    assert results["peak"] is None and results["peak_flops_per_second"] is None and results["mfu"] is None
    assert results["devices"] == 1
    assert results["decoding"] == {
        "beam_size": 4,
        "alpha": 0.6,
        "max_len_a": 1.0,
        "max_len_b": 10,
        "length_penalty": "gnmt",
    }
    assert "model.norm=pre" in results["overrides"]
    assert list(results["models"]) == ["average-last3", "ema"]
    for model in results["models"].values():
        for split in ("validation", "test"):
            scores = model[split]
            assert scores["sentences"] == 30 and scores["bleu_signature"].startswith("nrefs:1|")
            assert {"bleu", "chrf", "tokenized_bleu_compound_split", "loss", "ppl"} <= scores.keys()
            assert scores["ppl"] > 1
    log = (variant_run / "final.log").read_text()  # what the run's log received
    assert f"results ({variant_run / 'results.json'}): 6 updates" in log
    assert re.search(r"target tok/s, [\d,.]+ GFLOP/s, ", log)  # no MFU: a CPU's peak is not known
    assert log.count("tokenized compound-split BLEU") == 4  # 2 models x 2 splits
    # a line per decode as it ends, with its time
    settings = re.escape(f"({PAPER.but(max_len_b=10).text()})")
    assert re.search(rf"average-last3 on validation: 30 sentences decoded {settings} and scored in [\d.]+ s", log)
    assert len(re.findall(rf"sentences decoded {settings} and scored in", log)) == 4


def test_the_results_equal_make_evaluate_on_the_same_checkpoint(variant_run, capsys):
    """One way to score a split (scoring.evaluate_translations): make evaluate reads the split's text files
    through the data config, the end of the run the tokenized cache's text; the numbers are the same."""
    results = json.loads((variant_run / "results.json").read_text())
    ckpt = variant_run / "checkpoints" / "average-last3.ckpt"
    overrides = [f"ckpt={ckpt}", "split=test", "decoding.max_len_b=10"]
    scores = evaluate(hydra_task("evaluate", overrides, variant_run / "evaluate"))
    ours = results["models"]["average-last3"]["test"]
    for key in ("bleu", "chrf", "tokenized_bleu_compound_split", "bleu_signature", "sentences"):
        assert scores[key] == ours[key], key


def test_the_start_of_a_run_says_what_its_end_will_do_and_how_to_skip_it(variant_run):
    """One line as training starts (a 60-update run once spent 19 minutes in an end it had not announced)."""
    cfg = read_checkpoint(variant_run / "checkpoints" / "last.ckpt")["hyper_parameters"]["config"]
    plan = Protocol.of_run(RunFolder(variant_run), cfg).plan()
    assert plan == (
        "when training ends (final.enabled): average the last 3 periodic checkpoints, decode validation and test at "
        "beam 4, alpha 0.6, max length 1 x source + 10 and score them; final.enabled=false skips it "
        f"(make finish RUN={variant_run} does it later)"
    )


def test_the_average_is_the_mean_of_the_last_three_periodic_checkpoints(variant_run):
    folder = variant_run / "checkpoints"
    average = read_checkpoint(folder / "average-last3.ckpt")["state_dict"]
    parts = [read_checkpoint(folder / f"step{n:07d}.ckpt")["state_dict"] for n in (2, 4, 6)]
    assert {"model.embed.positions.target", "model.src_embed.positions.source", "model.output.weight"} <= average.keys()
    for key, value in average.items():
        torch.testing.assert_close(value, sum(p[key].double() for p in parts).float() / 3, rtol=0, atol=1e-6)


def test_make_finish_refuses_a_run_still_training_and_says_when_training_stopped_short(variant_run, tmp_path, capsys):
    """make finish beside a live training (the folder's lock held) is refused in one line naming the holder, and
    nothing is written; on a run whose training stopped before its schedule's end it says so, and what finishing
    then means (issue 45)."""

    run = tmp_path / "run"
    shutil.copytree(variant_run, run)
    (run / "results.json").unlink()
    with RunFolderLock(run), pytest.raises(InputError, match=r"is in use by a training that is still running \(pid "):
        finish(run, device="cpu")
    assert not (run / "results.json").exists()
    finish(run, device="cpu")  # a finished run: nothing to warn about
    assert "warning" not in capsys.readouterr().out
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    planned = last["hyper_parameters"]["config"]["trainer"]["max_steps"]
    last["global_step"] = planned - 2  # as a run killed two updates before its end leaves it
    torch.save(last, run / "checkpoints" / "last.ckpt")
    finish(run, device="cpu")
    warning = f"warning: {run}'s training stopped at update {planned - 2:,} of the {planned:,} its schedule planned"
    assert warning in capsys.readouterr().out


def test_make_finish_on_a_finished_run_keeps_its_earlier_results(variant_run, tmp_path, caplog, capsys):
    """make finish on a run that has its results.json: the new one is written, the earlier kept beside it as
    results.1.json, and the log says so; again: results.2.json."""

    run = tmp_path / "run"
    shutil.copytree(variant_run, run)
    earlier = json.loads((run / "results.json").read_text())
    with caplog.at_level(logging.WARNING):
        finish(run, device="cpu")
    assert json.loads((run / "results.1.json").read_text()) == earlier
    assert json.loads((run / "results.json").read_text())["finished_by"] == "make finish"
    average = json.loads((run / "results.json").read_text())["models"]["average-last3"]["checkpoint"]
    assert f"next:\n  make evaluate CKPT={average}\n" in capsys.readouterr().out  # as a run's own end says
    assert (
        f"{run / 'results.json'} was there already (an earlier end of this run): kept as results.1.json" in caplog.text
    )
    finish(run, device="cpu")
    assert json.loads((run / "results.1.json").read_text()) == earlier and (run / "results.2.json").is_file()
