"""Several processes on the CPU over gloo: FSDP (torch's fully_shard as trainer=fsdp applies it, and
trainer=fsdp through Lightning), DDP, and jobs launched by torchrun and by a SLURM-like environment.

FSDP really shards only with 2 or more processes. trainer=fsdp's strategy class (training/sharding.py)
runs on CPU processes over gloo, so the tests below train with exactly what a GPU run uses, NCCL and
CUDA aside. Each process shards the model as trainer=fsdp does (sharding.shard: one FSDP2 unit per
encoder/decoder layer, the rest in the root unit, the Transformer)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from conftest import (
    ROOT,
    TINY_SHAPE,
    csv_rows,
    free_port,
    hydra_task,
    quiet_trainer,
    random_batch,
    run_process,
    run_train,
    tiny_config,
    train_overrides,
)
from device_waits import WAITS_RUN, Waits, summary
from transformer_mt.averaging import average_run
from transformer_mt.checkpoint import load_for_inference
from transformer_mt.data.batching import collate
from transformer_mt.evaluate import evaluate
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.objective import sequence_losses
from transformer_mt.search import greedy, translate_lines
from transformer_mt.tools.export import export
from transformer_mt.training.module import TranslationModule
from transformer_mt.training.sharding import full_copy, mixed_precision_policy, shard
from transformer_mt.training.update import gradient_norm

pytestmark = pytest.mark.slow  # processes

WORLD = 2


class Step(torch.nn.Module):
    """What the training step runs (the loss), or validation (greedy decoding)."""

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
        model = fresh_model()
        shard(model, "cpu", WORLD, policy=None)  # as trainer=fsdp does, in fp32
        local_size = sum(p.to_local().numel() for p in model.parameters())  # this rank's shards only
        src, tgt_in, tgt_out = batch()
        rows = slice(2 * rank, 2 * rank + 2)  # each rank its half of the batch
        loss = Step(model)(src[rows], tgt_in[rows], tgt_out[rows])
        loss.backward()  # FSDP averages the gradients of the ranks
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        grad_norm = gradient_norm(model.parameters()).item()  # this rank's shards, then reduced
        decoded = Step(full_copy(model)).eval()(src)  # what validation decodes with
        # Accumulation (LayerFSDP.block_backward_sync): a micro-batch without gradient sync reduces nothing; the
        # next one reduces the sum of both. Each rank takes its half, then the other half.
        model = fresh_model()
        shard(model, "cpu", WORLD, policy=None)
        model.set_requires_gradient_sync(False)
        Step(model)(src[rows], tgt_in[rows], tgt_out[rows]).backward()
        model.set_requires_gradient_sync(True)
        unreduced = [n for n, p in model.named_parameters() if p.grad is None]
        other = slice(2 - 2 * rank, 4 - 2 * rank)
        Step(model)(src[other], tgt_in[other], tgt_out[other]).backward()
        accumulated = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        # trainer=fsdp in bf16 on a CPU (under autocast, as Lightning's bf16-mixed runs it): weights gathered in bf16,
        # the shards and their reduced gradients fp32; the layers' inputs cast to bf16 (CPU autocast's LayerNorm needs
        # it; on CUDA they stay fp32 as DDP's: test_cuda.py).
        model = fresh_model()
        shard(model, "cpu", WORLD, mixed_precision_policy("bf16-mixed", "cpu"))
        inputs, gathered = set(), set()

        def record(module, args, kwargs):  # after FSDP's own pre-forward hook: the layer's weights are gathered
            inputs.update(t.dtype for t in [*args, *kwargs.values()] if torch.is_tensor(t) and t.is_floating_point())
            gathered.update(p.dtype for p in module.parameters())

        for layer in [*model.encoder_layers, *model.decoder_layers]:
            layer.register_forward_pre_hook(record, with_kwargs=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            Step(model)(src[rows], tgt_in[rows], tgt_out[rows]).backward()
        dtypes = {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters()}
        results[rank] = {
            "accumulation": (unreduced, accumulated),
            "loss": loss.item(),
            "grads": grads,
            "decoded": decoded,
            "grad_norm": grad_norm,
            "local": local_size,
            "bf16": (inputs, gathered, dtypes),
        }
    finally:
        dist.destroy_process_group()


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
        for name, param in step.model.named_parameters():
            torch.testing.assert_close(results[rank]["grads"][name], param.grad, atol=1e-6, rtol=1e-4, msg=name)
        assert results[rank]["decoded"] == step.eval()(src)
        # The gradient norm of the whole model on every rank, not of its shard (train/grad_norm, the NaN stop)
        assert results[rank]["grad_norm"] == pytest.approx(gradient_norm(step.parameters()).item())
        assert results[rank]["bf16"] == ({torch.bfloat16}, {torch.bfloat16}, {torch.float32})
    # Accumulated without sync, then synced: nothing reduced after the first micro-batch, then the mean over the
    # ranks of each rank's two halves: the gradient of the sum of both halves' losses.
    step = Step(fresh_model())
    sum(step(src[r : r + 2], tgt_in[r : r + 2], tgt_out[r : r + 2]) for r in (0, 2)).backward()
    for rank in range(WORLD):
        unreduced, accumulated = results[rank]["accumulation"]
        assert len(unreduced) == len(list(step.parameters())), unreduced  # no parameter got a reduced gradient
        for name, param in step.model.named_parameters():
            torch.testing.assert_close(accumulated[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)


# ---------------------------------------------------------------- launchers: torchrun and srun, 2 CPU processes


def srun_like(command: list[str], cwd, port: int) -> str:
    """What srun does for `srun --ntasks=2 --ntasks-per-node=2 <command>` in job 4242 on one node: both
    tasks started at once, SLURM's variables set per task. Lightning's SLURMEnvironment reads them."""
    common = dict(
        SLURM_JOB_ID="4242",
        SLURM_STEP_ID="0",
        SLURM_JOB_NAME="train",  # not bash/interactive, which Lightning would take for an salloc shell
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_NODELIST="127.0.0.1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    tasks = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env={**os.environ, **common, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            start_new_session=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for task in tasks:
            outputs.append(task.communicate(timeout=280)[0])
    finally:
        for task in tasks:
            if task.poll() is None:
                os.killpg(task.pid, 9)
    assert [t.returncode for t in tasks] == [0] * WORLD, "\n".join(o[-3000:] for o in outputs)
    return "".join(outputs)


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_launched_job_has_one_run_folder_one_data_build_and_continues_when_restarted(launcher, corpus, tmp_path):
    """torchrun and srun start every rank before the Trainer exists: rank 0 builds the data while rank 1
    waits for its caches; both ranks resolve one run folder (the job's rendezvous id, or SLURM's job and
    step), and the same job started again (torchrun --max-restarts, a SLURM requeue) continues from its
    newest checkpoint without ckpt_path."""
    flags, overrides = train_overrides(
        [f"data.path={corpus}", "trainer.strategy=ddp", "trainer.devices=2", "checkpoint.every_n_train_steps=3"]
        + ["final.enabled=true", "final.average_last=2", "decoding.max_len_b=10"],  # the end of run: rank 0 only
        tmp_path,
    )
    # tests/kill_at.py after-rank-1: rank 0's protocol waits (bounded) for rank 1's exit and says whether it came
    train = [sys.executable, str(Path(__file__).parent / "kill_at.py"), "after-rank-1:0", *overrides]
    rendezvous = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=job42"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node=2", *train[1:]]
    outputs = []
    for steps in (6, 8):
        (tmp_path / "rank-1.pid").unlink(missing_ok=True)
        if launcher == "torchrun":
            proc = run_process([*torchrun, f"trainer.max_steps={steps}"], tmp_path)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            outputs.append(proc.stdout + proc.stderr)
        else:
            outputs.append(srun_like([*train, f"trainer.max_steps={steps}"], tmp_path, free_port()))
    # Every rank's process group went with its Trainer, before the exit (runtime.end_process_group).
    assert not [o for o in outputs if "the process group outlived the run" in o]
    folder = {"torchrun": "torchrun-job42", "srun": "slurm-4242-0"}[launcher]
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [folder]  # one folder for both ranks
    run = tmp_path / "outputs" / folder
    log = (run / "train.log").read_text()
    assert log.count("text train: 400 pairs tokenized") == 1  # rank 0 built the data, once
    assert outputs[0].count("rank 1: reading the data caches that rank 0 builds") == 1  # ... rank 1 did not
    assert log.count("validation at update 4:") == 1  # one train.log, written by rank 0 alone
    assert f"{folder} restarted: continuing from the newest checkpoint" in outputs[1]
    assert "resuming from" in outputs[1] and "(update 6)" in outputs[1]
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 8
    # Each start ended with the protocol, on rank 0 alone: one results block per start, the last one's results.json.
    # Rank 1 did not wait for it: it had exited before rank 0's protocol began (it waits at no barrier).
    assert log.count("results (") == 2 and log.count("the end of the run on rank 0 alone") == 2
    assert [o.count("rank 0's protocol starts; rank 1 has exited") for o in outputs] == [1, 1], outputs[-1][-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["updates"] == 8 and list(results["models"]) == ["average-last2"]  # steps 3 and 6
    assert results["models"]["average-last2"]["test"]["sentences"] == 30


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_whose_peer_died_says_so_in_one_line(strategy, corpus, tmp_path):
    """Rank 0 SIGKILLed after update 2 (a node lost, the OOM killer): rank 1's next collective fails, and it says so
    in one line naming the way on, without gloo's ~108-line traceback (before issue 63)."""
    run = tmp_path / "run"
    args = [f"data.path={corpus}", f"trainer.strategy={strategy}", "trainer.devices=2", f"hydra.run.dir={run}"]
    kill_at = (str(ROOT / "tests" / "kill_at.py"), "rank-0-dies:2")
    proc = run_train([*args, "checkpoint.every_n_train_steps=1"], tmp_path, check=False, entry=kill_at)
    assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]  # rank 0; rank 1's output is there too
    said = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and said[0].startswith("error: rank 1: another rank's process ended ("), proc.stderr[-3000:]
    way_on = f"The newest checkpoint holds the run: continue it with ckpt_path=last hydra.run.dir={run}"
    assert said[0].endswith(f"this one stops too. {way_on}")
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


def test_a_ddp_run_waits_for_the_device_once_per_update_on_every_rank(corpus, tmp_path):
    """test_module's whole-run rule under torchrun and Lightning's DDP on 2 processes: each update waits
    once on every rank, its one all-reduce carrying the tokens, loss sums, stop signals and the clock of
    time-based checkpoints and of the time budget (trainer.max_time, as a cluster run sets it: no Lightning Timer
    and its broadcast per micro-batch, no broadcast of its own, no per-batch SIGTERM check)."""
    _, overrides = train_overrides(
        [f"data.path={corpus}", "trainer.strategy=ddp", "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"]
        + ["trainer.max_time=00:01:00:00"]
        + [arg for arg in WAITS_RUN if not arg.startswith("data.tokens_per_update")]
        + ["data.tokens_per_update=1200"],  # 2 micro-batches per update on each of the 2 ranks
        tmp_path,
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    script = [str(ROOT / "tests" / "device_waits.py"), str(tmp_path / "waits"), *overrides]
    proc = run_process([*torchrun, *script], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        counter = Waits()
        counter.found = json.loads((tmp_path / f"waits-{rank}.json").read_text())
        updates = counter.per_update()
        assert sorted(updates) == [1, 2, 3, 4, 5, 6], (rank, summary(counter))
        for update, waits in updates.items():
            assert len(waits) == 1 and waits[0].startswith("tolist at update.py"), (rank, update, waits)


# ---------------------------------------------------------------- DDP: the update's gradient over ranks


class SaveGradients(TranslationModule):
    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # after update() normalised it over micro-batches and ranks
        grads = {name: p.grad.clone() for name, p in self.named_parameters()}
        grads["norm"] = self.updates.norm.clone()  # what this rank logs and decides on
        torch.save(grads, f"{self.trainer.default_root_dir}/grads-{self.global_rank}.pt")


def test_ddp_update_over_ranks_and_micro_batches_has_the_gradient_of_one_batch_of_its_sentences(tmp_path):
    """2 ranks x 2 micro-batches of different sizes: every target token weighs the same, as in one batch."""
    model_cfg = {**TINY_SHAPE, "vocab_size": 20, "dropout": 0.0}
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
    trainer = quiet_trainer(devices=WORLD, strategy="ddp_spawn", max_steps=1, default_root_dir=tmp_path)
    module.accumulation = 2
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
        norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in reference.parameters()]))
        assert grads["norm"].item() == pytest.approx(norm.item(), rel=1e-5)  # the whole norm, on each rank


# ---------------------------------------------------------------- trainer=fsdp through Lightning, 2 processes


def weights(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def test_trainer_fsdp_on_two_processes_trains_validates_resumes_and_its_checkpoints_serve_every_tool(corpus, tmp_path):
    """trainer=fsdp's strategy (FSDP2, one unit per layer) on 2 CPU processes: training with two
    validations that decode greedily on each rank (through the sharded layers this hung: ranks decode
    different numbers of steps, each a collective), a resume, the same losses and weights as DDP, and
    checkpoints that average, evaluate, translate and export like any other."""
    common = [
        f"data.path={corpus}",
        "trainer.devices=2",
        "trainer.precision=32-true",
        "trainer.val_check_interval=3",
        "checkpoint.every_n_train_steps=3",
        "optim.lr_factor=0.05",  # a gentle rate: Adam turns float noise in near-zero gradients into full steps
        "val_bleu_sentences=30",  # every validation sentence: ranks decode different numbers of sentences
    ]
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    first = run_train([*common, "trainer.strategy=fsdp", "trainer.max_steps=3", f"hydra.run.dir={fsdp}"], tmp_path)
    resumed = run_train(
        [*common, "trainer.strategy=fsdp", "trainer.max_steps=6", "ckpt_path=last", f"hydra.run.dir={fsdp}"], tmp_path
    )
    for proc in (first, resumed):  # FSDP2's states keep gloo's group: the ranks end past finalization, status 0
        output = proc.stdout + proc.stderr  # (rank 1 logs warnings only)
        assert "exit may abort" not in output and output.count("ending past finalization") == 1, output[-3000:]
    run_train([*common, "trainer.strategy=ddp", "trainer.max_steps=6", f"hydra.run.dir={ddp}"], tmp_path)
    assert "accumulation 1 x 300 tokens x 2 device(s)" in first.stdout + first.stderr
    assert "resuming from" in resumed.stdout and "(update 3)" in resumed.stdout
    # The validations (loss and greedy BLEU) of FSDP, before and after the resume, are DDP's.
    rows = {(run, int(r["step"])): r for run in (fsdp, ddp) for r in csv_rows(run) if r.get("val/loss")}
    assert sorted(rows) == [(ddp, 2), (ddp, 5), (fsdp, 2), (fsdp, 5)]
    for step in (2, 5):
        a, b = rows[fsdp, step], rows[ddp, step]
        assert float(a["val/loss"]) == pytest.approx(float(b["val/loss"]), abs=1e-5), step
        assert float(a["val/bleu"]) == pytest.approx(float(b["val/bleu"]), abs=0.01), step
    # The checkpoints: full (unsharded) weights under the same names as DDP's, and the same values.
    for name in ("step0000003.ckpt", "step0000006.ckpt", "last.ckpt"):
        a, b = weights(fsdp / "checkpoints" / name), weights(ddp / "checkpoints" / name)
        assert a.keys() == b.keys(), name
        for key in a:
            # The keys' bias has a true gradient of 0 (it adds one constant to all of a query's scores, which
            # the softmax cancels): Adam turns each run's rounding noise there into steps of the full rate.
            if not key.endswith("k_proj.bias"):
                torch.testing.assert_close(a[key], b[key], atol=2e-5, rtol=1e-4, msg=f"{name} {key}")
    # Adam's state too, keyed by parameter index as DDP's: what the resume above continued from.
    a, b = (torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"] for run in (fsdp, ddp))
    groups = [[{**group, "betas": tuple(group["betas"])} for group in s[0]["param_groups"]] for s in (a, b)]
    assert groups[0] == groups[1] and a[0]["state"].keys() == b[0]["state"].keys()  # (FSDP's betas: a list)
    torch.testing.assert_close(a[0]["state"], b[0]["state"], atol=2e-5, rtol=1e-3)
    # Every tool takes them: averaging, evaluate, translate (search.translate_lines), export.
    average = average_run(fsdp, 2)
    scores = evaluate(hydra_task("evaluate", [f"ckpt={average}", "decoding=greedy"], tmp_path / "evaluate"))
    assert scores["bleu"] >= 0 and (tmp_path / "evaluate" / "hypotheses.txt").read_text().count("\n") == 30
    model, tokenizer, _ = load_for_inference(fsdp / "checkpoints" / "last.ckpt")
    assert len(translate_lines(model, tokenizer, ["ein test .", "zwei"], beam_size=4)) == 2
    export(str(fsdp / "checkpoints" / "last.ckpt"), "hf", str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").is_file()
