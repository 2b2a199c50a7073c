"""Several processes on the CPU: the model under raw torch FSDP over gloo, and a torchrun-launched job.

The model under raw torch FSDP, 2 processes over gloo on the CPU (Lightning refuses strategy="fsdp"
on a CPU accelerator; torch's own FullyShardedDataParallel runs there with world size 2, where it
really shards: with one process it silently becomes NO_SHARD). Each process wraps the model as
trainer=fsdp does (one FSDP unit per encoder/decoder layer, the rest in the root unit)."""

import os
import socket
import subprocess
import sys

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader

from conftest import random_batch, tiny_config, train_overrides
from transformer_mt.data.batching import collate
from transformer_mt.model import DecoderLayer, EncoderLayer, Transformer, TransformerConfig
from transformer_mt.objective import sequence_losses
from transformer_mt.search import greedy
from transformer_mt.training.module import TranslationModule, gradient_norm

pytestmark = pytest.mark.slow  # processes

WORLD = 2


class Step(torch.nn.Module):
    """What Lightning's FSDP wrapper runs inside the root unit's forward: the loss, or greedy decoding."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, src, tgt_in=None, tgt_out=None):
        if tgt_in is None:
            return greedy(self.model, src, max_len_b=6)
        loss_sum, _, n_tokens = sequence_losses(self.model, src, tgt_in, tgt_out, 0.1)
        return loss_sum / n_tokens


def batch():
    src = random_batch([7, 5, 6, 3], 23, seed=1)
    tgt = random_batch([5, 6, 2, 4], 23, seed=2)
    tgt_in = torch.cat([torch.full((4, 1), 2), tgt[:, :-1]], 1).masked_fill(tgt.eq(0), 0)
    return src, tgt_in, tgt


def fresh_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_config(dropout=0.0))


def sharded_step(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        fsdp = FSDP(
            Step(fresh_model()),
            auto_wrap_policy=ModuleWrapPolicy({EncoderLayer, DecoderLayer}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        local = sum(p.numel() for p in fsdp.parameters())  # outside forward: this rank's shards only
        src, tgt_in, tgt_out = batch()
        rows = slice(2 * rank, 2 * rank + 2)  # each rank its half of the batch
        loss = fsdp(src[rows], tgt_in[rows], tgt_out[rows])
        loss.backward()  # FSDP averages the gradients of the ranks
        with FSDP.summon_full_params(fsdp, with_grads=True):
            grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in fsdp.named_parameters()}
        grad_norm = gradient_norm(fsdp.parameters(), sharded=True).item()  # outside summon: this rank's shards
        decoded = fsdp(src)  # every rank decodes the same sentences: the same number of gathers
        results[rank] = {
            "loss": loss.item(),
            "grads": grads,
            "decoded": decoded,
            "grad_norm": grad_norm,
            "local": local,
        }
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_on_two_processes_gives_one_process_loss_gradients_norm_and_translations():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(sharded_step, args=(free_port(), results), nprocs=WORLD, join=True)
        results = dict(results)
    # Really sharded: each rank holds about half of the weights.
    full = sum(p.numel() for p in fresh_model().parameters())
    assert all(abs(results[rank]["local"] - full / WORLD) <= WORLD * 16 for rank in range(WORLD)), (
        [r["local"] for r in results.values()],
        full,
    )
    # The same step without FSDP: the mean of the two halves' per-token losses.
    step = Step(fresh_model())
    src, tgt_in, tgt_out = batch()
    losses = [step(src[r : r + 2], tgt_in[r : r + 2], tgt_out[r : r + 2]) for r in (0, 2)]
    (sum(losses) / WORLD).backward()
    for rank in range(WORLD):
        assert results[rank]["loss"] == pytest.approx(losses[rank].item(), abs=1e-5)
        for name, param in step.named_parameters():
            torch.testing.assert_close(results[rank]["grads"][name], param.grad, atol=1e-6, rtol=1e-4, msg=name)
        assert results[rank]["decoded"] == step.eval()(src)
        # The gradient norm of the whole model on every rank, not of its shard (train/grad_norm, the NaN stop)
        assert results[rank]["grad_norm"] == pytest.approx(gradient_norm(step.parameters(), sharded=False).item())


# ---------------------------------------------------------------- launchers: torchrun on 2 CPU processes


def test_torchrun_job_has_one_run_folder_one_data_build_and_continues_when_restarted(corpus, tmp_path):
    """torchrun starts every rank before the Trainer exists: rank 0 builds the data while rank 1 waits for
    its caches; both ranks resolve one run folder (the job's rendezvous id), and the same job started
    again continues from its newest checkpoint without ckpt_path."""
    flags, overrides = train_overrides(
        [f"data.path={corpus}", "trainer.strategy=ddp", "trainer.devices=2", "checkpoint.every_n_train_steps=3"],
        tmp_path,
    )
    rendezvous = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=job42"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node=2"]
    outputs = []
    for steps in (6, 8):
        proc = subprocess.run(
            [*torchrun, "-m", "transformer_mt.train", *overrides, f"trainer.max_steps={steps}"],
            capture_output=True,
            text=True,
            timeout=280,
            cwd=tmp_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outputs.append(proc.stdout + proc.stderr)
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["torchrun-job42"]  # one folder for both ranks
    run = tmp_path / "outputs" / "torchrun-job42"
    log = (run / "train.log").read_text()
    assert log.count("text train: 400 pairs tokenized") == 1  # rank 0 built the data, once
    assert outputs[0].count("rank 1: reading the data caches that rank 0 builds") == 1  # ... rank 1 did not
    assert "torchrun-job42 restarted: continuing from the newest checkpoint" in outputs[1]
    assert "resuming from" in outputs[1] and "(update 6)" in outputs[1]
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 8


# ---------------------------------------------------------------- DDP: the update's gradient over ranks


class SaveGradients(TranslationModule):
    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # normalises the update's gradient over micro-batches and ranks
        grads = {name: p.grad.clone() for name, p in self.named_parameters()}
        torch.save(grads, f"{self.trainer.default_root_dir}/grads-{self.global_rank}.pt")


def test_ddp_update_over_ranks_and_micro_batches_has_the_gradient_of_one_batch_of_its_sentences(tmp_path):
    """2 ranks x 2 micro-batches of different sizes: every target token weighs the same, as in one batch."""
    model_cfg = dict(vocab_size=20, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    lengths = [9, 2, 3, 4, 2, 5, 1, 6, 7, 3]
    items = [
        (torch.randint(4, 20, (n,), generator=g).numpy(), torch.randint(4, 20, (n + 2,), generator=g).numpy(), i)
        for i, n in enumerate(lengths)
    ]
    # DistributedSampler deals micro-batches round-robin: rank 0 gets 0 and 2, rank 1 gets 1 and 3
    micro_batches = [collate(items[:1]), collate(items[1:3]), collate(items[3:8]), collate(items[8:])]
    torch.manual_seed(0)
    module = SaveGradients(model_cfg, val_bleu_sentences=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp_spawn",
        max_steps=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, DataLoader(micro_batches, batch_size=None))
    torch.manual_seed(0)
    reference = Transformer(TransformerConfig(**model_cfg))
    whole = collate(items)
    loss_sum, _, n_tokens = sequence_losses(reference, whole["src"], whole["tgt_in"], whole["tgt_out"], 0.1)
    (loss_sum / n_tokens).backward()
    for rank in range(WORLD):
        grads = torch.load(tmp_path / f"grads-{rank}.pt", weights_only=True)
        for name, param in reference.named_parameters():
            torch.testing.assert_close(grads[f"model.{name}"], param.grad, atol=1e-6, rtol=1e-5, msg=name)
