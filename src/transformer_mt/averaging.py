"""Checkpoint averaging (§6.1: the last 5 checkpoints for base, 20 for big).

python -m transformer_mt.averaging outputs/<run> -n 5     (make average RUN=outputs/<run> N=5)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from transformer_mt.checkpoint import read_checkpoint, write_checkpoint
from transformer_mt.errors import InputError, MissingInputError, exit_on_user_error
from transformer_mt.files import remove_stale_temporaries

STEP = re.compile(r"step(\d+)")


def run_checkpoints(run_dir: str | Path) -> list[Path]:
    """Periodic checkpoints of a run, oldest first, one per update step (last.ckpt and averages excluded)."""
    folder = Path(run_dir) / "checkpoints" if (Path(run_dir) / "checkpoints").is_dir() else Path(run_dir)
    by_step: dict[int, Path] = {}
    for path in folder.glob("*.ckpt"):
        match = STEP.search(path.stem)
        if match and not path.stem.startswith("average"):
            by_step.setdefault(int(match.group(1)), path)  # time- and step-triggered saves can coincide
    if not by_step:
        raise MissingInputError(f"no periodic checkpoints (*step<N>.ckpt) in {folder}")
    return [by_step[s] for s in sorted(by_step)]


def average_checkpoints(paths: list[str | Path]) -> dict:
    """Mean of the weights; everything else (config, SentencePiece) from the newest checkpoint."""
    if not paths:
        raise InputError("no checkpoints to average")
    first_path = Path(paths[0])
    total: dict[str, torch.Tensor] = {}
    reference: dict | None = None
    for path in map(Path, paths):
        checkpoint = read_checkpoint(path)
        state = checkpoint["state_dict"]
        if reference is None:
            reference = checkpoint
            total = {k: v.double() if v.is_floating_point() else v.clone() for k, v in state.items()}
            continue
        if state.keys() != total.keys():
            diff = sorted(state.keys() ^ total.keys())[:5]
            raise InputError(
                f"{path} and {first_path} hold different parameters (e.g. {diff}); average checkpoints of one run only"
            )
        for key, value in state.items():
            if value.shape != total[key].shape:
                raise InputError(
                    f"{path}: {key} has shape {tuple(value.shape)}, {first_path} has "
                    f"{tuple(total[key].shape)}; average checkpoints of one run only"
                )
            if value.is_floating_point():
                total[key] += value.double()
        reference = checkpoint  # the newest one's metadata
    dtypes = {k: v.dtype for k, v in reference["state_dict"].items()}
    averaged = {k: (v / len(paths)).to(dtypes[k]) if v.is_floating_point() else v for k, v in total.items()}
    keep = {k: reference[k] for k in ("hyper_parameters", "sentencepiece", "global_step", "epoch") if k in reference}
    return {**keep, "state_dict": averaged, "averaged_from": [str(p) for p in paths]}


def average_run(run_dir: str | Path, n: int, output: str | Path | None = None) -> Path:
    if n < 1:
        raise InputError(f"N={n}: average at least 1 checkpoint (the paper: N=5 for base, 20 for big)")
    paths = run_checkpoints(run_dir)[-n:]
    if len(paths) < n:
        print(f"warning: only {len(paths)} checkpoints in {run_dir}, averaging those")
    output = Path(output) if output else paths[-1].parent / f"average-last{len(paths)}.ckpt"
    for stale in remove_stale_temporaries(output.parent):
        print(f"removed {stale} (the unfinished write of a killed command)")
    write_checkpoint(average_checkpoints(paths), output)
    print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) -> {output}")
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a training run's directory (or its checkpoints/ folder)")
    parser.add_argument("-n", type=int, default=5, help="how many of the latest checkpoints (paper: 5 base, 20 big)")
    parser.add_argument("-o", "--output", help="where to write (default: <checkpoints>/average-last<N>.ckpt)")
    args = parser.parse_args()
    exit_on_user_error(average_run, args.run_dir, args.n, args.output)


if __name__ == "__main__":
    main()
