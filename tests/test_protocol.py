"""The end of a run (evaluation/protocol.py, results.py, finish.py): averaging, beam search on the splits, final.tune,
results.json and the log block, make finish; on conftest's variant_run (every switch on, a moving average)."""

import json
import logging
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import VARIANT_FINAL, hydra_task, run_translate, train_in_process, write_corpus
from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.decoding import PAPER
from transformer_mt.errors import InputError
from transformer_mt.evaluate import evaluate
from transformer_mt.evaluation import protocol as protocol_module
from transformer_mt.evaluation.protocol import Protocol
from transformer_mt.evaluation.tuned import tuned_path
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
    peak = re.fullmatch(
        r"([\d.,]+) ([GT])FLOP/s (?:bf16|fp32), a 2048\^3 matrix product timed on this CPU", results["peak"]
    )
    shown = float(peak[1].replace(",", "")) * {"G": 1e9, "T": 1e12}[peak[2]]  # 3 significant digits
    assert results["peak_flops_per_second"] == pytest.approx(shown, rel=0.01)
    assert results["devices"] == 1 and results["mfu"] == pytest.approx(
        flops / results["peak_flops_per_second"], rel=1e-3
    )
    assert results["decoding"] == {"beam_size": 4, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": 10}
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
    assert re.search(r"target tok/s, [\d,.]+ GFLOP/s \(MFU [\d.]+%\), ", log)
    assert log.count("tokenized compound-split BLEU") == 4  # 2 models x 2 splits
    # a line per decode as it ends, with its time; and the protocol, when longer than the training, says so
    assert re.search(
        r"average-last3 on validation: 30 sentences decoded \(beam 4, alpha 0.6\) and scored in [\d.]+ s", log
    )
    assert len(re.findall(r"sentences decoded \(beam 4, alpha 0.6\) and scored in", log)) == 4
    longer = re.search(r"the end of the run took [\d:]+, longer than its [\d:]+ of training: final.tune's grid", log)
    assert bool(longer) == (results["evaluation_seconds"] > results["train_seconds"])  # either, by the machine


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


def test_final_tune_chooses_on_validation_stores_the_choice_and_scores_at_both_settings(
    variant_run, capsys, monkeypatch
):
    results = json.loads((variant_run / "results.json").read_text())
    assert set(results["tuned"]) == set(results["models"]) == {"average-last3", "ema"}
    tuned = results["tuned"]["average-last3"]
    ckpt = variant_run / "checkpoints" / "average-last3.ckpt"
    record = json.loads(tuned_path(ckpt).read_text())  # beside the checkpoint: translate/evaluate use it if asked
    assert record["decoding"] == tuned["decoding"] and record["chosen_on"] == "text validation"
    assert record["chosen_by"] == "final.tune"
    grid = [(r["beam_size"], r["alpha"], r["max_len_b"]) for r in record["grid"]]
    assert grid[:2] == [(4, 0.0, 10), (4, 1.0, 10)] and grid[2][0] == 2 and grid[3][2] == 20 and len(grid) == 4
    assert tuned["decoding"] in [{k: r[k] for k in tuned["decoding"]} for r in record["grid"]]
    log = (variant_run / "final.log").read_text()
    for step in ("length penalty", "beam", "length limit"):  # each step of the grid says why it kept or chose
        assert log.count(f"{step}: kept beam ") + log.count(f"{step}: chose beam ") == 2, step  # 2 models
    # make evaluate keeps the paper's settings by default (the end of the run's choice need not generalize, issue 56),
    # says what the end of the run chose; tuned=true scores the test split at it, as the end of the run did
    capsys.readouterr()
    paper = evaluate(hydra_task("evaluate", [f"ckpt={ckpt}", "split=test"], variant_run / "evaluate-paper"))
    said = capsys.readouterr().out
    assert paper["decoding"] == PAPER.settings()  # conf/decoding's
    assert "(conf/decoding); the end of the run chose beam" in said and "tuned=true decodes with those" in said
    _, said = run_translate(ckpt, "the cat sees a dog .\n", monkeypatch=monkeypatch, capsys=capsys)  # make translate
    assert said.startswith(f"decoding: {PAPER.text()} (conf/decoding); the end of the run chose beam"), said
    overrides = [f"ckpt={ckpt}", "split=test", "tuned=true"]
    scores = evaluate(hydra_task("evaluate", overrides, variant_run / "evaluate-tuned"))
    assert scores["decoding"] == tuned["decoding"] and scores["bleu"] == tuned["test"]["bleu"]
    assert "chosen on the text validation split by final.tune" in capsys.readouterr().out
    assert log.count("at the settings chosen on the validation split") == 4  # 2 models x 2 splits
    assert log.count("make translate and make evaluate keep the paper's (a gain on validation need not carry") == 4


def test_the_start_of_a_run_says_what_its_end_will_do_and_how_to_skip_it(variant_run):
    """One line as training starts (a 60-update run once spent 19 minutes in an end it had not announced)."""
    cfg = read_checkpoint(variant_run / "checkpoints" / "last.ckpt")["hyper_parameters"]["config"]
    plan = Protocol.of_run(RunFolder(variant_run), cfg).plan()
    assert plan == (
        "when training ends (final.enabled): average the last 3 periodic checkpoints, decode validation and test at "
        "beam 4, alpha 0.6, max length 1 x source + 10 and score them; then, if the end stays within the training's "
        "time, up to 4 decodes of validation choose beam and alpha, validation and test again at them (final.tune); "
        "final.enabled=false or final.tune=false skips it "
        f"(make finish RUN={variant_run} does it later)"
    )


def test_final_tune_runs_only_if_its_grid_keeps_the_end_within_the_training_time(
    variant_run, tmp_path, caplog, monkeypatch
):
    """At the speed the splits decoded (0.1 s a sentence here), the grid's 4 decodes of validation's 30 sentences and
    the 2 splits again (180 sentences, 18 s) after 10 s spent: 28 s, within 100 s of training, not within 20 s. A
    run whose grid would not fit skips it with one warning naming make tune (a 60-update recipe run once spent 19
    minutes there); make finish --tune runs it anyway."""
    cfg = read_checkpoint(variant_run / "checkpoints" / "last.ckpt")["hyper_parameters"]["config"]
    protocol = Protocol.of_run(RunFolder(variant_run), cfg)
    decoded = {split: {"seconds": 3.0, "sentences": 30} for split in ("validation", "test")}
    assert protocol.grid_too_long(SimpleNamespace(models={"m": decoded}, train_seconds=100.0), "m", 10.0) is None
    why = protocol.grid_too_long(SimpleNamespace(models={"m": decoded}, train_seconds=20.0), "m", 10.0)
    assert why == "its up to 4 decodes of validation would take ~0:00:18, and the end of the run would pass its " \
        "0:00:20 of training"  # fmt: skip
    monkeypatch.setattr(protocol_module, "TUNE_WITHIN", 0.0)  # whatever this machine's speeds: too long
    corpus = write_corpus(tmp_path / "corpus")
    args = [f"data.path={corpus}", "trainer.max_steps=4", "checkpoint.every_n_train_steps=2", *VARIANT_FINAL[:2]]
    with caplog.at_level(logging.WARNING):
        train_in_process([*args, "decoding.max_len_b=10", "final.tune=true"], tmp_path, tmp_path / "run")
    assert re.search(r"final.tune skipped for average-last2: its up to 9 decodes of validation would take ~\S+, and "
                     r"the end of the run would pass its \S+ of training; make tune CKPT=\S+average-last2.ckpt chooses "
                     r"later", caplog.text), caplog.text[-2000:]  # fmt: skip
    assert json.loads((tmp_path / "run" / "results.json").read_text())["tuned"] is None
    finish(tmp_path / "run", device="cpu", tune=True)  # asked for by name (make finish ARGS=--tune): however long
    assert set(json.loads((tmp_path / "run" / "results.json").read_text())["tuned"]) == {"average-last2"}


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
        finish(run, device="cpu", tune=False)
    assert not (run / "results.json").exists()
    finish(run, device="cpu", tune=False)  # a finished run: nothing to warn about
    assert "warning" not in capsys.readouterr().out
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    planned = last["hyper_parameters"]["config"]["trainer"]["max_steps"]
    last["global_step"] = planned - 2  # as a run killed two updates before its end leaves it
    torch.save(last, run / "checkpoints" / "last.ckpt")
    finish(run, device="cpu", tune=False)
    warning = f"warning: {run}'s training stopped at update {planned - 2:,} of the {planned:,} its schedule planned"
    assert warning in capsys.readouterr().out


def test_make_finish_on_a_finished_run_keeps_its_results_and_their_tuned_block(variant_run, tmp_path, caplog, capsys):
    """make finish on a run that has its results.json (with the dev-set choice of final.tune): the new one is written,
    the earlier kept beside it as results.1.json, tuned block and all, and the log says so; again: results.2.json."""

    run = tmp_path / "run"
    shutil.copytree(variant_run, run)
    earlier = json.loads((run / "results.json").read_text())
    assert "tuned" in earlier
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    last["totals"]["train_seconds"] = 1e-3  # trained in a millisecond: any end of the run is longer, and says so
    torch.save(last, run / "checkpoints" / "last.ckpt")
    with caplog.at_level(logging.WARNING):
        finish(run, device="cpu", tune=False)
    assert re.search(r"the end of the run took [\d:]+, longer than its 0:00:00 of training\n", caplog.text + "\n")
    assert json.loads((run / "results.1.json").read_text()) == earlier
    assert json.loads((run / "results.json").read_text())["finished_by"] == "make finish"
    average = json.loads((run / "results.json").read_text())["models"]["average-last3"]["checkpoint"]
    assert f"next:\n  make evaluate CKPT={average}\n" in capsys.readouterr().out  # as a run's own end says
    assert (
        f"{run / 'results.json'} was there already (an earlier end of this run): kept as results.1.json" in caplog.text
    )
    finish(run, device="cpu", tune=False)
    assert json.loads((run / "results.1.json").read_text()) == earlier and (run / "results.2.json").is_file()
