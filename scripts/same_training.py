"""Whether this tree trains as another commit does: the same short Multi30k run (fp32, accumulation 2, one thread)
from both source trees, then their weights, Adam moments and per-update losses compared.

    git worktree add /tmp/ref 482c083
    python scripts/same_training.py --reference /tmp/ref/src --data ../shared/data/multi30k --out /tmp/same

It prints the largest relative difference of the weights and of each Adam moment (the bar: 1e-5), and the updates
whose losses differ in their 4 significant digits; it exits 1 when either bar is missed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.tools.plot import read_metrics

SRC = Path(__file__).resolve().parents[1] / "src"
RUN = [
    "experiment=multi30k",
    "logger=csv",
    "trainer.precision=32-true",
    "trainer.max_time=null",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=50",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "data.max_tokens=1024",
    "data.tokens_per_update=2048",  # two micro-batches an update
    "val_bleu_sentences=50",
    "checkpoint.every_n_train_steps=50",
    "final.enabled=false",
    "seed=1",
]


def train(src: Path, run_dir: Path, data: Path, updates: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    args = [*RUN, f"trainer.max_steps={updates}", f"data.path={data}", f"data.cache_dir={run_dir.parent / 'cache'}"]
    command = [sys.executable, "-m", "transformer_mt.train", *args, f"hydra.run.dir={run_dir}"]
    print(f"training {updates} updates from {src} in {run_dir}", flush=True)
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, cwd=src.parent)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, required=True, help="the other commit's src folder")
    parser.add_argument("--data", type=Path, required=True, help="Multi30k's text files (data.path)")
    parser.add_argument("--out", type=Path, required=True, help="a new folder for both runs")
    parser.add_argument("--this", type=Path, default=SRC, help="the src folder to compare (default: this tree's)")
    parser.add_argument("--updates", type=int, default=100)
    args = parser.parse_args()
    runs = {
        "reference": (args.reference.resolve(), args.out / "reference"),
        "this": (args.this.resolve(), args.out / "this"),
    }
    for src, run_dir in runs.values():
        train(src, run_dir, args.data.resolve(), args.updates)
    ref, new = (read_checkpoint(d / "checkpoints" / "last.ckpt") for _, d in runs.values())
    weights = max(relative(new["state_dict"][k], v) for k, v in ref["state_dict"].items())
    moments = {
        name: max(relative(new["optimizer_states"][0]["state"][i][name], s[name]) for i, s in state.items())
        for name in ("exp_avg", "exp_avg_sq")
        for state in [ref["optimizer_states"][0]["state"]]
    }
    print(f"updates: {ref['global_step']} and {new['global_step']}")
    print(f"weights: largest relative difference {weights:.2e}")
    for name, value in moments.items():
        print(f"Adam {name}: largest relative difference {value:.2e}")
    ref_losses, new_losses = (dict(read_metrics(d)["train/loss"]) for _, d in runs.values())
    differ = [step for step in ref_losses if f"{ref_losses[step]:.4g}" != f"{new_losses.get(step, float('nan')):.4g}"]
    print(f"per-update losses: {len(ref_losses)} compared, {len(differ)} differ in 4 significant digits {differ[:10]}")
    same = ref["global_step"] == new["global_step"] == args.updates and not differ
    return 0 if same and max(weights, *moments.values()) <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
