"""What makes training fast, checked for correctness (not speed; scripts/benchmark.py measures that):
data.max_tokens=auto's probe (training/batch_fit.py) and trainer.compile."""

import logging
import math

import pytest
import torch

from conftest import train_in_process, write_corpus
from transformer_mt.training import batch_fit
from transformer_mt.training.batch_fit import MARGIN, fit_max_tokens, largest_fitting

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


def test_auto_on_a_cpu_keeps_the_default_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="transformer_mt.training.batch_fit"):
        assert fit_max_tokens(None, torch.device("cpu"), "32-true", longest=50) == 4096
    assert "data.max_tokens=auto on cpu: 4096" in caplog.text


def test_a_run_with_auto_batches_trains_with_the_probes_batch_and_the_configured_update(tmp_path, monkeypatch, caplog):
    """The probe's answer (stubbed: this machine has no CUDA memory to measure) becomes data.max_tokens,
    and the update keeps data.tokens_per_update: the accumulation follows from the batch found."""
    probed = {}

    def probe(module, device, precision, longest):
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
