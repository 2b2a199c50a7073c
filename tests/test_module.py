"""training/module.py: the learning rate of update n follows Noam under accumulation, and trainer.compile's
compiled training step gives eager's loss and gradients and eager checkpoints."""

from unittest import mock

import lightning as L
import numpy as np
import pytest
import torch
import torch._inductor.config as inductor
from torch.utils.data import DataLoader

from conftest import MICRO_SHAPE, micro_batches, quiet_trainer, train_in_process, write_corpus
from transformer_mt.checkpoint import load_for_inference
from transformer_mt.configs import compose as compose_config
from transformer_mt.data.batching import TokenBucketSampler, collate
from transformer_mt.errors import InputError
from transformer_mt.objective import noam_lr
from transformer_mt.training.fit import check_config, compiles_training
from transformer_mt.training.module import TranslationModule


class RecordLR(L.Callback):
    def __init__(self):
        self.lrs, self.steps = [], []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])  # the rate this update uses
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_learning_rate_at_update_n_follows_noam_under_accumulation(accumulation):
    torch.manual_seed(0)
    module = TranslationModule(MICRO_SHAPE, warmup_steps=3, lr_factor=1.0, val_bleu_sentences=0)
    lengths = torch.randint(1, 8, (200,), generator=torch.Generator().manual_seed(0)).numpy()
    pairs = [(torch.randint(4, 20, (n,)).numpy(), torch.randint(4, 20, (n,)).numpy(), i) for i, n in enumerate(lengths)]
    loader = DataLoader(pairs, batch_sampler=TokenBucketSampler(lengths, lengths, max_tokens=40), collate_fn=collate)
    record = RecordLR()
    module.accumulation = accumulation
    trainer = quiet_trainer(max_steps=6, callbacks=[record], use_distributed_sampler=False)
    trainer.fit(module, loader)
    assert trainer.global_step == 6 and record.steps == list(range(6))  # 6 updates ...
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == 6 * accumulation  # ... of N batches
    expected = [noam_lr(n, MICRO_SHAPE["d_model"], 3) for n in range(1, 7)]  # update n uses noam(n)
    assert record.lrs == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow  # compiles (~1 min on 2 CPU cores)
def test_the_compiled_training_step_gives_eagers_loss_and_gradients_with_dropout():
    """torch.compile of the training forward and loss, dynamic shapes: two batches of different shapes
    (one graph for both), dropout 0.1. Inductor draws dropout's masks with its own generator; with
    fallback_random it draws eager's, so both paths can be compared value for value."""
    batches = micro_batches()[:2]  # 2 and 3 sentences of different lengths
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)  # the same weights
        module = TranslationModule(MICRO_SHAPE, val_bleu_sentences=0)
        if compiled:
            module.compile_training()
        step = []
        for i, batch in enumerate(batches):
            torch.manual_seed(100 + i)
            with mock.patch.object(inductor, "fallback_random", True):
                loss, nll, n = module._losses(batch, module._training_losses)
            module.zero_grad()
            loss.backward()
            step.append((loss.detach(), nll.detach(), {k: p.grad.clone() for k, p in module.named_parameters()}))
        results.append(step)
    for (eager_loss, eager_nll, eager_grads), (loss, nll, grads) in zip(*results, strict=True):
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(nll, eager_nll, rtol=1e-5, atol=1e-5)
        for name in eager_grads:
            torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def wmt14_like_batches(count: int, max_tokens: int = 800, seed: int = 0) -> list[dict]:
    """`count` batches as an epoch deals them: lengths like news text (lognormal, median ~25 tokens, the target
    ~1.1x the source, at most 128), token buckets of max_tokens per side, random ids."""
    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(np.log(25), 0.6, 20 * count), 1, 127).astype(int)
    tgt = np.clip(np.rint(src * rng.lognormal(0.1, 0.2, len(src))), 1, 127).astype(int)
    sampler = TokenBucketSampler(src, tgt, max_tokens, seed=seed)
    pairs = [
        (rng.integers(4, MICRO_SHAPE["vocab_size"], s), rng.integers(4, MICRO_SHAPE["vocab_size"], t))
        for s, t in zip(src, tgt)
    ]
    return [collate([(*pairs[i], i) for i in batch]) for batch in list(sampler)[:count]]


@pytest.mark.slow  # compiles an epoch of shapes (aot_eager: no code generated), ~30 s
def test_an_epoch_of_wmt14_like_batches_compiles_the_training_step_twice_not_per_shape():
    """trainer.compile's dynamic shapes: 60 batches of 30+ different (rows, source, target) shapes; dynamo
    specialises on nothing but whether source and target length are equal (duck sizing), so it compiles for at most
    2 batches (each a forward and a backward), not one per shape."""
    batches = wmt14_like_batches(60)
    shapes = {(b["src"].shape, b["tgt_in"].shape) for b in batches}
    assert len(shapes) > 30 and any(s[1] == t[1] for s, t in shapes) and any(s[1] != t[1] for s, t in shapes)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(len(batches_seen))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    torch.manual_seed(0)
    module = TranslationModule(MICRO_SHAPE, val_bleu_sentences=0)
    module.compile_training(backend=counting)
    batches_seen = []
    for batch in batches:
        batches_seen.append(batch)
        loss, _, _ = module._losses(batch, module._training_losses)
        loss.backward()
    # compiled at 2 batches at most (the first's trace may go to the backend twice), early, then reused for 50+ shapes;
    # before the fused loss lost its Python loop over the rows: 33 compiles in 60 batches (dynamo's limit is 8)
    assert len(set(graphs)) <= 2 and len(graphs) <= 4 and max(graphs) <= 10, graphs
    torch._dynamo.reset()


@pytest.mark.slow  # compiles
def test_a_compiled_run_trains_and_writes_eager_checkpoints(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    args = [f"data.path={corpus}", "trainer.compile=true", "trainer.max_steps=3", "checkpoint.every_n_train_steps=3"]
    args.append("final.enabled=false")  # the end decodes with the compiled decoder: compiled and tested in test_search
    train_in_process(args, tmp_path, tmp_path / "run")
    weights = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert weights and not [key for key in weights if "_orig_mod" in key]  # the keys of an eager run
    model, _, _ = load_for_inference(tmp_path / "run" / "checkpoints" / "step0000003.ckpt")  # every tool reads it
    assert sum(p.numel() for p in model.parameters()) > 0


def test_compile_is_a_switch_and_not_with_fsdp(tmp_path):
    with pytest.raises(InputError, match=r"trainer.compile='yes': must be true, false or auto"):
        check_config(compose_config("train", ["trainer.compile=yes"]))
    with pytest.raises(InputError, match="trainer.compile with trainer=fsdp is not supported"):
        check_config(compose_config("train", ["trainer=fsdp", "trainer.compile=true"]))
    check_config(compose_config("train", ["trainer=fsdp"]))  # auto: eager there, no refusal


@pytest.mark.parametrize(
    "overrides, cuda, compiled",
    [
        ([], False, False),  # the default on a CPU: eager (inductor's step measured slower there)
        ([], True, True),  # ... and compiled where a CUDA GPU trains
        (["trainer=gpu"], True, True),
        (["trainer=cpu"], True, False),  # a CPU run on a machine with a GPU
        (["trainer=fsdp"], True, False),  # not tested compiled
        (["trainer=ddp"], True, True),
        (["trainer.compile=true"], False, True),  # as given
        (["trainer=gpu", "trainer.compile=false"], True, False),
    ],
)
def test_compile_auto_compiles_where_a_cuda_gpu_trains(overrides, cuda, compiled, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    trainer = compose_config("train", overrides).trainer
    assert compiles_training(trainer, trainer.accelerator) is compiled
