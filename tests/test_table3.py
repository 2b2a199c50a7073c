"""The Table 3 study (tools/table3.py): a sweep as one Hydra multirun (a job with a bad value fails alone, in one
line) and the collector that makes one table of its jobs' results.json."""

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import run_process, run_train, write_corpus
from transformer_mt.errors import InputError, MissingInputError
from transformer_mt.tools.table3 import collect


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
    assert errors == ["error: optim.warmup_steps=-5: must be 0 or more"]
    assert re.search(r"Error executing job with overrides: \[.*'optim.warmup_steps=-5'", proc.stderr)  # Hydra's
    assert (sweep / "1" / "checkpoints" / "last.ckpt").is_file() and not (sweep / "0").exists()


def test_the_collector_names_unfinished_jobs_and_refuses_a_folder_that_is_not_a_sweep(tmp_path, capsys):
    (tmp_path / "sweep" / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "sweep" / "1" / ".hydra").mkdir(parents=True)  # a job run with its end off: not a failure
    (tmp_path / "sweep" / "1" / ".hydra" / "config.yaml").write_text("seed: 0\nfinal:\n  enabled: false\n")
    fake_results(tmp_path / "sweep" / "2", "D-drop0.0", "(D)", 0, 30.2, 30.0)
    text = collect(tmp_path / "sweep")
    assert "0: no results.json (still running, failed, or stopped before its end" in text
    job = tmp_path / "sweep" / "1"
    assert f"{job}: no results.json (it ran with final.enabled=false: make finish RUN={job} scores it)" in text
    assert "No base run: no difference from base is given" in text and "One base run" not in text
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
