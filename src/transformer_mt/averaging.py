"""Average a run's last N checkpoints (§6.1: 5 for base, 20 for big): make average RUN=outputs/<run> N=5."""

from __future__ import annotations

from pathlib import Path

from transformer_mt.checkpoint import average_checkpoints, run_checkpoints, write_checkpoint
from transformer_mt.errors import CommandParser, InputError, exit_on_user_error
from transformer_mt.evaluation.engines import ct2_folder
from transformer_mt.evaluation.tuned import tuned_path
from transformer_mt.files import RunFolder, file_digest, remove_stale_temporaries


def average_run(run_dir: str | Path, n: int, output: str | Path | None = None) -> Path:
    if n < 1:
        raise InputError(f"N={n}: average at least 1 checkpoint (the paper: N=5 for base, 20 for big)")
    paths = run_checkpoints(run_dir)[-n:]
    if len(paths) < n:
        print(f"warning: only {len(paths)} checkpoints in {run_dir}, averaging those")
    output = Path(output) if output else paths[-1].parent / RunFolder.average_name(len(paths))
    remove_stale_temporaries(output.parent, print)
    made_for_before = [path for path in (tuned_path(output), ct2_folder(output)) if path.exists()]
    before = file_digest(output) if made_for_before and output.is_file() else None  # only where records depend on it
    write_checkpoint(average_checkpoints(paths), output)
    print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) -> {output}")
    if before is not None and before != file_digest(output):  # (identical bytes: the records stay valid)
        print(
            f"{output} now holds other weights: {' and '.join(map(str, made_for_before))} were made for the ones it "
            "replaced and no longer apply (make tune again; engine=ct2 exports again when next used)"
        )
    return output


def main() -> None:
    parser = CommandParser(__doc__)
    parser.add_argument("run_dir", help="a training run's directory (or its checkpoints/ folder)")
    parser.add_argument("-n", type=int, default=5, help="how many of the latest checkpoints (paper: 5 base, 20 big)")
    parser.add_argument("-o", "--output", help="where to write (default: <checkpoints>/average-last<N>.ckpt)")
    args = parser.parse()
    exit_on_user_error(average_run, args.run_dir, args.n, args.output)


if __name__ == "__main__":
    main()
