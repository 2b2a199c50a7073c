"""Learning curves of a run as one PNG, from the CSV metrics every run writes (<run>/csv/version_*/metrics.csv):
make plot RUN=<run dir>. Training loss and learning rate per update; validation loss, perplexity and BLEU."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from matplotlib.figure import Figure  # not pyplot: no display, no global state

from transformer_mt.errors import CommandParser, MissingInputError, exit_on_user_error

PANELS = {  # title: [(metric, label)]
    "loss (label-smoothed cross-entropy)": [
        ("train/loss_window", "training (mean since the previous point)"), ("val/loss", "validation")],
    "learning rate": [("lr-", "Noam schedule")],
    "validation perplexity": [("val/ppl", "validation")],
    "validation BLEU (sacreBLEU)": [("val/bleu", "validation")],
}  # fmt: skip


def read_metrics(run: Path) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(update, value)] from every metrics.csv of the run (a resumed run adds versions); Lightning's
    `step` counts the updates finished before the one logged: update = step + 1."""
    files = sorted(run.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    if not files:
        raise MissingInputError(
            f"no CSV metrics under {run} (looked for {run}/csv/version_*/metrics.csv): give a training run's "
            "folder (outputs/<date>/<time>, or multirun/<date>/<time>/<job>)"
        )
    series: dict[str, dict[int, float]] = {}
    for path in files:
        with open(path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                for name, value in row.items():
                    if row.get("step") and name not in ("step", "epoch") and value not in ("", None):
                        series.setdefault(name, {})[int(float(row["step"])) + 1] = float(value)  # later versions win
    return {name: sorted(points.items()) for name, points in series.items()}


def find(series: dict, key: str) -> list[tuple[int, float]]:
    """The series named `key` (finite values); for "lr-", the first named lr-<optimizer>."""
    if key.endswith("-"):
        key = next((name for name in series if name.startswith(key)), key)
    return [(s, v) for s, v in series.get(key, []) if math.isfinite(v)]


def plot_run(run: str, out: str | None = None) -> Path:
    run_dir = Path(run)
    series = read_metrics(run_dir)
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    for ax, (title, lines) in zip(fig.subplots(2, 2).flat, PANELS.items()):
        drawn = [(find(series, key), label) for key, label in lines if find(series, key)]
        for points, label in drawn:
            ax.plot(*zip(*points), label=label, marker="o" if len(points) < 30 else None, markersize=3)
        if drawn:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run_dir}")
    path = Path(out) if out else run_dir / "curves.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    print(f"wrote {path} ({', '.join(sorted(series))})")
    return path


def main() -> None:
    parser = CommandParser(__doc__)
    parser.add_argument("run", help="a training run's folder")
    parser.add_argument("--out", help="the PNG to write (default: <run>/curves.png)")
    args = parser.parse()
    exit_on_user_error(plot_run, args.run, args.out)


if __name__ == "__main__":
    main()
