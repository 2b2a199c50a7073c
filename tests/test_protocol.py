"""The end of a run (evaluation/protocol.py): averaging, beam search on the splits, results.json and the log block;
the moving average of the weights (training/ema.py); and every tool on a model with every switch on."""

import json
import logging
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import hydra_task, run_process, run_train, train_in_process, write_corpus
from transformer_mt.averaging import average_run
from transformer_mt.checkpoint import EMA_KEY as STATE_KEY
from transformer_mt.checkpoint import ema_state, read_checkpoint
from transformer_mt.errors import InputError, MissingInputError
from transformer_mt.evaluate import evaluate
from transformer_mt.evaluation.tuned import tuned_path
from transformer_mt.files import RunFolderLock
from transformer_mt.tools.attention_maps import draw
from transformer_mt.tools.export import export
from transformer_mt.tools.table3 import collect
from transformer_mt.training.ema import ExponentialMovingAverage

SWITCHES = ["model.d_k=6", "model.d_v=10", "model.positions=learned", "model.norm=pre", "model.share_embeddings=none"]
RUN = ["data.max_tokens=400", "trainer.val_check_interval=3", "checkpoint.every_n_train_steps=2", "ema_decay=0.9"]
FINAL = ["final.enabled=true", "final.average_last=3", "final.splits=[validation,test]", "decoding.max_len_b=10"]
TUNE = ["final.tune=true", "final.tune_alphas=[0.0,1.0]", "final.tune_beams=[2]"]  # 4 decodes of validation


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def variant_run(tmp_path_factory) -> Path:
    """6 updates of a tiny model with every switch on, the end-of-run protocol and a moving average."""
    root = tmp_path_factory.mktemp("variant")
    corpus = write_corpus(root / "corpus")
    handler, logger = Lines(), logging.getLogger("transformer_mt.evaluation.protocol")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        args = [f"data.path={corpus}", "trainer.max_steps=6", *RUN, *FINAL, *TUNE, *SWITCHES]
        train_in_process(args, root, root / "out")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    (root / "out" / "final.log").write_text("\n".join(handler.lines))
    return root / "out"


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
    assert bool(longer) == (results["evaluation_seconds"] > totals["train_seconds"])  # either, by the machine


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


def test_final_tune_chooses_on_validation_stores_the_choice_and_scores_at_both_settings(variant_run, capsys):
    results = json.loads((variant_run / "results.json").read_text())
    assert set(results["tuned"]) == set(results["models"]) == {"average-last3", "ema"}
    tuned = results["tuned"]["average-last3"]
    ckpt = variant_run / "checkpoints" / "average-last3.ckpt"
    record = json.loads(tuned_path(ckpt).read_text())  # beside the checkpoint: translate/evaluate use it
    assert record["decoding"] == tuned["decoding"] and record["chosen_on"] == "text validation"
    grid = [(r["beam_size"], r["alpha"], r["max_len_b"]) for r in record["grid"]]
    assert grid[:2] == [(4, 0.0, 10), (4, 1.0, 10)] and grid[2][0] == 2 and grid[3][2] == 20 and len(grid) == 4
    assert tuned["decoding"] in [{k: r[k] for k in tuned["decoding"]} for r in record["grid"]]
    log = (variant_run / "final.log").read_text()
    for step in ("length penalty", "beam", "length limit"):  # each step of the grid says why it kept or chose
        assert log.count(f"{step}: kept beam ") + log.count(f"{step}: chose beam ") == 2, step  # 2 models
    # the test split at the chosen settings: what make evaluate gives on that checkpoint by default
    scores = evaluate(hydra_task("evaluate", [f"ckpt={ckpt}", "split=test"], variant_run / "evaluate-tuned"))
    assert scores["decoding"] == tuned["decoding"] and scores["bleu"] == tuned["test"]["bleu"]
    assert "chosen on the text validation split by make tune" in capsys.readouterr().out
    assert log.count("at the settings chosen on the validation split") == 4  # 2 models x 2 splits


def test_the_average_is_the_mean_of_the_last_three_periodic_checkpoints(variant_run):
    folder = variant_run / "checkpoints"
    average = read_checkpoint(folder / "average-last3.ckpt")["state_dict"]
    parts = [read_checkpoint(folder / f"step{n:07d}.ckpt")["state_dict"] for n in (2, 4, 6)]
    assert {"model.embed.positions.target", "model.src_embed.positions.source", "model.output.weight"} <= average.keys()
    for key, value in average.items():
        torch.testing.assert_close(value, sum(p[key].double() for p in parts).float() / 3, rtol=0, atol=1e-6)


def test_a_model_with_every_switch_draws_attention_pictures(variant_run, tmp_path):
    out = draw(str(variant_run / "checkpoints" / "last.ckpt"), "the cat sees a dog .", None, 1, None, tmp_path, "cpu")
    weights = np.load(out / "attention.npz")
    assert weights["encoder"].shape[:2] == (2, 4)  # (layers, heads, ...)
    np.testing.assert_allclose(weights["cross"].sum(-1), 1.0, rtol=1e-5)


def test_export_refuses_what_marian_cannot_express_in_one_line(variant_run, tmp_path):
    with pytest.raises(InputError) as error:
        export(str(variant_run / "checkpoints" / "last.ckpt"), "hf", str(tmp_path / "hf"))
    message = str(error.value)
    assert "cannot be exported as a Marian model: d_k=6, d_v=10 with 4 heads" in message and "\n" not in message
    for switch in ("positions=learned", "norm=pre", "share_embeddings=none"):
        assert switch in message
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- the moving average


class EndedUpdates:
    """UpdateBookkeeping's answer to "did an update end with this micro-batch" (training/update.py), for a
    stand-in trainer: whether its global_step moved since the previous micro-batch."""

    def __init__(self, trainer):
        self.seen = trainer.global_step

    def finished(self, trainer):
        ended, self.seen = trainer.global_step != self.seen, trainer.global_step
        return ended or None


def test_the_moving_average_is_the_formula_once_per_update():
    """ema_0 = the initial weights; after update t, ema_t = d ema_{t-1} + (1 - d) w_t; micro-batches inside
    an accumulation window (no new update) change nothing."""
    decay = 0.75
    trainer = SimpleNamespace(global_step=0)
    module = SimpleNamespace(model=nn.Linear(3, 2), updates=EndedUpdates(trainer))
    ema = ExponentialMovingAverage(decay)
    ema.on_train_start(trainer, module)
    expected = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    for step in range(1, 4):
        with torch.no_grad():
            for p in module.model.parameters():
                p.add_(torch.randn_like(p))
        ema.on_train_batch_end(trainer, module, None, None, 0)  # the micro-batch before the update
        trainer.global_step = step
        ema.on_train_batch_end(trainer, module, None, None, 0)
        for name, p in module.model.named_parameters():
            expected[name] = decay * expected[name] + (1 - decay) * p.detach()
            torch.testing.assert_close(ema.average[name], expected[name], rtol=1e-6, atol=1e-6)
    assert ema.state_dict()["updates"] == 3
    with pytest.raises(ValueError, match="ema_decay=1"):
        ExponentialMovingAverage(1)


def test_a_resumed_run_continues_the_same_moving_average_bit_for_bit(tmp_path):
    """3 updates, stop, resume to 6 == 6 updates in one go (dropout 0.1 as every shipped config): the
    average, the weights and the training totals travel in the checkpoint."""
    corpus = write_corpus(tmp_path / "corpus")
    args = [f"data.path={corpus}", *RUN]
    train_in_process([*args, "trainer.max_steps=6"], tmp_path, tmp_path / "straight")
    train_in_process([*args, "trainer.max_steps=3"], tmp_path, tmp_path / "resumed")
    train_in_process([*args, "trainer.max_steps=6", "ckpt_path=last"], tmp_path, tmp_path / "resumed")
    straight, resumed = (
        read_checkpoint(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("straight", "resumed")
    )
    for key, value in ema_state(straight).items():
        assert torch.equal(ema_state(resumed)[key], value), key
        assert not torch.equal(straight["state_dict"][key], value)  # an average, not the weights
    assert straight["callbacks"][STATE_KEY]["updates"] == resumed["callbacks"][STATE_KEY]["updates"] == 6
    assert straight["totals"]["target_tokens"] == resumed["totals"]["target_tokens"] > 0


def test_make_average_and_evaluate_keep_working_for_runs_without_the_new_keys(tmp_path, capsys):
    """A run from before results.json (no totals, no moving average, no switches in its hyper-parameters)."""
    old = Path(__file__).resolve().parent / "data" / "pre-layout-step3.ckpt"
    folder = tmp_path / "old" / "checkpoints"
    folder.mkdir(parents=True)
    for step in (2, 3):
        shutil.copy(old, folder / f"step{step:07d}.ckpt")
    average = average_run(tmp_path / "old", 2)
    assert "totals" not in read_checkpoint(average)
    corpus = write_corpus(tmp_path / "corpus")
    scores = evaluate(
        hydra_task("evaluate", [f"ckpt={average}", f"data_path={corpus}", "split=test"], tmp_path / "evaluate")
    )
    assert scores["sentences"] == 30 and 0 <= scores["bleu"] <= 100


# ---------------------------------------------------------------- the study: one multirun, one collection


@pytest.mark.slow
def test_a_table3_sweep_runs_as_one_multirun_and_collects_into_one_table(tmp_path):
    """The README's two commands on a CPU-sized sweep: 3 rows of conf/table3_cpu (base with 2 seeds and
    learned positions) as one Hydra multirun, then `make table3` over its folder."""
    corpus = write_corpus(tmp_path / "corpus")
    sweep = tmp_path / "sweep"
    args = ["-m", "experiment=table3_cpu", "table3_cpu=base,base-seed1,E-learned", f"data.path={corpus}"]
    args += ["trainer.max_steps=4", "checkpoint.every_n_train_steps=2", "decoding.max_len_b=10"]
    run_train([*args, f"hydra.sweep.dir={sweep}"], tmp_path)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 3 and all((job / "results.json").is_file() for job in jobs)
    out = run_process([sys.executable, "-m", "transformer_mt.tools.table3", str(sweep)], tmp_path)
    assert out.returncode == 0, out.stderr
    table = (sweep / "table3.md").read_text()
    assert table in out.stdout
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| base", "| base-seed1", "| E-learned"]
    assert [row.split(" | ")[2] for row in rows] == ["0", "1", "0"]  # the seeds
    results = [json.loads((job / "results.json").read_text()) for job in jobs]
    bleu = {
        r["table3_row"]["name"]: r["models"]["last"]["validation"]["tokenized_bleu_compound_split"] for r in results
    }
    spread = abs(bleu["base"] - bleu["base-seed1"])
    assert f"dev_bleu {spread:.2f}" in table  # the base seeds' spread, and E's difference from their mean
    delta = bleu["E-learned"] - (bleu["base"] + bleu["base-seed1"]) / 2
    assert f"{delta:+.2f}{'*' if abs(delta) > spread else ''}" in rows[2]
    assert "4.92" in rows[2] and "25.7" in rows[2]  # the paper's row E beside ours


@pytest.mark.slow
def test_a_sweep_job_with_a_bad_value_fails_in_one_line_and_the_other_jobs_still_run(tmp_path):
    """Job 0's value is refused before any work: its one `error:` line and Hydra's one-line summary, no
    traceback; job 1 trains; the sweep's status says that a job failed."""
    corpus = write_corpus(tmp_path / "corpus")
    sweep = tmp_path / "sweep"
    args = ["-m", f"data.path={corpus}", "optim.warmup_steps=-5,4", "trainer.max_steps=2", f"hydra.sweep.dir={sweep}"]
    proc = run_train(args, tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: optim.warmup_steps=-5: must be a whole number, 0 or more"]
    assert re.search(r"Error executing job with overrides: \[.*'optim.warmup_steps=-5'", proc.stderr)  # Hydra's
    assert (sweep / "1" / "checkpoints" / "last.ckpt").is_file() and not (sweep / "0").exists()


def test_the_collector_names_unfinished_jobs_and_refuses_a_folder_that_is_not_a_sweep(tmp_path, capsys):
    (tmp_path / "sweep" / "0" / ".hydra").mkdir(parents=True)
    text = collect(tmp_path / "sweep")
    assert "0: no results.json (still running, failed, or stopped before its end" in text
    with pytest.raises(InputError, match="no job folders"):
        collect(tmp_path / "sweep" / "0")
    with pytest.raises(MissingInputError, match="no such folder"):
        collect(tmp_path / "missing")


def fake_results(folder: Path, name: str, row: str, seed: int, dev_bleu: float, test_bleu: float) -> None:
    """A job folder as a Table 3 sweep leaves it, with a results.json of these scores."""
    (folder / ".hydra").mkdir(parents=True)
    scores = {"ppl": 5.0, "tokenized_bleu_compound_split": dev_bleu, "bleu": dev_bleu - 1}
    results = {
        "updates": 100,
        "train_seconds": 60.0,
        "parameters": 2_500_000,
        "seed": seed,
        "table3_row": {"name": name, "row": row, "change": name, "paper": {"ppl": 4.92, "bleu": 25.8}},
        "models": {"last": {"validation": scores, "test": {**scores, "bleu": test_bleu}}},
    }
    (folder / "results.json").write_text(json.dumps(results))


def test_the_collector_orders_rows_as_table_3_and_marks_differences_beyond_the_base_seeds(tmp_path, capsys):
    """Base seeds at dev BLEU 30 and 31 (spread 1.00, mean 30.5): row E at 33 is +2.50, beyond; row D at 30.2 is
    -0.30, within. Runs spread over two sweep folders make one table."""
    first, second = tmp_path / "sweep", tmp_path / "seeds"
    fake_results(first / "0", "E-learned", "(E)", 0, 33.0, 34.0)
    fake_results(first / "1", "base", "base", 0, 30.0, 31.0)
    fake_results(first / "2", "D-drop0.0", "(D)", 0, 30.2, 30.0)
    fake_results(second / "0", "base-seed1", "base", 1, 31.0, 31.5)
    text = collect(first, second)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r[0] for r in rows] == ["| base", "| base-seed1", "| D-drop0.0", "| E-learned"]
    assert [r[6] for r in rows] == ["", "", "-0.30", "+2.50*"]  # Δ BLEU dev
    assert [r[9] for r in rows] == ["", "", "-1.25*", "+2.75*"]  # Δ test against 31.25, spread 0.50
    assert "dev_bleu 1.00" in text and "4 runs, 4 minutes of training" in text
    assert (first / "table3.md").read_text() == text


def test_make_finish_refuses_a_run_still_training_and_says_when_training_stopped_short(variant_run, tmp_path, capsys):
    """make finish beside a live training (the folder's lock held) is refused in one line naming the holder, and
    nothing is written; on a run whose training stopped before its schedule's end it says so, and what finishing
    then means (issue 45)."""
    from transformer_mt.finish import finish  # noqa: PLC0415

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
    del last["hyper_parameters"]["config"]["final"]  # a run from before the end-of-run protocol: its defaults
    torch.save(last, run / "checkpoints" / "last.ckpt")
    assert "test" in finish(run, device="cpu", tune=False).models["average-last3"]
    assert "holds no end-of-run settings (trained before the `final` block)" in capsys.readouterr().out


def test_make_finish_on_a_finished_run_keeps_its_results_and_their_tuned_block(variant_run, tmp_path, caplog):
    """make finish on a run that has its results.json (with the dev-set choice of final.tune): the new one is written,
    the earlier kept beside it as results.1.json, tuned block and all, and the log says so; again: results.2.json."""
    from transformer_mt.finish import finish  # noqa: PLC0415

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
    assert (
        f"{run / 'results.json'} was there already (an earlier end of this run): kept as results.1.json" in caplog.text
    )
    finish(run, device="cpu", tune=False)
    assert json.loads((run / "results.1.json").read_text()) == earlier and (run / "results.2.json").is_file()
