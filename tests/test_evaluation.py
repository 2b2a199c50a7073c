"""The evaluation wing (src/transformer_mt/evaluation/): one source of a split's text for every scorer, the
Decoding and Results types."""

import json
import os
import shutil
import signal
import sys

import pytest

from conftest import ROOT, hydra_task, run_process
from transformer_mt.checkpoint import load_for_inference, read_checkpoint
from transformer_mt.data.corpus import Corpus
from transformer_mt.decoding import PAPER, Decoding
from transformer_mt.errors import InputError, exit_on_user_error
from transformer_mt.evaluate import evaluate
from transformer_mt.evaluation.protocol import Protocol
from transformer_mt.evaluation.tuned import tuned_path
from transformer_mt.files import RunFolder
from transformer_mt.results import Results
from transformer_mt.stops import Stopped
from transformer_mt.tokenizer import train_tokenizer
from transformer_mt.tune import tune


def test_a_split_scores_the_same_at_the_end_of_a_run_in_make_evaluate_and_in_make_tune(trained_run, tmp_path):
    """Issue 41: a split's text is read one way (Corpus.texts). This validation split has lines with spaces around
    them and a pair whose target is empty (what training's cache cleans away); the end-of-run protocol, make
    evaluate and make tune's row at the paper's settings score the same 30 sentences identically."""
    data = tmp_path / "data"
    shutil.copytree(trained_run / "corpus", data)
    en, de = ((data / f"valid.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "de"))
    (data / "valid.en").write_text("\n".join([f"  {en[0]} ", *en[1:], "a source without its translation"]) + "\n")
    (data / "valid.de").write_text("\n".join([f"{de[0]}\t", *de[1:], ""]) + "\n")
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes((trained_run / "out" / "checkpoints" / "last.ckpt").read_bytes())
    cfg = read_checkpoint(ckpt)["hyper_parameters"]["config"]
    corpus = Corpus.from_config(cfg["data"], path=str(data))
    protocol = Protocol.of_run(RunFolder(trained_run / "out"), cfg, corpus=corpus)
    model, tokenizer, _ = load_for_inference(ckpt)
    short = PAPER.but(max_len_b=2)  # 12 updates: at +50 the grid's runaway guard abandons the row
    at_the_end = protocol.scores(model, tokenizer, "validation", short)
    overrides = [f"ckpt={ckpt}", f"data_path={data}", "decoding.max_len_b=2"]
    evaluated = evaluate(hydra_task("evaluate", [*overrides, "split=validation", "tuned=false"], tmp_path / "e"))
    tune(hydra_task("tune", [*overrides, "alphas=[0.6]", "beams=[4]"], tmp_path / "t"))
    tuned = json.loads(tuned_path(ckpt).read_text())["grid"][0]
    assert Decoding.of(tuned) == short and at_the_end["sentences"] == evaluated["sentences"] == 30
    assert at_the_end["bleu"] == evaluated["bleu"] == tuned["bleu"] and at_the_end["chrf"] == evaluated["chrf"]


def test_decoding_settings_are_checked_and_the_papers_are_written_once():
    assert Decoding.of({"beam_size": 4, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": 50}) == PAPER
    assert PAPER.ct2_length_penalty == pytest.approx(0.45) and PAPER.but(alpha=1.2).ct2_length_penalty == pytest.approx(
        0.9
    )
    assert PAPER.text() == "beam 4, alpha 0.6, max length 1 x source + 50"
    with pytest.raises(InputError, match=r"^conf: decoding.beam_size=0 is not a whole number of hypotheses"):
        Decoding.of({**PAPER.settings(), "beam_size": 0}, where="conf")


def test_results_json_reads_back_as_written(tmp_path):
    scores = {"bleu": 20.0, "chrf": 50.0, "tokenized_bleu_compound_split": 21.0, "ppl": 3.0, "sentences": 3}
    results = Results(updates=5, train_seconds=9.0, target_tokens=100, decoding=PAPER.settings(), seed=1)
    results.models["last"] = {"checkpoint": "run/checkpoints/last.ckpt", "test": {**scores, "bleu_signature": "s"}}
    results.write(tmp_path / "results.json")
    assert Results.read(tmp_path / "results.json") == results
    assert results.metrics() == {
        "final/last/test/bleu": 20.0,
        "final/last/test/chrf": 50.0,
        "final/last/test/tokenized_bleu": 21.0,
        "final/last/test/ppl": 3.0,
    }
    for bad in ("[1, 2]", '{"updates": 5, "bleu": 1}'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(InputError, match="bad.json: not a results.json"):
            Results.read(tmp_path / "bad.json")


def test_the_grids_significance_test_says_nothing_between_its_rows(caplog):
    """sacreBLEU's paired bootstrap logs "Pre-computing BLEU statistics ..." at INFO (its constructor too): make
    tune's table would have those lines between its rows (seen again on 2026-12-05)."""
    from transformer_mt.scoring import paired_bootstrap_p  # noqa: PLC0415

    references = ["ein Mann fährt Rad .", "zwei Hunde spielen im Schnee ."] * 10
    with caplog.at_level("INFO"):
        p = paired_bootstrap_p(references, ["ein Mann fährt .", "zwei Hunde spielen ."] * 10, references)
    assert 0 <= p <= 1 and not [r for r in caplog.records if r.name.startswith("sacrebleu")]


STOP_INSIDE = """
import os, signal, sys
import transformer_mt.evaluate as command
name = sys.argv.pop(1)
def stop(*args, **kwargs):  # as the test split starts decoding
    os.kill(os.getpid(), getattr(signal, name))
command.evaluate_translations = stop
command.main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_stop_during_make_evaluate_ends_in_one_line_and_leaves_no_folder(trained_run, tmp_path, name):
    """Ctrl+C (or SIGTERM) while make evaluate decodes: one line, 130 (143), no traceback, and no output folder (a
    69-line traceback and a folder with an empty evaluate.log before, issue 57)."""
    ckpt = trained_run / "out" / "checkpoints" / "last.ckpt"
    command = [sys.executable, "-c", STOP_INSIDE, name, f"ckpt={ckpt}"]
    proc = run_process(command, tmp_path)
    signum = getattr(signal, name)
    assert proc.returncode == 128 + signum and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"stopped by {name}: nothing was written", proc.stderr
    assert not (tmp_path / "outputs").exists()  # outputs/evaluate/<date>_<time>-<pid>/ went with it


STOP_IN_IMPORTS = """
import importlib.abc, os, signal, sys
class Stop(importlib.abc.MetaPathFinder):  # the signal as the command's first import of `heavy` begins
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["HEAVY"]:
            os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))
sys.meta_path.insert(0, Stop())
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, heavy, name",
    [
        ("evaluate", "hydra", "SIGINT"),
        ("tune", "omegaconf", "SIGTERM"),
        ("finish", "torch", "SIGINT"),
        ("averaging", "torch", "SIGTERM"),
        ("tools.export", "torch", "SIGINT"),
        ("scripts/benchmark.py", "torch", "SIGINT"),  # make bench
    ],
)
def test_a_stop_while_a_command_loads_its_imports_is_one_line_and_128_plus_it(tmp_path, command, heavy, name):
    """Ctrl+C or SIGTERM in a command's first seconds, while torch or Hydra load (a 15-52-line KeyboardInterrupt
    traceback, or no line for SIGTERM, before issue 63): the package, imported first, set the stop's one line."""
    (tmp_path / "sitecustomize.py").write_text(STOP_IN_IMPORTS)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HEAVY": heavy, "SIGNAL": name}
    entry = [str(ROOT / command)] if command.endswith(".py") else ["-m", f"transformer_mt.{command}"]
    proc = run_process([sys.executable, *entry, "x"], tmp_path, env=env)
    assert proc.returncode == 128 + getattr(signal, name), proc.stderr[-3000:]
    assert proc.stdout == "" and proc.stderr == f"stopped by {name}: nothing was written\n"


def test_a_second_signal_while_a_stop_is_handled_changes_nothing_of_its_outcome(capsys):
    """make forwards SIGTERM to its child, so `timeout` and job systems deliver two: the second, arriving while the
    first one's cleanup runs (removing the command's folder), neither cuts it short nor adds a line or a traceback."""
    cleaned = []

    def cleanup():
        os.kill(os.getpid(), signal.SIGTERM)  # the second signal, now
        cleaned.append(True)

    def command():
        raise Stopped(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stop:
            exit_on_user_error(command, cleanup=cleanup)
        assert stop.value.code == 143 and cleaned == [True]
        assert capsys.readouterr().err == "stopped by SIGTERM: nothing was written\n"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # the process is ending: later ones too
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_while_sentencepiece_trains_is_a_stop_not_a_vocabulary_error(tmp_path, capsys):
    """SentencePiece turned a stop inside its sentence iterator into its own error, which was blamed on the vocabulary
    size ("could not train a 800-token vocabulary (set data.vocab_size): INTERNAL: Stopped: (15, None)", exit 1)."""

    def sentences():
        for n in range(2000):
            if n == 1000:  # as a job system's SIGTERM comes: while the trainer reads its sentences
                os.kill(os.getpid(), signal.SIGTERM)
            yield f"sentence number {n} of a corpus"

    with pytest.raises(SystemExit) as stop:
        exit_on_user_error(train_tokenizer, sentences(), tmp_path, 100)
    assert stop.value.code == 143 and capsys.readouterr().err == "stopped by SIGTERM: nothing was written\n"
