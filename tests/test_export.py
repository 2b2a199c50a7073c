"""make export (transformers' MarianMTModel, CTranslate2), make attention, make plot, and make bench's tables
(scripts/benchmark.py, scripts/host_overhead.py), on tiny models; export and attention pictures also on a model
with every switch on (conftest's variant_run)."""

import contextlib
import csv
import json
import resource
import runpy
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, run_train, synthetic_corpus, tiny_config, write_corpus
from transformer_mt.checkpoint import load_for_inference, write_checkpoint
from transformer_mt.decoding import PAPER
from transformer_mt.errors import InputError, UserError, exit_on_user_error
from transformer_mt.evaluation.engines import CT2Process, ct2_export
from transformer_mt.evaluation.tuned import save_tuned
from transformer_mt.model import Transformer, sinusoidal_positions
from transformer_mt.results import Results
from transformer_mt.runtime import usable_cores
from transformer_mt.search import translate_ids, translate_lines
from transformer_mt.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, train_tokenizer
from transformer_mt.tools import export as export_module
from transformer_mt.tools.attention_maps import draw
from transformer_mt.tools.export import export, marian_order
from transformer_mt.tools.model_card import LICENSE_NAME, REPOSITORY
from transformer_mt.tools.plot import find, read_metrics
from transformer_mt.training.saving import AtomicCheckpointIO

SENTENCES = [
    "the cat sees a dog .",
    "a small red house and a big tree .",
    "the dog runs .",
    "Zwei Hunde, 42 Grad - ça va?",  # characters the tokenizer never saw: byte pieces
]


DATA = {"name": "multi30k", "src_lang": "en", "tgt_lang": "de", "hub_name": "bentrevett/multi30k", "hub_config": None}


def write_random_checkpoint(path, tokenizer, sharpen: float = 1.0, **switches):
    """A checkpoint of random weights with every parameter away from its initial value (biases and
    LayerNorm gains too: a permutation missed anywhere shows) and a real SentencePiece model.
    sharpen > 1 scales attention logits by sharpen^2 and doubles the embeddings, so that greedy
    outputs vary from step to step instead of repeating one token (at the price of float32
    logits further from an exact recomputation)."""
    cfg = tiny_config(vocab_size=len(tokenizer), d_ff=48, max_positions=96, **switches)  # sharpen: tuned to d_ff 48
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "decoder_norm.weight":  # pre-norm: its output is near its input's embedding, which greedy
                p.copy_(3 * torch.randn_like(p))  # would repeat (tied weights) unless the gains flip signs
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(sharpen)
            elif name.startswith("embed") and sharpen > 1:
                p.mul_(2.0)
    checkpoint = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "hyper_parameters": {"model": asdict(cfg), "config": {"data": DATA}},
        "sentencepiece": tokenizer.proto,
    }
    return write_checkpoint(checkpoint, path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    en, de = synthetic_corpus(300)
    return train_tokenizer(en + de, tmp_path_factory.mktemp("spm"), vocab_size=400)


@pytest.fixture(scope="module")
def random_checkpoint(tokenizer, tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("random") / "random.ckpt", tokenizer)


@pytest.fixture(scope="module")
def sharp_checkpoint(tokenizer, tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("sharp") / "sharp.ckpt", tokenizer, sharpen=4.0)


def exported(checkpoint, fmt: str, tmp_path_factory):
    pytest.importorskip("transformers", reason='the export extra is not installed (pip install -e ".[export]")')
    pytest.importorskip("ctranslate2", reason='the export extra is not installed (pip install -e ".[export]")')
    return export(str(checkpoint), fmt, str(tmp_path_factory.mktemp(fmt) / "model"))


def ours_and_hf(checkpoint, tmp_path_factory):
    """(our model, our tokenizer, MarianMTModel, MarianTokenizer) of one checkpoint, the latter two via make export."""
    out = exported(checkpoint, "hf", tmp_path_factory)
    transformers = pytest.importorskip("transformers")
    model, tokenizer, _ = load_for_inference(checkpoint)
    return (
        model,
        tokenizer,
        transformers.MarianMTModel.from_pretrained(out).eval(),
        transformers.MarianTokenizer.from_pretrained(out),
    )


def test_marian_order_maps_our_interleaved_positions_onto_marians_sines_then_cosines():
    transformers = pytest.importorskip("transformers", reason="the export extra is not installed")
    d = 10
    marian = transformers.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding(7, d)
    torch.testing.assert_close(marian.create_weight(), sinusoidal_positions(7, d)[:, marian_order(d)])


def test_hf_export_gives_our_ids_and_logits(random_checkpoint, tmp_path_factory):
    model, tokenizer, hf, hf_tokenizer = ours_and_hf(random_checkpoint, tmp_path_factory)
    config = hf.config
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (PAD_ID, EOS_ID, BOS_ID)
    assert config.decoder_start_token_id == BOS_ID and hf.generation_config.decoder_start_token_id == BOS_ID
    assert hf.model.encoder.embed_scale == pytest.approx(model.cfg.d_model**0.5) == hf.model.decoder.embed_scale
    assert not hf.final_logits_bias.any()
    assert hf.lm_head.weight.data_ptr() == hf.model.shared.weight.data_ptr()  # one shared matrix (§3.4)
    assert hf_tokenizer.pad_token_id == PAD_ID and hf_tokenizer.unk_token_id == UNK_ID
    for side in ("source", "target"):  # the checkpoint's own SentencePiece model
        assert (Path(hf_tokenizer.name_or_path) / f"{side}.spm").read_bytes() == tokenizer.proto

    batch = hf_tokenizer(SENTENCES, return_tensors="pt", padding=True)
    ours = tokenizer.encode(SENTENCES)
    assert [[i for i in row if i != PAD_ID] for row in batch.input_ids.tolist()] == [ids + [EOS_ID] for ids in ours]
    # Teacher forcing on target ids of another length than the source.
    tgt_in = torch.cat([torch.full((len(SENTENCES), 1), BOS_ID), batch.input_ids.flip(1)[:, :-3]], dim=1)
    with torch.no_grad():
        diff = (model(batch.input_ids, tgt_in) - hf(**batch, decoder_input_ids=tgt_in).logits).abs().max()
        exact = model.double()(batch.input_ids, tgt_in) - hf.double()(**batch, decoder_input_ids=tgt_in).logits
    assert diff <= 1e-4 and exact.abs().max() <= 1e-9  # float64: no rounding to hide a wrong weight behind


def test_hf_export_gives_our_greedy_translations(sharp_checkpoint, tmp_path_factory):
    model, tokenizer, hf, hf_tokenizer = ours_and_hf(sharp_checkpoint, tmp_path_factory)
    n = 25  # the same length limit for both: n tokens, then EOS forced
    expected = translate_ids(model, tokenizer.encode(SENTENCES), beam_size=1, max_len_a=0, max_len_b=n)
    batch = hf_tokenizer(SENTENCES, return_tensors="pt", padding=True)
    generated = hf.generate(**batch, num_beams=1, do_sample=False, max_length=n + 2)  # BOS, n tokens, EOS
    got = [[i for i in row if i not in (BOS_ID, EOS_ID, PAD_ID)] for row in generated.tolist()]
    assert got == expected
    assert len({tuple(e) for e in expected}) == len(expected) and all(len(set(e)) >= 3 for e in expected)
    assert hf_tokenizer.batch_decode(generated, skip_special_tokens=True) == tokenizer.decode(expected)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_ct2_export_gives_our_greedy_tokens(norm, tokenizer, tmp_path_factory):
    ctranslate2 = pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    sharp = write_random_checkpoint(tmp_path_factory.mktemp(norm) / "sharp.ckpt", tokenizer, sharpen=4.0, norm=norm)
    out = exported(sharp, "ct2", tmp_path_factory)
    model, tokenizer, _ = load_for_inference(sharp)
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32")
    n = 25
    results = translator.translate_batch(
        [tokenizer.sp.encode(s, out_type=str) for s in SENTENCES], beam_size=1, max_decoding_length=n
    )
    expected = translate_ids(model, tokenizer.encode(SENTENCES), beam_size=1, max_len_a=0, max_len_b=n)
    assert [tokenizer.sp.piece_to_id(r.hypotheses[0]) for r in results] == expected
    assert len({tuple(e) for e in expected}) == len(expected) and all(len(set(e)) >= 3 for e in expected)
    assert (out / "sentencepiece.model").read_bytes() == tokenizer.proto
    assert f"({norm}-norm, ReLU" in (out / "README.md").read_text()  # the model card says which


def test_export_refuses_an_existing_folder_and_a_missing_extra(random_checkpoint, tmp_path, monkeypatch):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="exists; remove it or choose another"):
        export(str(random_checkpoint), "hf", str(tmp_path / "taken"))
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if not installed: import fails
    with pytest.raises(UserError, match=r"needs the Python package 'ctranslate2': install the extra with pip install"):
        export(str(random_checkpoint), "ct2", str(tmp_path / "ct2"))
    assert not (tmp_path / "ct2").exists()


@pytest.mark.parametrize(("fmt", "kind"), [("hf", "MarianMTModel"), ("ct2", "CTranslate2")])
def test_export_refuses_what_the_format_cannot_express_in_one_line(fmt, kind, variant_run, tmp_path):
    pytest.importorskip({"hf": "transformers", "ct2": "ctranslate2"}[fmt], reason="the export extra is not installed")
    with pytest.raises(InputError) as error:
        export(str(variant_run / "checkpoints" / "last.ckpt"), fmt, str(tmp_path / fmt))
    message = str(error.value)
    assert f"cannot be exported as {kind}: d_k=6, d_v=10 with 4 heads" in message and "\n" not in message
    for switch in ("positions=learned", "share_embeddings=none"):
        assert switch in message
    assert ("norm=pre" in message) == (fmt == "hf")  # CTranslate2 has pre-norm
    assert not (tmp_path / fmt).exists()


# ---------------------------------------------------------------- attention pictures


def scores(bleu: float, chrf: float, sentences: int) -> dict:
    return {
        "bleu": bleu,
        "bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
        "chrf": chrf,
        "chrf_signature": "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0",
        "tokenized_bleu_compound_split": bleu + 1.0,
        "sentences": sentences,
    }


def test_an_export_carries_a_model_card_whose_metrics_are_the_runs_results(random_checkpoint, tmp_path):
    pytest.importorskip("transformers", reason='the export extra is not installed (pip install -e ".[export]")')
    ModelCard = pytest.importorskip("huggingface_hub").ModelCard  # the export extra's, with transformers

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    ckpt = checkpoints / "average-last5.ckpt"
    ckpt.write_bytes(random_checkpoint.read_bytes())
    entry = {"checkpoint": "/elsewhere/run/checkpoints/average-last5.ckpt"}  # written before the folder moved
    entry |= {"validation": scores(21.37, 48.2, 1014), "test": scores(23.05, 51.9, 1000)}
    overrides = [f"data.path={tmp_path}/m30k", f"hydra.run.dir={tmp_path}/run", "optim.lr_factor=2"]
    figures = dict.fromkeys(("target_tokens_per_second", "model_flops_per_second", "mfu", "peak_flops_per_second"))
    Results(
        updates=1625,
        train_seconds=1572.0,
        target_tokens=5_400_000,
        devices=1,
        peak=None,
        parameters=1000,
        decoding=PAPER.settings(),
        overrides=overrides,
        models={"a": entry},
        **figures,
    ).write(tmp_path / "run" / "results.json")
    out = export(str(ckpt), "hf", str(tmp_path / "hf"))
    card = ModelCard.load(out / "README.md")  # a local file: nothing reaches the network
    assert card.data.language == ["en", "de"] and "translation" in card.data.tags
    found = {(r.dataset_split, r.metric_type): (r.metric_value, r.metric_config) for r in card.data.eval_results}
    assert found == {
        (split, metric): (entry[split][metric], entry[split][f"{metric}_signature"])
        for split in ("validation", "test")
        for metric in ("bleu", "chrf")
    }
    assert "1625" in card.text and "`optim.lr_factor=2` (local paths left out)" in card.text
    assert str(tmp_path) not in str(card) and "not comparable" in card.text  # no local path, front matter included
    assert card.data.license == "other" and card.data.license_name == LICENSE_NAME  # the user's to set: said
    assert "At the export, checked: the exported tokenizer gives our ids and the model our logits" in card.text
    assert f"From results.json ({PAPER.text()}):" in card.text
    snippet = card.text.split("```python\n")[1].split("```")[0]  # the card's usage code, run with the folder
    assert f'repository = "{REPOSITORY}"' in snippet
    snippet = snippet.replace(REPOSITORY, str(out))
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["model"].config.d_model == tiny_config().d_model
    results = json.loads((tmp_path / "run" / "results.json").read_text())  # a run finished by make finish, once:
    (tmp_path / "run" / "results.json").write_text(json.dumps({**results, "overrides": None}))  # none recorded
    card = ModelCard.load(export(str(ckpt), "hf", str(tmp_path / "hf-2")) / "README.md")
    assert "- command-line overrides: not recorded" in card.text and "(none)" not in card.text


def test_only_a_users_make_export_is_told_to_set_the_model_cards_license(
    random_checkpoint, tmp_path, monkeypatch, capsys
):
    """The license line once, to make export's user; not from the exports engine=ct2 and make bench make for themselves
    (three times in one make bench before issue 63), which say what they export."""
    pytest.importorskip("transformers", reason='the export extra is not installed (pip install -e ".[export]")')
    export(str(random_checkpoint), "hf", str(tmp_path / "inside"))
    said = capsys.readouterr().out
    assert said.startswith(f"exporting {random_checkpoint} as MarianMTModel") and "license" not in said
    monkeypatch.setattr(sys, "argv", ["export", str(random_checkpoint), "--out", str(tmp_path / "user")])
    export_module.main()
    assert capsys.readouterr().out.count("the model card's license is `other`") == 1


def test_an_export_of_a_checkpoint_without_a_run_says_it_has_no_scores(random_checkpoint, tmp_path):
    pytest.importorskip("transformers", reason='the export extra is not installed (pip install -e ".[export]")')
    pytest.importorskip("ctranslate2", reason='the export extra is not installed (pip install -e ".[export]")')
    ModelCard = pytest.importorskip("huggingface_hub").ModelCard

    card = ModelCard.load(export(str(random_checkpoint), "ct2", str(tmp_path / "ct2")) / "README.md")
    assert not card.data.eval_results and "No scores" in card.text and "ctranslate2.Translator" in card.text
    assert "greedy translations of the probe sentences are ours, token for token" in card.text
    assert "logits" not in card.text and card.data.license == "other"
    snippet = card.text.split("```python\n")[1].split("```")[0]  # its usage code, run on the folder as it says
    download = f'folder = snapshot_download("{REPOSITORY}")  # or, for the folder itself: folder = "<its path>"'
    assert download in snippet
    namespace = {}
    snippet = snippet.replace(download, f'folder = "{tmp_path / "ct2"}"')
    snippet = snippet.replace("translate_batch(pieces,", "translate_batch(pieces, max_decoding_length=20,")  # random
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert len(namespace["results"]) == 1


@pytest.mark.slow
def test_make_attention_writes_pictures_whose_rows_are_distributions(random_checkpoint, tmp_path):
    out = tmp_path / "pictures"
    attention = [sys.executable, "-m", "transformer_mt.tools.attention_maps", str(random_checkpoint)]
    proc = subprocess.run(
        [*attention, "--text", 'the cat "sees", a dog .', "--out", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "translation:" in proc.stdout, proc.stderr
    names = ["encoder_self_attention", "decoder_self_attention", "encoder_decoder_attention", "alignment"]
    for name in names:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = np.load(out / "attention.npz")
    cfg = load_for_inference(random_checkpoint)[0].cfg
    S, T = len(saved["src_tokens"]), len(saved["tgt_out_tokens"])
    assert saved["src_tokens"][-1] == "</s>" and saved["tgt_in_tokens"][0] == "<s>"
    assert saved["encoder"].shape == (cfg.n_encoder_layers, cfg.n_heads, S, S)
    assert saved["decoder"].shape == (cfg.n_decoder_layers, cfg.n_heads, T, T)
    assert saved["cross"].shape == (cfg.n_decoder_layers, cfg.n_heads, T, S)
    for kind in ("encoder", "decoder", "cross"):
        np.testing.assert_allclose(saved[kind].sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(saved["decoder"], k=1) == 0)  # no step looks ahead
    # A file's line and its reference, instead of TEXT and the model's translation
    (tmp_path / "src.en").write_text("the dog runs .\nthe cat sees a dog .\n")
    (tmp_path / "ref.de").write_text("der Hund läuft .\ndie Katze sieht einen Hund .\n")
    from_file = [*attention, "--src", str(tmp_path / "src.en")]
    proc = subprocess.run(
        [*from_file, "--line", "2", "--ref", str(tmp_path / "ref.de"), "--out", str(tmp_path / "a")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "reference: die Katze sieht einen Hund ." in proc.stdout, proc.stderr
    tokens = np.load(tmp_path / "a" / "attention.npz")["src_tokens"][:-1]
    assert "".join(tokens).replace("▁", " ").strip() == "the cat sees a dog ."
    bad = subprocess.run([*from_file, "--line", "3"], capture_output=True, text=True)
    assert (
        bad.returncode == 1 and bad.stderr.strip() == f"error: LINE=3: {tmp_path / 'src.en'} has 2 lines (count from 1)"
    )


def test_a_model_with_every_switch_draws_attention_pictures(variant_run, tmp_path):
    out = draw(str(variant_run / "checkpoints" / "last.ckpt"), "the cat sees a dog .", None, 1, None, tmp_path, "cpu")
    weights = np.load(out / "attention.npz")
    assert weights["encoder"].shape[:2] == (2, 4)  # (layers, heads, ...)
    np.testing.assert_allclose(weights["cross"].sum(-1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------- learning curves


@pytest.mark.slow
def test_make_plot_draws_a_png_from_the_csv_metrics(tmp_path):
    metrics = tmp_path / "run" / "csv" / "version_0" / "metrics.csv"
    metrics.parent.mkdir(parents=True)
    rows = [{"step": s, "train/loss_window": 8 - s / 100, "lr-Adam": s * 1e-5} for s in range(0, 300, 50)]
    rows += [{"step": s, "val/loss": 7 - s / 100, "val/ppl": 900 / (1 + s), "val/bleu": s / 30} for s in (100, 200)]
    with open(metrics, "w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=["epoch", "step", "train/loss_window", "lr-Adam", "val/loss", "val/ppl", "val/bleu"]
        )
        writer.writeheader()
        writer.writerows(rows)
    series = read_metrics(tmp_path / "run")
    assert series["val/bleu"] == [(101, 100 / 30), (201, 200 / 30)]  # update = step + 1
    assert find(series, "lr-") == series["lr-Adam"] and len(series["train/loss_window"]) == 6
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_mt.tools.plot", str(tmp_path / "run")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    empty = subprocess.run(
        [sys.executable, "-m", "transformer_mt.tools.plot", str(tmp_path)], capture_output=True, text=True
    )
    assert empty.returncode == 1 and "no CSV metrics under" in empty.stderr


@pytest.mark.parametrize("logger", ["~logger", "logger=tensorboard"])
@pytest.mark.slow
def test_every_run_writes_csv_metrics_that_make_plot_draws(logger, tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    run_train(
        [f"data.path={corpus}", "trainer.max_steps=8", "trainer.log_every_n_steps=2", "progress_every_n_updates=3"]
        + [logger, "hydra.run.dir=run"],
        tmp_path,
    )
    series = read_metrics(tmp_path / "run")
    assert [update for update, _ in series["val/bleu"]] == [4, 8]  # validation every 4 updates (TINY_RUN)
    assert [update for update, _ in series["train/loss"]] == [2, 4, 6, 8] and len(series["lr-Adam"]) == 4
    # The training curve make plot draws: each progress line's mean loss (one line every 3 updates and after
    # each validation), at the update of its line, the same number as the run log's line.
    window = series["train/loss_window"]
    lines = [line for line in (tmp_path / "run" / "train.log").read_text().splitlines() if "| loss " in line]
    printed = [
        (int(line.split("update ")[1].split("/")[0]), float(line.split("| loss ")[1].split()[0])) for line in lines
    ]
    assert [update for update, _ in window] == [3, 4, 6, 8] == [update for update, _ in printed]
    assert [round(loss, 3) for _, loss in window] == [loss for _, loss in printed]
    assert find(series, "train/loss_window") == window
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_mt.tools.plot", str(tmp_path / "run"), "--out", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG", proc.stderr


class NotPlainData:
    pass


def test_benchmark_refuses_a_checkpoint_it_cannot_load_in_one_line(tmp_path, monkeypatch, capsys):
    """make bench CKPT=<a pickle that would run code>: one error line and status 1, as every command (no traceback)."""
    torch.save({"state_dict": {}, "payload": NotPlainData()}, tmp_path / "pickle.ckpt")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its neighbour host_overhead.py
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--ckpt", str(tmp_path / "pickle.ckpt"), "--parts", "plan"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(ROOT / "scripts" / "benchmark.py"), run_name="__main__")
    lines = capsys.readouterr().err.splitlines()
    assert stop.value.code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {tmp_path / 'pickle.ckpt'}: holds Python objects besides tensors")


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~12 fresh processes (each decoder at 1 and 2 threads) and 2 exports
def test_benchmark_prints_every_system_side_by_side(random_checkpoint, tmp_path):
    """Every peer's row, eager (--no-compile): the compiled rows time the same paths as trainer.compile and
    compile=true, each tested against eager by its own test (test_module, test_search); compiling them here
    too cost ~10 of the slow tier's minutes on 2 cores."""
    pytest.importorskip("transformers", reason='the export extra is not installed (pip install -e ".[export]")')
    pytest.importorskip("ctranslate2", reason='the export extra is not installed (pip install -e ".[export]")')
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("\n".join(SENTENCES[:3]) + "\n", encoding="utf-8")
    ref.write_text("die Katze .\nder Hund .\nzwei Hunde .\n", encoding="utf-8")
    command = [sys.executable, "scripts/benchmark.py", "--ckpt", str(random_checkpoint), "--src", str(src)]
    options = ["--shapes", "small", "--vocab", "400", "--max-tokens", "128", "--steps", "1", "--repeats", "1"]
    parts = ["--ref", str(ref), "--parts", "training,decoding,exports", "--alphas", "0,0.45", "--latency", "1"]
    out = subprocess.run(command + options + parts + ["--no-compile"], capture_output=True, text=True, check=True)
    training, decoding = out.stdout.split("\ndecoding ")
    decoding, exports = decoding.split("\nexports: ")
    for name in ("transformers fp32", "CTranslate2 fp32", "CTranslate2 int8"):
        rows = [line.split() for line in exports.splitlines() if line.startswith(name)]
        assert len(rows) == 3 and all(row[-2].endswith("%") for row in rows), exports  # beam 1; beam 4 at 0, 0.45
    assert sum(line.startswith("ours") for line in exports.splitlines()) == 3
    for name in ("transformer_mt", "transformers Marian", "torch.nn.Transformer"):
        assert sum(line[:24].rstrip() == name for line in training.splitlines()) == 1, training
    for name in ("transformer_mt", "engine=ct2", "transformers generate", "CTranslate2 float32", "CTranslate2 int8"):
        rows = [line.split() for line in decoding.splitlines() if line[:24].rstrip() == name]
        assert len(rows) == 2, decoding  # beam 4 and greedy
    assert "compiled" not in training + decoding  # --no-compile: no torch.compile row, in training or decoding
    # every decoder at 1 thread and at every core, each compared at its best
    assert all(f"sent/s {n}t" in decoding and f"latency {n}t" in decoding for n in {1, usable_cores()}), decoding
    ours = [line.split() for line in decoding.splitlines() if line[:24].rstrip() == "transformer_mt"]
    assert all("100.0%" in row for row in ours)  # ours is identical to itself
    measured = [line for line in decoding.splitlines() if line.startswith("  measured ")]  # each as it is measured
    assert len(measured) == 5 * len({1, usable_cores()}) and "sentences/s beam 4" in measured[0], decoding
    assert "matrix-multiply peak" in training and "GFLOP/s" in training


# ---------------------------------------------------------------- engine=ct2 (make translate / make evaluate)


@pytest.mark.slow
def test_engine_ct2_decodes_as_ours_in_a_process_without_torch_and_exports_once(sharp_checkpoint, tmp_path):
    pytest.importorskip("transformers", reason='the export extra is not installed (pip install -e ".[export]")')
    pytest.importorskip("ctranslate2", reason='the export extra is not installed (pip install -e ".[export]")')
    ckpt = tmp_path / "run" / "model.ckpt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(sharp_checkpoint.read_bytes())
    messages = []
    folder = ct2_export(ckpt, log=messages.append)
    assert folder == tmp_path / "run" / "model.ct2" and len(messages) == 1 and "exporting" in messages[0]
    lines = [*SENTENCES, "", "  the dog runs .  "]  # an empty line stays empty; lines are stripped
    greedy = dict(beam_size=1, max_len_a=0, max_len_b=25)  # the same limit for both: 25 tokens, then EOS

    def ours(path):
        model, tokenizer, _ = load_for_inference(path)
        return translate_lines(model, tokenizer, lines, **greedy)

    with CT2Process(folder, device="cpu", threads=1) as process:
        assert process.torch_imported is False and process.device == "cpu"
        got = process.translate_lines(lines, **greedy)
    assert got == ours(ckpt) and got[4] == "" and len(set(got)) == 5

    # Exported once: the same bytes reuse the folder.
    stamp = (folder / "model.bin").stat().st_mtime_ns
    messages.clear()
    assert ct2_export(ckpt, log=messages.append) == folder and messages == []
    assert (folder / "model.bin").stat().st_mtime_ns == stamp

    # New weights in the same file: exported again, and the translations are the new model's.
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["state_dict"] = {k: v.flip(0) if "ffn" in k else v for k, v in checkpoint["state_dict"].items()}
    write_checkpoint(checkpoint, ckpt)
    assert ct2_export(ckpt, log=messages.append) == folder and "exporting again" in messages[0]
    with CT2Process(folder, device="cpu", threads=1) as process:
        changed = process.translate_lines(lines, **greedy)
    assert changed == ours(ckpt) != got

    # An export cut short (checkpoint.json, written last, missing or unreadable) is made again.
    for cut_short in (lambda path: path.unlink(), lambda path: path.write_text('{"sha2')):
        cut_short(folder / "checkpoint.json")
        messages.clear()
        ct2_export(ckpt, log=messages.append)
        assert "exporting again" in messages[0] and (folder / "checkpoint.json").is_file()


@pytest.mark.slow
def test_engine_ct2_serves_a_pre_norm_model_with_our_greedy_translations(tokenizer, tmp_path):
    pytest.importorskip("ctranslate2", reason='the export extra is not installed (pip install -e ".[export]")')
    ckpt = write_random_checkpoint(tmp_path / "pre.ckpt", tokenizer, sharpen=4.0, norm="pre")
    greedy = dict(beam_size=1, max_len_a=0, max_len_b=25)
    model, tokenizer, _ = load_for_inference(ckpt)
    with CT2Process(ct2_export(ckpt, log=lambda message: None), device="cpu", threads=1) as process:
        got = process.translate_lines(SENTENCES, **greedy)
    assert got == translate_lines(model, tokenizer, SENTENCES, **greedy) and len(set(got)) == len(SENTENCES)


@pytest.mark.slow
def test_make_translate_and_evaluate_with_engine_ct2(sharp_checkpoint, tmp_path):
    pytest.importorskip("transformers", reason='the export extra is not installed (pip install -e ".[export]")')
    pytest.importorskip("ctranslate2", reason='the export extra is not installed (pip install -e ".[export]")')
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(sharp_checkpoint.read_bytes())
    text = "\n".join([*SENTENCES, "", "the cat ."]) + "\n"
    greedy = ["decoding=greedy", "decoding.max_len_a=0", "decoding.max_len_b=25", "threads=1"]

    def translate(*args):
        command = [sys.executable, "-m", "transformer_mt.translate", f"ckpt={ckpt}", *greedy, *args]
        return subprocess.run(command, input=text, capture_output=True, text=True)

    ours, theirs = translate(), translate("engine=ct2")
    assert ours.returncode == 0 == theirs.returncode, theirs.stderr
    assert theirs.stdout == ours.stdout and len(theirs.stdout.splitlines()) == 6  # stdout: translations only
    assert "exporting" in theirs.stderr and "engine ct2" in theirs.stderr
    nbest = translate("engine=ct2", "n_best=1")
    assert nbest.returncode == 1 and "error: n_best needs engine=torch" in nbest.stderr
    unknown = translate("engine=onnx")
    assert unknown.returncode == 1 and "error: engine=onnx: choose torch (ours) or ct2" in unknown.stderr

    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    ref.write_text("".join(line + "\n" for line in ours.stdout.splitlines()[:4]), encoding="utf-8")
    command = [sys.executable, "-m", "transformer_mt.evaluate", f"ckpt={ckpt}", f"src={src}", f"ref={ref}"]
    proc = subprocess.run(
        [*command, *greedy, "engine=ct2", f"hydra.run.dir={tmp_path / 'eval'}"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    scores = json.loads((tmp_path / "eval" / "scores.json").read_text())
    assert scores["engine"] == "ct2 float32" and scores["bleu"] == pytest.approx(100.0)


@pytest.mark.slow
def test_the_host_overhead_table_puts_our_trainer_beside_the_bare_loop():
    """make bench's host part (scripts/host_overhead.py): the operations of our Trainer's micro-batch are the
    bare loop's model, loss and backward plus the update's few host-side additions; per update it adds only
    what its bookkeeping launches (normalisation, norm, the one read), not an operation per parameter."""
    command = [sys.executable, "scripts/host_overhead.py", "--shapes", "base", "--updates", "4", "--no-compile"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = {line[7:24].strip(): line[24:].split() for line in out.splitlines() if line.startswith("base ")}
    assert set(rows) == {"bare loop", "Trainer eager"}, out
    (bare_mb, bare_update), (ours_mb, ours_update) = (
        [int(rows[s][i].replace(",", "")) for i in (0, 1)] for s in ("bare loop", "Trainer eager")
    )
    assert 2_000 < bare_mb <= ours_mb <= bare_mb + 20, out  # the model's ~2,450 at base's depth, plus `add`'s few
    assert ours_update <= bare_update + 30, out  # the parameters number 253: one op each would show
    assert rows["bare loop"][-1] == "1.00x" and rows["Trainer eager"][-1].endswith("x"), out


def test_a_pruned_checkpoint_takes_its_ct2_export_along(tmp_path):
    """keep_last prunes step<N>.ckpt (Lightning's ModelCheckpoint); engine=ct2's step<N>.ct2/ beside it goes too."""
    for name in ("step0000040", "step0000080"):
        (tmp_path / f"{name}.ckpt").write_bytes(b"weights")
        (tmp_path / f"{name}.ct2").mkdir()
        (tmp_path / f"{name}.ct2" / "model.bin").write_bytes(b"export")
    AtomicCheckpointIO().remove_checkpoint(tmp_path / "step0000040.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0000080.ckpt", "step0000080.ct2"]


@contextlib.contextmanager
def full_disk(bytes_per_file: int):
    """Every file write past `bytes_per_file` bytes fails, as on a full disk (RLIMIT_FSIZE: EFBIG, SIGXFSZ ignored)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (bytes_per_file, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("what", ["hf", "ct2", "make tune's record"])
def test_a_full_disk_while_exporting_or_writing_make_tunes_record_is_one_line_and_leaves_nothing(
    what, random_checkpoint, tmp_path, capsys
):
    """make export (transformers, CTranslate2) and make tune's record on a full disk: one `error:` line, status 1, and
    no folder or temporary left beside the checkpoint (issue 45, point 5)."""
    ckpt = tmp_path / "model.ckpt"
    shutil.copy(random_checkpoint, ckpt)  # before the disk fills
    if what == "make tune's record":
        rows = [{"beam_size": 4, "note": "x" * 5000}]  # a record longer than the disk's room
        write = partial(save_tuned, ckpt, PAPER, rows, "val")
    else:
        write = partial(export, str(ckpt), what, str(tmp_path / "out"))
    with full_disk(4096), pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(write)
    error = capsys.readouterr().err
    assert exit_info.value.code == 1 and error.startswith("error: a write was refused") and error.count("\n") == 1, (
        error
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]  # no export, no record, no temporary
