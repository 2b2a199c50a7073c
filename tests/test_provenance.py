"""Every run knows the code that made it, and one folder holds one run (issue 63, points 1 and 2)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml

from conftest import ROOT, hydra_task, train_in_process
from transformer_mt import runtime
from transformer_mt.checkpoint import load_for_inference
from transformer_mt.errors import InputError, exit_on_user_error
from transformer_mt.evaluate import evaluate


def git(folder, *args: str) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, check=True).stdout.strip()


def test_the_code_record_names_the_commit_the_dirty_tree_or_a_copy_outside_git(tmp_path, monkeypatch):
    package = tmp_path / "repo" / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    monkeypatch.setattr(runtime, "__file__", str(package / "runtime.py"))  # the record of a package lying there

    outside = runtime.code_record()
    assert outside["commit"] == "not a git checkout" and outside["dirty"] is None
    assert outside["source"] == str(package) and outside["torch"] == torch.__version__
    git(tmp_path / "repo", "init", "-q")
    assert runtime.code_record()["commit"] == "not a git checkout"  # untracked: an installed copy inside a checkout
    git(tmp_path / "repo", "add", ".")
    git(tmp_path / "repo", "commit", "-q", "-m", "one")
    clean = runtime.code_record()
    assert clean["commit"] == git(tmp_path / "repo", "rev-parse", "HEAD") and clean["dirty"] is False
    (package / "__init__.py").write_text("x = 2\n")
    assert runtime.code_record()["dirty"] is True
    assert runtime.code_record()["commit"] == clean["commit"]


def test_results_json_the_runs_record_its_checkpoints_and_scores_json_hold_the_code_that_trained(variant_run, tmp_path):
    expected = runtime.code_record()
    if (ROOT / ".git").exists():
        assert expected["commit"] == git(ROOT, "rev-parse", "HEAD")
    results = json.loads((variant_run / "results.json").read_text())
    record = yaml.safe_load((variant_run / ".hydra" / "code.yaml").read_text())
    checkpoint = torch.load(variant_run / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
    for code in (results["code"], record, checkpoint["hyper_parameters"]["config"]["code"]):
        assert {k: code[k] for k in ("commit", "source", "torch")} == {
            k: expected[k] for k in ("commit", "source", "torch")
        }
    scores = evaluate(hydra_task("evaluate", [f"ckpt={variant_run / 'checkpoints' / 'last.ckpt'}"], tmp_path))
    assert scores["code"] == results["code"]
    assert json.loads((tmp_path / "scores.json").read_text())["code"] == results["code"]


def test_a_second_plain_training_into_a_finished_runs_folder_is_refused_in_one_line_and_changes_no_file(
    trained_run, tmp_path, capsys
):
    run = trained_run / "out"
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    args = [f"data.path={trained_run / 'corpus'}", "trainer.max_steps=2"]
    with pytest.raises(SystemExit) as stop:
        exit_on_user_error(train_in_process, args, tmp_path, run)
    assert stop.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [
        f"error: {run} holds another run's checkpoints: continue it with ckpt_path=last hydra.run.dir={run}, or start "
        "this one in a new folder (another hydra.run.dir, or none: outputs/<date>/<time>)"
    ]
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before


def test_a_checkpoint_from_a_newer_version_with_an_unknown_model_setting_is_refused_in_one_line(trained_run, tmp_path):
    """A newer version's switch (a researcher's attention bias) in an older one's hands: one line naming the settings
    and the commit that wrote it, from every tool that reads checkpoints (a TypeError traceback before issue 63)."""
    checkpoint = torch.load(trained_run / "out" / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["model"]["attention_bias"] = True
    checkpoint["hyper_parameters"]["config"]["code"] = {"commit": "abc123"}
    torch.save(checkpoint, tmp_path / "newer.ckpt")
    with pytest.raises(InputError) as error:
        load_for_inference(tmp_path / "newer.ckpt")
    assert str(error.value) == (
        f"{tmp_path / 'newer.ckpt'}: its model has settings this version does not know (attention_bias): a newer "
        "transformer_mt wrote it (its commit: abc123); read it with that version"
    )
