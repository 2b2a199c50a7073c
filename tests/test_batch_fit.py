"""training/batch_fit.py: data.max_tokens=auto's probe finds the largest micro-batch that fits, the recipes
fit their batch to the GPU and keep the update, and a CPU keeps the fallback."""

import json
import logging
import math
import re
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import load, tiny_config, train_in_process, write_corpus
from transformer_mt.configs import compose as compose_config
from transformer_mt.data.batching import TokenBucketSampler
from transformer_mt.data.datamodule import TranslationDataModule
from transformer_mt.model import Transformer
from transformer_mt.training import batch_fit
from transformer_mt.training.batch_fit import MARGIN, FitBatch, fastest, largest_fitting

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


def test_a_cpu_takes_the_fastest_batch_per_token_and_a_smaller_one_only_when_clearly_faster():
    assert fastest({4096: 10.0, 2048: 9.8, 1024: 9.7}) == 4096  # within 5%: noise, the larger batch
    assert fastest({4096: 10.0, 2048: 6.0, 1024: 5.9}) == 2048  # 2,048 clearly faster; 1,024 not clearly so again
    assert fastest({4096: 10.0, 2048: 12.0, 1024: 5.0}) == 1024
    assert fastest({4096: 10.0}) == 4096


def auto_datamodule(tmp_path) -> TranslationDataModule:
    """A small text corpus's datamodule with data.max_tokens=auto (not yet built)."""
    corpus = write_corpus(tmp_path / "corpus")
    text_files = {"train": "train", "validation": "valid", "test": "test"}
    return TranslationDataModule(
        name="text",
        path=str(corpus),
        vocab_size=400,
        max_tokens="auto",
        text_files=text_files,
        cache_dir=str(tmp_path / "cache"),
    )


def test_the_cpu_probe_times_real_batches_and_leaves_the_run_as_it_was(tmp_path, caplog):
    """On the training split of a small corpus: each candidate (the fallback, its half and quarter, those that hold the
    longest pair) timed on the same sentences; the random generators and the gradients as before the probe."""
    datamodule = auto_datamodule(tmp_path)
    datamodule.build()
    module = SimpleNamespace(model=Transformer(tiny_config(vocab_size=len(datamodule.tokenizer))))
    state = torch.get_rng_state()
    with caplog.at_level(logging.INFO, logger="transformer_mt.training.batch_fit"):
        chosen = batch_fit.fastest_max_tokens(module, datamodule, "32-true", fallback=400)
    assert chosen in (400, 200, 100) and torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in module.model.parameters())
    line = re.search(
        r"data.max_tokens=auto on cpu: ([\d,]+) tokens per batch, .* by batch size: (.*); a smaller", caplog.text
    )
    assert line and int(line.group(1).replace(",", "")) == chosen
    # before it times anything, it says what (a silent 2 min 19 s on a busy 2-core machine once, issue 57)
    assert caplog.messages[0].startswith("data.max_tokens=auto on cpu: timing a training step on ")
    assert caplog.messages[0].endswith("at each batch size (400, 200, 100 tokens), 2 rounds after a warm-up")
    assert [size for size, _ in re.findall(r"([\d,]+): ([\d,]+)", line.group(2))] == ["400", "200", "100"]
    longest = datamodule.longest_training_pair()  # 22 tokens: a batch of 16 would leave pairs out; not tried
    assert batch_fit.fastest_max_tokens(module, datamodule, "32-true", fallback=4 * (longest - 1)) == 4 * (longest - 1)


def test_the_cpu_probes_choice_is_kept_per_cpu_model_and_precision_and_reused_by_later_starts(
    tmp_path, monkeypatch, caplog
):
    datamodule = auto_datamodule(tmp_path)
    datamodule.build()
    module = SimpleNamespace(model=Transformer(tiny_config(vocab_size=len(datamodule.tokenizer))))
    steps = mock.Mock(wraps=batch_fit.sequence_losses)
    monkeypatch.setattr(batch_fit, "sequence_losses", steps)
    chosen = batch_fit.fastest_max_tokens(module, datamodule, "32-true", fallback=200)
    measured = steps.call_count
    assert measured > 0 and json.loads((tmp_path / "cache" / batch_fit.PROBES).read_text()).popitem()[1] == chosen
    with caplog.at_level(logging.INFO, logger="transformer_mt.training.batch_fit"):
        assert batch_fit.fastest_max_tokens(module, datamodule, "32-true", fallback=200) == chosen  # a later start
    assert steps.call_count == measured  # nothing timed again, and it says so in one line
    assert caplog.messages == [
        f"data.max_tokens=auto on cpu: {chosen:,} tokens per batch, measured fastest on this CPU for this model and "
        f"precision at an earlier start (kept in {tmp_path / 'cache' / batch_fit.PROBES}; data.max_tokens=<tokens> "
        "skips the probe)"
    ]
    batch_fit.fastest_max_tokens(module, datamodule, "16-mixed", fallback=200)  # another precision: measured
    wider = SimpleNamespace(model=Transformer(tiny_config(vocab_size=len(datamodule.tokenizer), d_ff=96)))
    batch_fit.fastest_max_tokens(wider, datamodule, "32-true", fallback=200)  # another model's shape: measured
    assert steps.call_count == 3 * measured
    assert len(json.loads((tmp_path / "cache" / batch_fit.PROBES).read_text())) == 3


def test_the_cpu_probe_pads_no_batch_size_more_than_another(tmp_path):
    """The probe's sentences are of about one length, as in a bucket of the real sampler: its largest batch pads
    about as little as its smallest (a random sample padded the 4,096 batch to its longest sentence and made it look
    18% slower per token on the AVX2 machine, where training ran it as fast as 2,048)."""
    corpus = write_corpus(tmp_path / "corpus")
    datamodule = TranslationDataModule(
        name="text",
        path=str(corpus),
        vocab_size=400,
        max_tokens=400,
        text_files={"train": "train", "validation": "valid", "test": "test"},
        cache_dir=str(tmp_path / "cache"),
    )
    datamodule.build()
    split = datamodule.splits["train"]
    sample = batch_fit.probe_sentences(split, 400)
    assert split.tgt_lens[sample].sum() + len(sample) >= 400
    tgt, src = split.tgt_lens[sample], split.src_lens[sample]
    spread = (np.ptp(tgt), np.ptp(src))
    assert spread[0] < np.ptp(split.tgt_lens) and spread[1] < np.ptp(split.src_lens)

    def padding(size: int) -> float:  # the share of padded target positions
        batches = list(TokenBucketSampler(split.src_lens, split.tgt_lens, size, shuffle=False, indices=sample))
        slots = sum(len(b) * (split.tgt_lens[b].max() + 1) for b in batches)
        return 1 - (split.tgt_lens[sample].sum() + len(sample)) / slots

    assert padding(400) - padding(100) < 0.1
    random = np.random.default_rng(0).permutation(len(split))[: len(sample)]
    slots = len(random) * (split.tgt_lens[random].max() + 1)
    assert 1 - (split.tgt_lens[random].sum() + len(random)) / slots > padding(400) + 0.1  # what the probe avoids


def test_a_resumed_cpu_run_keeps_its_runs_choice_and_measures_nothing(monkeypatch, caplog):
    _, datamodule, trainer = recipe_setup("base", "cpu", 1, monkeypatch)
    monkeypatch.setattr(batch_fit, "fastest_max_tokens", lambda *args: pytest.fail("measured again"))
    with caplog.at_level(logging.INFO, logger="transformer_mt.training.batch_fit"):
        FitBatch(saved=2048).setup(trainer, trainer.lightning_module, "fit")
    assert datamodule.max_tokens == 2048 and trainer.lightning_module.accumulation == math.ceil(25_000 / 2048)
    assert "data.max_tokens=auto on cpu: 2,048 tokens per batch, as the run chose at its start" in caplog.text


def test_a_run_with_auto_batches_trains_with_the_probes_batch_and_the_configured_update(tmp_path, monkeypatch, caplog):
    """The probe's answer (stubbed, as on a CPU: 150 tokens) becomes data.max_tokens, the update keeps
    data.tokens_per_update (the accumulation follows from the batch found), and the checkpoints keep the choice."""
    probed = {}

    def probe(module, datamodule, precision, fallback):
        probed.update(fallback=fallback)
        return 150

    monkeypatch.setattr(batch_fit, "fastest_max_tokens", probe)
    corpus = write_corpus(tmp_path / "corpus")
    args = [
        f"data.path={corpus}",
        "data.max_tokens=auto",
        "data.max_tokens_fallback=300",
        "data.tokens_per_update=600",
        "trainer.max_steps=2",
    ]
    with caplog.at_level(logging.INFO):
        train_in_process(args, tmp_path, tmp_path / "run")
    assert probed == {"fallback": 300}
    assert "tokens per update: accumulation 4 x 150 tokens x 1 device(s) = 600 padded tokens" in caplog.text
    assert load(tmp_path / "run" / "checkpoints" / "last.ckpt")["max_tokens"] == 150


def recipe_setup(experiment: str, device: str, devices: int, monkeypatch, longest: int = 251):
    """experiment=base|big's data module and a Trainer's fields as FitBatch reads and sets them, on `devices`
    devices of type `device`; the longest training pair stubbed (max_len 250 + EOS: no corpus is read)."""
    cfg = compose_config("train", [f"experiment={experiment}"])
    datamodule = TranslationDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    monkeypatch.setattr(datamodule, "longest_training_pair", lambda: longest)
    trainer = SimpleNamespace(
        datamodule=datamodule,
        strategy=SimpleNamespace(root_device=torch.device(device)),
        precision="bf16-mixed",
        world_size=devices,
        is_global_zero=True,
        lightning_module=mock.Mock(accumulation=1),
        val_check_interval=cfg.trainer.val_check_interval,
    )
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
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (gpu_gib * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.setattr(batch_fit, "measure_step_bytes", lambda module, device, precision, n, length: step(n))
    monkeypatch.setattr(batch_fit, "least_over_ranks", lambda tokens, device: tokens)  # every rank found the same
    with caplog.at_level(logging.INFO, logger="transformer_mt.training.batch_fit"):
        FitBatch().setup(trainer, trainer.lightning_module, "fit")
    found = datamodule.max_tokens
    assert found == largest_fitting(step, gpu_gib * GiB, ceiling=2**20 // 251) * 251  # the probe's batch
    batch_tokens, accumulation = datamodule.update_shape(devices)
    assert trainer.lightning_module.accumulation == accumulation == math.ceil(25_000 / (found * devices))
    update = accumulation * batch_tokens * devices
    assert batch_tokens <= found and 25_000 <= update < 25_000 + accumulation * devices
    assert trainer.val_check_interval == 5_000 * accumulation  # still every 5,000 updates
    assert (accumulation == 1) == (found * devices >= 25_000)  # one micro-batch per update where it fits
    line = f"accumulation {accumulation} x {batch_tokens} tokens x {devices} device(s) = {update:,} padded tokens"
    assert line in caplog.text


@pytest.mark.parametrize(("experiment", "fallback"), [("base", 4096), ("big", 2048)])
def test_the_recipes_on_a_cpu_take_the_fastest_batch_and_keep_the_update(experiment, fallback, monkeypatch):
    """No CUDA memory to measure: the fastest per token of base's 4,096 or big's 2,048 (~2x base's memory per
    token) and their halves and quarters (the probe stubbed: half the fallback); the update holds
    data.tokens_per_update."""
    _, datamodule, trainer = recipe_setup(experiment, "cpu", 1, monkeypatch)
    probed = {}

    def probe(module, datamodule, precision, fallback):
        probed["fallback"] = fallback
        return fallback // 2

    monkeypatch.setattr(batch_fit, "fastest_max_tokens", probe)
    FitBatch().setup(trainer, trainer.lightning_module, "fit")
    assert probed["fallback"] == fallback and datamodule.max_tokens == fallback // 2
    accumulation = math.ceil(25_000 / (fallback // 2))  # base 13, big 25
    assert datamodule.update_shape(1) == (math.ceil(25_000 / accumulation), accumulation)
    assert trainer.lightning_module.accumulation == accumulation


# ---------------------------------------------------------------- trainer.compile
