"""Host overhead of a training update: operations launched and host microseconds per micro-batch and per update.

On a GPU the host must launch an update's kernels faster than the device runs them; a base micro-batch is ~4 ms
of H200 work. With the compute made negligible (the paper's depth and heads, tiny widths, short sentences, on
this CPU), the wall time of a step is its host time. Three systems train the same model on the same
micro-batches (4 per update), each in training's precision:

  bare loop        PyTorch alone: sequence_losses, backward, the gradient / tokens, its norm, fused Adam, one read
  Trainer eager    lightning.Trainer with TranslationModule and train.py's callbacks and loggers (trainer=cpu)
  Trainer compiled the same with trainer.compile=true (module.compile_training)

Per micro-batch: one inside an accumulation window (forward, loss, backward). Per update: what the micro-batch
that ends an update costs on top (normalisation, norm, optimizer, bookkeeping, callbacks). Operations are the
aten operations dispatched (a TorchDispatchMode, in a separate counting pass); a compiled step runs generated
kernels that no dispatch sees, so its count is not comparable and is left out. Figures are medians.

  python scripts/host_overhead.py [--shapes base,big] [--updates 12] [--no-compile]
  make bench ARGS="--parts host"
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from contextlib import nullcontext
from importlib import metadata
from pathlib import Path

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from transformer_mt.configs import compose
from transformer_mt.data.batching import collate
from transformer_mt.launcher import Job
from transformer_mt.model import Transformer, TransformerConfig
from transformer_mt.objective import sequence_losses
from transformer_mt.runtime import cpu_has_native_bf16, cpuinfo, sentence_attention
from transformer_mt.tokenizer import PAD_ID
from transformer_mt.training.callbacks import StartupLog
from transformer_mt.training.fit import make_callbacks, trainer_arguments
from transformer_mt.training.logs import make_loggers
from transformer_mt.training.module import TranslationModule

SHAPES = {"base": (6, 8), "big": (6, 16)}  # layers per side, heads (§3, Table 3); widths: 4 per head
ACCUMULATION = 4


def describe_machine() -> str:
    """CPU model and vector extensions, torch threads and version: what every speed figure is stated with."""
    lines = cpuinfo().split("\n")
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line for line in lines if line.startswith("flags")), "")
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return (
        f"{model} ({platform.machine()}, {'/'.join(simd) or 'no AVX2'}), {torch.get_num_threads()} threads, "
        f"torch {metadata.version('torch')}"
    )


def model_config(shape: str) -> dict:
    layers, heads = SHAPES[shape]
    d = 4 * heads
    return dict(
        vocab_size=64,
        d_model=d,
        d_ff=2 * d,
        n_heads=heads,
        n_encoder_layers=layers,
        n_decoder_layers=layers,
        dropout=0.1,
        pad_id=PAD_ID,
        max_positions=64,
    )


def micro_batches(count: int, seed: int = 0) -> list[dict]:
    """`count` micro-batches of 8 random sentence pairs, 8-16 tokens each side."""
    g, batches = torch.Generator().manual_seed(seed), []
    for b in range(count):
        items = []
        for i in range(8):
            n = int(torch.randint(8, 17, (1,), generator=g))
            src, tgt = (torch.randint(4, 64, (m,), generator=g).numpy() for m in (n, n + 1))
            items.append((src, tgt, b * 8 + i))
        batches.append(collate(items))
    return batches


class Marks:
    """A stamp at each micro-batch's start (and at the end), whether the micro-batch before it ended an update,
    and with a Counting mode on, the operations between two stamps."""

    def __init__(self):
        self.stamps: list[float] = []
        self.ended: list[bool] = []
        self.ops: Counting | None = None

    def start(self, ended_update: bool) -> None:
        if self.stamps:
            self.ended.append(ended_update)
        self.stamps.append(time.perf_counter())
        if self.ops is not None:
            self.ops.counts.append(0)

    def split(self, values: list[float], skip: int) -> tuple[float, float]:
        """(median over window micro-batches, median extra of an update-ending one), the first `skip` left out and
        the last (the end of training: the Trainer writes last.ckpt there)."""
        pairs = list(zip(values, self.ended))[skip:-1]
        window = [v for v, ended in pairs if not ended]
        ending = [v for v, ended in pairs if ended]
        inside = statistics.median(window)
        return inside, statistics.median(ending) - inside

    def seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class Counting(TorchDispatchMode):
    """Counts the aten operations dispatched from the first micro-batch's start on, per micro-batch (Marks)."""

    def __init__(self, marks: Marks):
        super().__init__()
        marks.ops = self
        self.counts: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counts:
            self.counts[-1] += 1
        return func(*args, **(kwargs or {}))


def autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()


def bare_loop(cfg: dict, batches: list[dict], marks: Marks, precision: str) -> None:
    """The update as plain PyTorch: the same model, loss, normalisation, norm and fused Adam, one read per update."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**cfg)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    ended = False
    for index, batch in enumerate(batches):
        marks.start(ended)
        with autocast(precision), sentence_attention(torch.device("cpu"), precision):  # training's kernel
            loss_sum, _, _ = sequence_losses(
                model, batch["src"], batch["tgt_in"], batch["tgt_out"], 0.1, batch["target_positions"]
            )
        loss_sum.backward()
        ended = (index + 1) % ACCUMULATION == 0
        if ended:
            tokens = sum(sum(b["tgt_lengths"]) for b in batches[index + 1 - ACCUMULATION : index + 1])
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, 1 / tokens)
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            norm.item()  # the update's one read
    marks.start(ended)


class Stamp(L.Callback):
    def __init__(self, marks: Marks):
        self.marks, self.seen = marks, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.marks.start(trainer.global_step != self.seen)
        self.seen = trainer.global_step

    def on_train_end(self, trainer, module) -> None:
        self.marks.start(True)


def trainer_loop(cfg: dict, batches: list[dict], marks: Marks, compiled: bool, run_dir: Path) -> None:
    """The real Trainer, module, callbacks and loggers of `make train ... trainer=cpu`, on the given micro-batches."""
    config = compose("train", ["trainer=cpu", f"trainer.compile={str(compiled).lower()}"])
    torch.manual_seed(0)
    module = TranslationModule(model=cfg, val_bleu_sentences=0)
    module.accumulation = ACCUMULATION
    if compiled:
        module.compile_training()
    args = trainer_arguments(config.trainer)
    args.update(max_steps=len(batches) // ACCUMULATION, limit_val_batches=0)
    args.update(num_sanity_val_steps=0)  # the bar disables itself off a terminal, as in a logged run
    callbacks = [Stamp(marks), *make_callbacks(config, run_dir / "checkpoints", StartupLog(time.monotonic()))]
    trainer = L.Trainer(
        **args,
        callbacks=callbacks,
        logger=make_loggers(None, Job(run_dir)),
        default_root_dir=run_dir,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))


def measure(system: str, cfg: dict, batches: list[dict], precision: str, count_ops: bool) -> Marks:
    marks = Marks()
    counter = Counting(marks) if count_ops else nullcontext()
    with tempfile.TemporaryDirectory() as tmp, counter:
        if system == "bare loop":
            bare_loop(cfg, batches, marks, precision)
        else:
            trainer_loop(cfg, batches, marks, system == "Trainer compiled", Path(tmp))
    return marks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="base,big", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--updates", type=int, default=12, help="updates per system (the first 2 are warm-up)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="leave out Trainer compiled")
    args = parser.parse_args(argv)
    run(args.shapes.split(","), args.updates, args.compile)


def run(shapes: list[str], updates: int, compiled: bool) -> None:
    threads, machine = torch.get_num_threads(), describe_machine()
    torch.set_num_threads(1)  # a GPU run's host is one thread; a second one here only adds OpenMP's hand-offs
    try:
        table(shapes, updates, compiled, machine)
    finally:
        torch.set_num_threads(threads)


def table(shapes: list[str], updates: int, compiled: bool, machine: str) -> None:
    precision = "bf16-mixed" if cpu_has_native_bf16() else "32-true"
    systems = ["bare loop", "Trainer eager", *(["Trainer compiled"] if compiled else [])]
    print(
        f"\nhost overhead ({machine}, timed on 1 thread; {precision}; {ACCUMULATION} micro-batches per "
        "update; compute negligible: 4 dims per head, 8 pairs of 8-16 tokens per micro-batch)"
    )
    print(
        f"{'shape':6s} {'system':17s} {'ops/micro-batch':>15s} {'ops/update':>10s} {'µs/micro-batch':>14s} "
        f"{'µs/update':>10s} {'µs per update of 4':>18s} {'vs bare':>7s}"
    )
    skip = 2 * ACCUMULATION  # warm-up: the first 2 updates
    for shape in shapes:
        cfg = model_config(shape)
        batches = micro_batches(updates * ACCUMULATION)
        bare_total = None
        for system in systems:
            if system == "Trainer compiled":
                measure(system, cfg, batches[: 2 * ACCUMULATION], precision, False)  # compiles every shape first
            timed = measure(system, cfg, batches, precision, False)
            inside_s, update_s = timed.split(timed.seconds(), skip)
            total = ACCUMULATION * inside_s + update_s
            bare_total = bare_total or total
            if system == "Trainer compiled":
                ops_text = f"{'n/a':>15s} {'n/a':>10s}"
            else:
                counted = measure(system, cfg, batches[: 4 * ACCUMULATION], precision, True)
                inside_ops, update_ops = counted.split([float(n) for n in counted.ops.counts[:-1]], ACCUMULATION)
                ops_text = f"{inside_ops:15,.0f} {update_ops:10,.0f}"
            print(
                f"{shape:6s} {system:17s} {ops_text} {inside_s * 1e6:14,.0f} {update_s * 1e6:10,.0f} "
                f"{total * 1e6:18,.0f} {total / bare_total:6.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
