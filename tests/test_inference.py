"""Checkpoint averaging, scoring, evaluate and translate on a checkpoint from a real (tiny) run."""

import ast
import json
import os
import pty
import random
import re
import select
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from urllib.error import URLError

import pytest
import sacrebleu
import torch
from omegaconf import OmegaConf
from sacrebleu.dataset import DATASETS

import transformer_mt.evaluate as evaluate_module
import transformer_mt.tune as tune_module
from conftest import ROOT, hydra_task, run_translate
from transformer_mt.averaging import average_run
from transformer_mt.checkpoint import (
    average_checkpoints,
    load_for_inference,
    read_checkpoint,
    run_checkpoints,
    start_inference,
    write_checkpoint,
)
from transformer_mt.commandline import check_command_line
from transformer_mt.data.corpus import Corpus
from transformer_mt.decoding import PAPER, Decoding
from transformer_mt.errors import InputError
from transformer_mt.evaluate import evaluate
from transformer_mt.evaluation.tuned import decoding_for, save_tuned, tuned_path
from transformer_mt.files import file_digest
from transformer_mt.runtime import IDEEP_CACHE, ONEDNN_CACHE, set_threads
from transformer_mt.scoring import score, split_compounds, tokenized_bleu
from transformer_mt.search import translate_lines
from transformer_mt.tune import tune

# ---------------------------------------------------------------- averaging


def fake_checkpoint(path, weights: dict, step: int) -> str:
    write_checkpoint({"state_dict": weights, "hyper_parameters": {"model": {}}, "global_step": step}, path)
    return str(path)


def test_averaging_identical_checkpoints_returns_them_unchanged(tmp_path):
    weights = {"model.w": torch.randn(3, 4), "model.b": torch.randn(4), "model.count": torch.tensor(7)}
    paths = [fake_checkpoint(tmp_path / f"step{i}.ckpt", weights, i) for i in range(3)]
    averaged = average_checkpoints(paths)["state_dict"]
    for key, value in weights.items():
        assert torch.equal(averaged[key], value), key  # bit for bit: accumulated in float64


def test_averaging_two_checkpoints_returns_their_mean(tmp_path):
    a = {"model.w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "model.b": torch.tensor([0.0, -2.0])}
    b = {"model.w": torch.tensor([[3.0, 2.0], [1.0, 0.0]]), "model.b": torch.tensor([1.0, 2.0])}
    averaged = average_checkpoints(
        [fake_checkpoint(tmp_path / "a.ckpt", a, 1), fake_checkpoint(tmp_path / "b.ckpt", b, 2)]
    )
    assert averaged["state_dict"]["model.w"].tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert averaged["state_dict"]["model.b"].tolist() == [0.5, 0.0]
    assert averaged["global_step"] == 2  # metadata of the newest


def test_averaging_incompatible_checkpoints_is_a_clear_error(tmp_path):
    a = fake_checkpoint(tmp_path / "a.ckpt", {"model.w": torch.zeros(2, 2)}, 1)
    b = fake_checkpoint(tmp_path / "b.ckpt", {"model.w": torch.zeros(3, 2)}, 2)
    c = fake_checkpoint(tmp_path / "c.ckpt", {"model.v": torch.zeros(2, 2)}, 3)
    with pytest.raises(ValueError, match=r"b\.ckpt: model\.w has shape \(3, 2\), .*a\.ckpt has \(2, 2\)"):
        average_checkpoints([a, b])
    with pytest.raises(ValueError, match=r"c\.ckpt and .*a\.ckpt hold different parameters"):
        average_checkpoints([a, c])


class NotPlainData:
    pass


def test_unreadable_checkpoints_are_named_in_one_line_without_unsafe_advice(tmp_path):
    good = Path(fake_checkpoint(tmp_path / "good.ckpt", {"model.w": torch.zeros(64, 64)}, 1))
    data = good.read_bytes()
    (tmp_path / "random.ckpt").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(5000)))
    (tmp_path / "truncated.ckpt").write_bytes(data[: len(data) // 2])  # a copy cut short
    torch.save({"state_dict": {}, "payload": NotPlainData()}, tmp_path / "pickle.ckpt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.ckpt")
    expected = {
        "random.ckpt": "not a checkpoint (torch.save writes a zip archive",
        "truncated.ckpt": "damaged or incomplete checkpoint",
        "pickle.ckpt": "holds Python objects besides tensors and plain values",
        "foreign.ckpt": "not a transformer_mt checkpoint",
    }
    for name, message in expected.items():
        for mmap in (False, True):
            with pytest.raises(InputError) as error:
                read_checkpoint(tmp_path / name, mmap=mmap)
            text = str(error.value)
            assert text.startswith(f"{tmp_path / name}: {message}") and "\n" not in text, text
            assert "weights_only" not in text  # torch's advice to switch the protection off is not passed on
    assert read_checkpoint(good, mmap=True)["global_step"] == 1
    # A folder (a run's, as CKPT=outputs/<run> is typed) is named as one, with the checkpoints in it
    with pytest.raises(InputError, match=r"is a folder: give a checkpoint file in it \(the first .ckpt files there: "):
        read_checkpoint(tmp_path)
    assert "foreign.ckpt, good.ckpt, pickle.ckpt" in str(pytest.raises(InputError, read_checkpoint, tmp_path).value)


@pytest.mark.parametrize("n", [0, -1])
def test_averaging_fewer_than_one_checkpoint_is_refused(trained_run, n):
    with pytest.raises(InputError) as error:
        average_run(trained_run / "out", n)
    assert str(error.value) == f"N={n}: average at least 1 checkpoint (the paper: N=5 for base, 20 for big)"


def test_average_of_a_real_run_loads_like_any_checkpoint(trained_run, tmp_path):
    checkpoints = run_checkpoints(trained_run / "out")
    assert [p.name for p in checkpoints] == [f"step{s:07d}.ckpt" for s in (3, 6, 9, 12)][-len(checkpoints) :]
    out = average_run(trained_run / "out", 3, tmp_path / "average-last3.ckpt")
    model, tokenizer, checkpoint = load_for_inference(out)
    expected = sum(read_checkpoint(p)["state_dict"]["model.embed.tokens.weight"] for p in checkpoints[-3:]) / 3
    torch.testing.assert_close(model.embed.tokens.weight, expected)
    assert checkpoint["averaged_from"] == [p.name for p in checkpoints[-3:]] and len(tokenizer) == 400
    # The same bytes however the run's folder is spelled (a relative path, an absolute one through a link)
    link = tmp_path / "link"
    link.symlink_to(trained_run / "out")
    again = average_run(Path(os.path.relpath(link)), 3, tmp_path / "again" / "average-last3.ckpt")
    assert again.read_bytes() == out.read_bytes()  # (torch.save names the archive after the file: the same name)
    # Without an output path: beside the checkpoints, as `make average` writes it, and not itself averaged later
    assert average_run(trained_run / "out", 2) == trained_run / "out" / "checkpoints" / "average-last2.ckpt"
    assert run_checkpoints(trained_run / "out") == checkpoints


def test_an_average_replaced_by_the_same_bytes_keeps_its_records_and_by_other_weights_names_them(
    trained_run, tmp_path, capsys
):
    out = average_run(trained_run / "out", 3, tmp_path / "average.ckpt")
    tuned = save_tuned(out, PAPER.but(beam_size=2), rows=[], split="validation")
    (tmp_path / "average.ct2").mkdir()  # engine=ct2's export folder (engines.ct2_folder)
    capsys.readouterr()
    average_run(trained_run / "out", 3, out)  # the same inputs: the same bytes, make tune's choice still holds
    assert "no longer apply" not in capsys.readouterr().out
    assert decoding_for(out, PAPER, "auto", given=False, say=lambda line: None).beam_size == 2
    average_run(trained_run / "out", 2, out)  # other weights under the same name
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"{out} now holds other weights: {tuned} and {tmp_path / 'average.ct2'} were made for the ones it replaced "
        "and no longer apply (make tune again; engine=ct2 exports again when next used)"
    )
    assert decoding_for(out, PAPER, "auto", given=False, say=lambda line: None) == PAPER


# ---------------------------------------------------------------- scoring


def test_scores_equal_sacrebleus_own():
    hyps = ["Ein Hund läuft durch den Schnee.", "Zwei Männer spielen Fußball auf einem grünen Feld."]
    refs = ["Ein Hund rennt durch den Schnee.", "Zwei Männer spielen auf einem Feld Fußball."]
    result = score(hyps, refs)
    assert result["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert result["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2)
    assert result["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        score(hyps, refs[:1])


def test_tokenized_bleu_splits_compounds_like_get_ende_bleu():
    assert (
        split_compounds("Rot-Weiß-Blau und E-Mail")
        == "Rot ##AT##-##AT## Weiß ##AT##-##AT## Blau und E ##AT##-##AT## Mail"
    )
    assert split_compounds("a-b-c - x") == "a ##AT##-##AT## b-c - x"  # perl's s///g: matches do not overlap
    # Moses tokens with compounds split, then BLEU on those tokens as they are (multi-bleu):
    hyp, ref = "Das ist die E-Post, heute.", "Das ist die E-Mail, heute."
    by_hand = sacrebleu.corpus_bleu(
        ["Das ist die E ##AT##-##AT## Post , heute ."],
        [["Das ist die E ##AT##-##AT## Mail , heute ."]],
        tokenize="none",
    )
    assert tokenized_bleu([hyp], [ref]) == pytest.approx(by_hand.score)
    # Split compounds give partial credit, one reason the paper's metric reads higher than sacreBLEU.
    assert tokenized_bleu([hyp], [ref]) > sacrebleu.corpus_bleu([hyp], [[ref]]).score


# ---------------------------------------------------------------- evaluate, translate


def test_translate_keeps_order_and_empty_lines_and_warns_on_truncation(trained_run, monkeypatch, capsys):
    ckpt = trained_run / "out" / "checkpoints" / "last.ckpt"
    long_line = " ".join(["the red cat"] * 40)  # > 63 tokens: longer than the model's positions
    text = "the cat sees a dog .\n\nthe big tree .\n" + long_line + "\n"
    out, err = run_translate(ckpt, text, "decoding.beam_size=2", monkeypatch=monkeypatch, capsys=capsys)
    lines = out.split("\n")
    assert len(lines) == 5 and lines[-1] == "" and lines[1] == ""  # 4 lines out, the empty one kept
    assert all(lines[i] for i in (0, 2, 3))
    assert "line 4" in err and "truncated" in err and "sentences/s" in err
    # The same sentence gives the same translation wherever it stands.
    again, _ = run_translate(ckpt, "the big tree .\n", "decoding.beam_size=2", monkeypatch=monkeypatch, capsys=capsys)
    assert again == lines[2] + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("command, own_key", [("evaluate", "src=FILE ref=FILE"), ("translate", "batch_lines=10000")])
def test_help_lists_the_shared_inference_keys_and_the_commands_own(command, own_key):
    proc = subprocess.run(
        [sys.executable, "-m", f"transformer_mt.{command}", "--help"], capture_output=True, text=True, check=True
    )
    keys = proc.stdout.split("Keys:\n", 1)[1]
    for line in ("  ckpt=PATH ", "  tokens_per_batch=16384 ", "  decoding.beam_size=4 ", f"  {own_key} "):
        assert line in keys, (line, keys)
    assert "${" not in proc.stdout  # every interpolation resolved


@pytest.mark.slow
def test_translate_stops_at_invalid_utf8_after_writing_the_lines_before_it(trained_run):
    ckpt = trained_run / "out" / "checkpoints" / "last.ckpt"
    valid = b"the cat sees a dog .\nthe big tree .\n"
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_mt.translate", f"ckpt={ckpt}", "decoding.beam_size=2", "batch_lines=1"],
        input=valid + "die Katze läuft .\n".encode("latin-1") + b"the house .\n",
        capture_output=True,
    )
    assert proc.returncode == 1
    out = proc.stdout.decode().split("\n")
    assert len(out) == 3 and out[0] and out[1] and out[2] == ""  # lines 1 and 2 translated and written
    assert proc.stderr.decode().strip().splitlines()[-1] == (
        "error: standard input, line 3: invalid UTF-8 (invalid continuation byte at byte 11 of the line); "
        "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8); the 2 lines before it were translated "
        "and written"
    )


def test_evaluate_files_and_data_test_split(trained_run, tmp_path, capsys):
    ckpt = trained_run / "out" / "checkpoints" / "last.ckpt"
    corpus = trained_run / "corpus"
    files = [f"ckpt={ckpt}", f"src={corpus / 'test.en'}", f"ref={corpus / 'test.de'}"]
    result = evaluate(hydra_task("evaluate", files, tmp_path / "files"))
    stdout = capsys.readouterr().out
    assert json.loads((tmp_path / "files" / "scores.json").read_text()) == result
    hyps = (tmp_path / "files" / "hypotheses.txt").read_text().split("\n")[:-1]
    refs = (corpus / "test.de").read_text().split("\n")[:-1]
    assert len(hyps) == 30 and result["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert "sacreBLEU" in stdout and "NOT comparable" in stdout and result["decoding"]["beam_size"] == 4
    # Without files: the test split of the data config stored in the checkpoint.
    assert evaluate(hydra_task("evaluate", [f"ckpt={ckpt}"], tmp_path / "split"))["bleu"] == result["bleu"]


@pytest.mark.slow
def test_two_make_evaluate_started_at_once_keep_both_results(trained_run, tmp_path):
    """Two `make evaluate` started in the same second (here the same moment) write folders of their own under
    outputs/evaluate/, each with its hypotheses and scores."""
    ckpt, corpus = trained_run / "out" / "checkpoints" / "last.ckpt", trained_run / "corpus"
    command = [
        sys.executable,
        "-m",
        "transformer_mt.evaluate",
        f"ckpt={ckpt}",
        f"src={corpus / 'test.en'}",
        f"ref={corpus / 'test.de'}",
    ]
    processes = [
        subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=280)
        assert process.returncode == 0, stderr[-3000:]
    folders = sorted((tmp_path / "outputs" / "evaluate").iterdir())
    assert len(folders) == 2 and all(
        (f / "scores.json").is_file() and (f / "hypotheses.txt").is_file() for f in folders
    )


def test_a_sacrebleu_test_set_that_cannot_be_downloaded_ends_in_one_line_naming_the_fix(tmp_path, monkeypatch):
    """Offline, `testset=wmt14/full` is one line naming local files (src=/ref=) or where sacreBLEU wants its
    download, not urllib's traceback; an unknown test set or language pair is one line too."""
    dataset = DATASETS["wmt14/full"]
    monkeypatch.setattr(dataset, "_outdir", str(tmp_path / "wmt14" / "full"))  # nothing downloaded before
    monkeypatch.setattr(dataset, "_rawdir", str(tmp_path / "wmt14" / "full" / "raw"))
    downloads = []

    def no_network(url, *args, **kwargs):  # what urllib raises on this machine, which cannot resolve statmt.org
        downloads.append(url)
        raise URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr(urllib.request, "urlopen", no_network)

    def test_set(name: str, langpair: str | None = None):  # as `make evaluate ARGS="testset=... langpair=..."` asks
        cfg = OmegaConf.create({"src": None, "ref": None, "testset": name, "langpair": langpair})
        return evaluate_module.test_set(cfg, {"src_lang": "en", "tgt_lang": "de"})  # the checkpoint's data config

    with pytest.raises(InputError) as refused:
        test_set("wmt14/full")
    message = str(refused.value)
    assert downloads == ["https://statmt.org/wmt14/test-full.tgz"] and "\n" not in message
    assert message.startswith("testset=wmt14/full: sacreBLEU could not download it ([Errno -2] Name or service")
    assert "Offline, score aligned local files instead: src=<source file> ref=<reference file>" in message
    tarball = tmp_path / "wmt14" / "full" / "raw" / "wmt14_full.test-full.tgz"
    assert f"download https://statmt.org/wmt14/test-full.tgz at {tarball} (SACREBLEU=<folder>" in message
    with pytest.raises(InputError, match="testset=wmt99: not a sacreBLEU test set"):
        test_set("wmt99")
    with pytest.raises(InputError, match="langpair=en-xx: not in testset=wmt14/full, whose pairs are cs-en, en-cs"):
        test_set("wmt14/full", "en-xx")


@pytest.mark.slow
def test_translate_answers_each_line_at_a_terminal_before_stdin_closes(trained_run):
    ckpt = trained_run / "out" / "checkpoints" / "last.ckpt"
    primary, secondary = pty.openpty()  # stdin is a terminal, as when a user types
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer_mt.translate", f"ckpt={ckpt}", "decoding.beam_size=2"],
        stdin=secondary,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    os.close(secondary)
    try:
        os.write(primary, b"the cat sees a dog .\n")
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no translation came out while stdin stayed open"
        first = proc.stdout.readline()
        assert proc.poll() is None  # still waiting for the next line
        os.write(primary, b"the big tree .\n")
        second = proc.stdout.readline()
    finally:
        os.close(primary)  # end of input
        proc.wait(timeout=60)
    plain = subprocess.run(
        [sys.executable, "-m", "transformer_mt.translate", f"ckpt={ckpt}", "decoding.beam_size=2"],
        input="the cat sees a dog .\nthe big tree .\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert (first + second).decode() == plain.stdout


def test_n_best_lists_in_translate_and_evaluate(trained_run, tmp_path, monkeypatch, capsys):
    ckpt = trained_run / "out" / "checkpoints" / "last.ckpt"
    text = "the cat sees a dog .\n\nthe big tree .\n"
    best = run_translate(ckpt, text, monkeypatch=monkeypatch, capsys=capsys)[0].split("\n")
    nbest, _ = run_translate(ckpt, text, "n_best=3", monkeypatch=monkeypatch, capsys=capsys)
    entries = [line.split(" ||| ") for line in nbest.splitlines()]
    by_line = {n: [(t, float(s)) for m, t, s in entries if int(m) == n] for n in (0, 1, 2)}
    assert len(entries) == len(by_line[0]) + len(by_line[1]) + len(by_line[2])
    assert by_line[1] == [("", 0.0)]  # an empty line: one empty hypothesis
    for n in (0, 2):
        texts, scores = zip(*by_line[n])
        assert len(texts) == 3 and texts[0] == best[n] and list(scores) == sorted(scores, reverse=True)
        assert len(set(texts)) == 3 and all(s < 0 for s in scores)  # three different hypotheses, log-probabilities
    with pytest.raises(InputError, match="n_best=5 exceeds the beam size 4"):
        run_translate(ckpt, text, "n_best=5", monkeypatch=monkeypatch, capsys=capsys)
    corpus = trained_run / "corpus"
    out = tmp_path / "eval"
    evaluate(
        hydra_task(
            "evaluate", [f"ckpt={ckpt}", "n_best=2", f"src={corpus / 'test.en'}", f"ref={corpus / 'test.de'}"], out
        )
    )
    hyps = (out / "hypotheses.txt").read_text().splitlines()
    listed = [line.split(" ||| ") for line in (out / "nbest.txt").read_text().splitlines()]
    firsts = {}
    for n, t, _ in listed:
        firsts.setdefault(int(n), t)
    assert [firsts[i] for i in range(len(hyps))] == hyps and len(listed) <= 2 * len(hyps)


def test_the_readme_python_example_translates(trained_run, capsys):
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    (page,) = [p.read_text() for p in docs if "<!-- python example -->" in p.read_text()]
    example = page.split("<!-- python example -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert len([line for line in example.splitlines() if line.strip()]) <= 5
    ckpt = trained_run / "out" / "checkpoints" / "last.ckpt"
    exec(re.sub(r'load_for_inference\("[^"]+"\)', f'load_for_inference("{ckpt}")', example), {})
    model, tokenizer, _ = load_for_inference(ckpt)
    sentences = ast.literal_eval(re.search(r"\[(\"[^]]+)\]", example).group(0))
    assert capsys.readouterr().out.strip() == str(translate_lines(model, tokenizer, sentences, beam_size=4))


def test_every_inference_command_bounds_onednns_and_ideeps_caches_as_training_does(trained_run, monkeypatch):
    """evaluate, translate, tune and make attention start through start_inference: the capacities that keep a long
    translation from growing per batch shape (test_allocator: what they do), unless the environment sets its own."""
    for name in (ONEDNN_CACHE, IDEEP_CACHE):
        monkeypatch.setenv(name, "recorded")  # so that the test's end restores the process's environment
        monkeypatch.delenv(name)
    start_inference(trained_run / "out" / "checkpoints" / "last.ckpt", "cpu")
    assert (os.environ[ONEDNN_CACHE], os.environ[IDEEP_CACHE]) == ("0", "1")
    monkeypatch.setenv(ONEDNN_CACHE, "64")
    start_inference(trained_run / "out" / "checkpoints" / "last.ckpt", "cpu")
    assert os.environ[ONEDNN_CACHE] == "64"


def test_threads_option_sets_torch_threads_and_refuses_nonsense():
    before = torch.get_num_threads()
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1
        set_threads(0)  # 0: torch's default stays as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(InputError, match="threads=-1: must be 0"):
        set_threads(-1)
    for bad, message in [("1.5", "threads=1.5: must be a whole number"), ("two", "threads=two: must be a whole")]:
        with pytest.raises(InputError, match=message):  # its type: as the command line is read
            check_command_line("translate", ["ckpt=x", f"threads={bad}"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_by_every_command_in_one_line_naming_file_and_tensor(
    bad, trained_run, tmp_path, monkeypatch, capsys
):
    checkpoint = read_checkpoint(trained_run / "out" / "checkpoints" / "last.ckpt")
    key = "model.decoder_layers.1.ffn.w1.weight"
    checkpoint["state_dict"][key][3, 5] = bad
    broken = write_checkpoint(checkpoint, tmp_path / "broken.ckpt")
    message = rf"broken.ckpt: the weights are not finite: {re.escape(key)} holds {int(bad != bad)} NaN and "
    from transformer_mt.tools.attention_maps import draw  # noqa: PLC0415
    from transformer_mt.tools.export import export  # noqa: PLC0415

    commands = {
        "translate": lambda: run_translate(broken, "ein test\n", monkeypatch=monkeypatch, capsys=capsys),
        "translate greedy": lambda: run_translate(
            broken, "ein test\n", "decoding=greedy", monkeypatch=monkeypatch, capsys=capsys
        ),
        "evaluate": lambda: evaluate(hydra_task("evaluate", [f"ckpt={broken}"], tmp_path / "evaluate")),
        "average": lambda: average_checkpoints([trained_run / "out" / "checkpoints" / "step0000012.ckpt", broken]),
        "export": lambda: export(str(broken), "hf", str(tmp_path / "hf")),
        "attention": lambda: draw(str(broken), "ein test", None, 1, None, str(tmp_path / "att"), "cpu"),
    }
    for name, command in commands.items():
        with pytest.raises(InputError, match=message):
            command()
        assert not (tmp_path / "hf").exists() and not (tmp_path / "att").exists(), name


def test_a_killed_writers_temporaries_are_removed_by_the_next_average(trained_run, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process has now: the writer that was killed
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in ("step0000009.ckpt", "step0000012.ckpt"):
        os.link(trained_run / "out" / "checkpoints" / name, checkpoints / name)
    host = socket.gethostname()
    stale = checkpoints / f".average-last2.ckpt.tmp-{host}-{dead.pid}-0123abcd"  # a killed make average
    stale.write_bytes(b"")
    other = checkpoints / f".average-last5.ckpt.tmp-{host}-{dead.pid}-89abcdef"  # ... of another N
    other.write_bytes(b"")
    alive = checkpoints / f".average-last2.ckpt.tmp-{host}-{os.getpid()}-4567cdef"  # a write in progress
    alive.write_bytes(b"")
    average_run(tmp_path / "run", 2)
    assert not stale.exists() and not other.exists() and alive.exists()
    assert (checkpoints / "average-last2.ckpt").is_file()


# ---------------------------------------------------------------- engines (engine=ct2's own tests: test_export.py)


def test_engines_imports_without_torch_as_the_ct2_path_needs():
    """engines.py defers every torch import: engine=ct2 decodes without torch (two OpenMP runtimes slow both)."""
    check = (
        "import sys, transformer_mt.evaluation.engines; assert 'torch' not in sys.modules, 'engines.py imported torch'"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- make tune: decoding chosen on the development set


def test_make_tune_chooses_on_validation_only_and_translate_and_evaluate_then_use_its_choice(
    trained_run, tmp_path, monkeypatch, capsys
):
    ckpt = tmp_path / "model.ckpt"  # a copy: the choice is written beside it, not beside the shared run's
    ckpt.write_bytes((trained_run / "out" / "checkpoints" / "last.ckpt").read_bytes())
    loaded, load = [], Corpus.load
    monkeypatch.setattr(Corpus, "load", lambda self, split: loaded.append(split) or load(self, split))
    grid = [f"ckpt={ckpt}", "alphas=[0.0,2.0]", "beams=[1,2]", "decoding.max_len_b=8"]
    chosen = tune(hydra_task("tune", grid, tmp_path / "tune"))
    out = capsys.readouterr().out
    assert loaded == ["validation"]  # the test split is never read when choosing
    record = json.loads(tuned_path(ckpt).read_text())
    rows = record["grid"]
    # 2 alphas at beam 4, beams 1 and 2 at the best alpha, then the length limit doubled: 5 decodes, each printed
    assert [(r["beam_size"], r["alpha"]) for r in rows[:2]] == [(4, 0.0), (4, 2.0)] and len(rows) == 5
    assert rows[-1]["max_len_b"] == 16 and {r["beam_size"] for r in rows[2:4]} == {1, 2}
    assert record["decoding"] == chosen.settings() and any(chosen.settings().items() <= r.items() for r in rows)
    assert all(f"\n{step}: " in out for step in ("length penalty", "beam", "length limit"))  # why, at each step
    assert out.count(" BP ") == 1 and all(f"{r['length_ratio']:.3f}" in out for r in rows) and "signature: nrefs" in out
    explicit = [f"decoding.{k}={v}" for k, v in chosen.settings().items()]
    expected = evaluate(hydra_task("evaluate", [f"ckpt={ckpt}", *explicit], tmp_path / "explicit"))
    # make evaluate and make translate: the stored choice by default, and they say so
    result = evaluate(hydra_task("evaluate", [f"ckpt={ckpt}"], tmp_path / "default"))
    assert result["decoding"] == chosen.settings() and result["bleu"] == expected["bleu"]
    said = [line for line in capsys.readouterr().out.splitlines() if "make tune" in line]
    assert len(said) == 1 and "chosen on the text validation split by make tune" in said[0]
    assert len(said[0].replace(str(tuned_path(ckpt)), "")) <= 160  # one of ~300 characters before (final.tune)
    paper = evaluate(hydra_task("evaluate", [f"ckpt={ckpt}", "tuned=false"], tmp_path / "paper"))["decoding"]
    assert (paper["beam_size"], paper["alpha"]) == (4, 0.6)
    given = evaluate(hydra_task("evaluate", [f"ckpt={ckpt}", "decoding.alpha=0.6"], tmp_path / "given"))["decoding"]
    assert given["beam_size"] == 4  # a decoding key on the command line: conf/decoding's settings, as given
    source = "the cat sees a dog .\n"
    tuned_out, err = run_translate(ckpt, source, monkeypatch=monkeypatch, capsys=capsys)
    assert (
        "by make tune" in err
        and tuned_out == run_translate(ckpt, source, *explicit, monkeypatch=monkeypatch, capsys=capsys)[0]
    )
    # a record made for other bytes is not used, and that is said
    other = tmp_path / "other.ckpt"
    other.write_bytes((trained_run / "out" / "checkpoints" / "step0000003.ckpt").read_bytes())
    tuned_path(other).write_text(tuned_path(ckpt).read_text())
    said = []
    assert decoding_for(other, PAPER, "auto", False, said.append) == PAPER and "another version" in said[0]
    with pytest.raises(InputError, match="never on the test split"):
        tune(hydra_task("tune", [f"ckpt={ckpt}", "split=test"], tmp_path / "refused"))
    with pytest.raises(InputError, match=r"sentences=-3: the number of the split's first sentences"):  # not [:-3]
        tune(hydra_task("tune", [f"ckpt={ckpt}", "sentences=-3"], tmp_path / "refused"))
    with pytest.raises(InputError, match=r"n_best=2: make tune scores each setting's best translation only"):
        tune(hydra_task("tune", [f"ckpt={ckpt}", "n_best=2"], tmp_path / "refused"))


def test_make_tune_whose_every_row_ran_away_chooses_nothing_and_writes_no_record(
    trained_run, tmp_path, monkeypatch, capsys
):
    """An undertrained model whose every row is abandoned by the runaway guard: one line, no record, conf/decoding's."""
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes((trained_run / "out" / "checkpoints" / "last.ckpt").read_bytes())
    abandoned = {**PAPER.settings(), "bleu": None, "abandoned": "abandoned: 4.38x the usual length", "seconds": 1.0}
    monkeypatch.setattr(tune_module, "search_grid", lambda *args: (PAPER, [abandoned]))
    assert tune(hydra_task("tune", [f"ckpt={ckpt}"], tmp_path / "tune")) == PAPER
    assert "every row's translations ran away" in capsys.readouterr().out and not tuned_path(ckpt).exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"beam_size": 0}, "decoding.beam_size=0 is not a whole number of hypotheses, at least 1; correct it, or "),
        ({"alpha": "0.6"}, 'decoding.alpha="0.6" is not a length penalty exponent, a number at least 0; correct it'),
        ({"alpha": None}, "decoding.alpha=null is not a length penalty exponent"),
        ({"max_len_b": 2.5}, "decoding.max_len_b=2.5 is not a whole number at least 0"),
        ({"beam_size": True}, "decoding.beam_size=true is not a whole number"),
        ({"max_len_a": ...}, "decoding.max_len_a is missing (a number at least 0"),  # ...: the key removed
    ],
)
def test_a_hand_edited_tune_record_is_refused_in_one_line_naming_the_setting(edit, message, tmp_path):
    """make tune's <ckpt>.decoding.json, edited by hand: a setting beam search cannot take is one line naming the file,
    the setting and the fix, not a traceback from inside the search (issue 45)."""
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"the checkpoint's bytes")  # the record names their SHA-256
    paper = {"beam_size": 4, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": 50}
    chosen = {key: value for key, value in (paper | edit).items() if value is not ...}
    record = {
        "decoding": chosen,
        "chosen_on": "text validation",
        "chosen_by": "make tune",
        "checkpoint_sha256": file_digest(ckpt),
        "grid": [],
    }
    tuned_path(ckpt).write_text(json.dumps(record))
    with pytest.raises(InputError) as error:
        decoding_for(ckpt, PAPER, "auto", False, print)
    assert str(error.value).startswith(f"{tuned_path(ckpt)}: {message}") and "\n" not in str(error.value)
    save_tuned(ckpt, Decoding(beam_size=4, alpha=1, max_len_a=1, max_len_b=50), [], "text validation")
    assert decoding_for(ckpt, PAPER, "auto", False, print).alpha == 1  # whole numbers are numbers too
