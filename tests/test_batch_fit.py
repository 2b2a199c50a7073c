"""training/batch_fit.py: data.max_tokens=auto's probe finds the largest micro-batch that fits, the recipes
fit their batch to the GPU and keep the update, and a CPU keeps the fallback."""

import logging
import math
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

from conftest import train_in_process, write_corpus
from transformer_mt.configs import compose as compose_config
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.training import batch_fit
from transformer_mt.training.batch_fit import MARGIN, FitBatch, fit_max_tokens, largest_fitting

GiB = 2**30


def memory_model(length: int, fixed: int = 3 * GiB, per_token: int = 200_000, per_pair: int = 1_500):
    """Bytes of a training step on n sentences of `length` tokens: weights and optimizer, activations per
    token, attention scores per query-key pair (the square of the length)."""
    return lambda n: fixed + n * length * per_token + n * length**2 * per_pair


@pytest.mark.parametrize("length", [10, 64, 250])
def test_the_probe_finds_the_most_sentences_whose_step_fits_the_budget_less_the_margin(length):
    step, budget = memory_model(length), 80 * GiB
    n = largest_fitting(step, budget, ceiling=10**6)
    assert step(n) <= budget * (1 - MARGIN) < step(n + 1)  # the largest, by the formula
    assert largest_fitting(step, budget, ceiling=n // 3) == n // 3  # never past the ceiling


def test_an_out_of_memory_step_does_not_fit_and_no_fitting_sentence_is_zero():
    def step(n):
        if n > 37:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return n

    assert largest_fitting(step, budget=10**9, ceiling=1000) == 37
    assert largest_fitting(memory_model(250), budget=1 * GiB, ceiling=1000) == 0  # the weights alone exceed it


def test_auto_on_a_cpu_keeps_the_fallback_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="transformer_mt.training.batch_fit"):
        assert fit_max_tokens(None, torch.device("cpu"), "32-true", longest=50) == 4096
        assert fit_max_tokens(None, torch.device("cpu"), "32-true", longest=50, fallback=2048) == 2048
    assert (
        "data.max_tokens=auto on cpu: 4,096 (data.max_tokens_fallback; the probe measures CUDA memory)" in caplog.text
    )
    assert "data.max_tokens=auto on cpu: 2,048" in caplog.text


def test_a_run_with_auto_batches_trains_with_the_probes_batch_and_the_configured_update(tmp_path, monkeypatch, caplog):
    """The probe's answer (stubbed: this machine has no CUDA memory to measure) becomes data.max_tokens,
    and the update keeps data.tokens_per_update: the accumulation follows from the batch found."""
    probed = {}

    def probe(module, device, precision, longest, fallback):
        probed.update(longest=longest, device=device.type)
        return 3 * longest  # three sentences of the longest pair

    monkeypatch.setattr(batch_fit, "fit_max_tokens", probe)
    corpus = write_corpus(tmp_path / "corpus")
    args = [f"data.path={corpus}", "data.max_tokens=auto", "data.tokens_per_update=600", "trainer.max_steps=2"]
    with caplog.at_level(logging.INFO):
        train_in_process(args, tmp_path, tmp_path / "run")
    longest = probed["longest"]
    accumulation = math.ceil(600 / (3 * longest))
    assert (
        f"data.max_tokens=auto: {3 * longest:,} tokens per batch and device (3 sentences of {longest} tokens"
        in caplog.text
    )
    assert (
        f"tokens per update: accumulation {accumulation} x {math.ceil(600 / accumulation)} tokens x 1 device(s)"
        in caplog.text
    )
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def recipe_setup(experiment: str, device: str, devices: int, monkeypatch, longest: int = 251):
    """experiment=base|big's data module and a Trainer's fields as FitBatch reads and sets them, on `devices`
    devices of type `device`; the longest training pair stubbed (max_len 250 + EOS: no corpus is read)."""
    cfg = compose_config("train", [f"experiment={experiment}"])
    datamodule = TranslationDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    monkeypatch.setattr(datamodule, "longest_training_pair", lambda: longest)
    trainer = SimpleNamespace(
        datamodule=datamodule, strategy=SimpleNamespace(root_device=torch.device(device)), precision="bf16-mixed",
        world_size=devices, is_global_zero=True, accumulate_grad_batches=1,
        val_check_interval=cfg.trainer.val_check_interval,
    )  # fmt: skip
    return cfg, datamodule, trainer


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("gpu_gib", [16, 141])
@pytest.mark.parametrize("experiment", ["base", "big"])
def test_the_recipes_fit_their_batch_to_the_gpu_and_keep_the_update(experiment, gpu_gib, devices, monkeypatch, caplog):
    """experiment=base|big on CUDA: data.max_tokens=auto takes the probe's batch (its memory stubbed: a model of
    the step's bytes, big's activations twice base's per token), and the update's shape, accumulation x batch
    tokens x devices, still holds data.tokens_per_update: one micro-batch where it fits, on 1 GPU as on 8."""
    cfg, datamodule, trainer = recipe_setup(experiment, "cuda", devices, monkeypatch)
    assert cfg.data.max_tokens == "auto" and cfg.data.tokens_per_update == 25_000
    step = memory_model(251, per_token=200_000 * cfg.model.d_model // 512)
    monkeypatch.setattr(batch_fit, "device_memory_budget", lambda device: gpu_gib * GiB)
    monkeypatch.setattr(batch_fit, "measure_step_bytes", lambda module, device, precision, n, length: step(n))
    monkeypatch.setattr(batch_fit, "least_over_ranks", lambda tokens, device: tokens)  # every rank found the same
    with caplog.at_level(logging.INFO, logger="transformer_mt.training.batch_fit"):
        FitBatch().setup(trainer, mock.Mock(), "fit")
    found = datamodule.max_tokens
    assert found == largest_fitting(step, gpu_gib * GiB, ceiling=2**20 // 251) * 251  # the probe's batch
    batch_tokens, accumulation = datamodule.update_shape(devices)
    assert trainer.accumulate_grad_batches == accumulation == math.ceil(25_000 / (found * devices))
    update = accumulation * batch_tokens * devices
    assert batch_tokens <= found and 25_000 <= update < 25_000 + accumulation * devices
    assert trainer.val_check_interval == 5_000 * accumulation  # still every 5,000 updates
    assert (accumulation == 1) == (found * devices >= 25_000)  # one micro-batch per update where it fits
    line = f"accumulation {accumulation} x {batch_tokens} tokens x {devices} device(s) = {update:,} padded tokens"
    assert line in caplog.text


@pytest.mark.parametrize(("experiment", "fallback"), [("base", 4096), ("big", 2048)])
def test_the_recipes_on_a_cpu_keep_their_batch(experiment, fallback, monkeypatch, caplog):
    """No CUDA memory to measure: base batches 4,096 tokens, big 2,048 (~2x base's memory per token), as
    before the recipes took auto; the update holds data.tokens_per_update."""
    _, datamodule, trainer = recipe_setup(experiment, "cpu", 1, monkeypatch)
    with caplog.at_level(logging.INFO, logger="transformer_mt.training.batch_fit"):
        FitBatch().setup(trainer, None, "fit")
    assert datamodule.max_tokens == fallback
    accumulation = math.ceil(25_000 / fallback)  # base 7, big 13
    assert datamodule.update_shape(1) == (math.ceil(25_000 / accumulation), accumulation)
    assert trainer.accumulate_grad_batches == accumulation
    assert f"data.max_tokens=auto on cpu: {fallback:,} (data.max_tokens_fallback" in caplog.text


# ---------------------------------------------------------------- trainer.compile
