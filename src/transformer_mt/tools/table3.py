"""make table3 RUNS=<sweep dir> (or RUNS="<dir> <dir>"): a Table 3 sweep's runs in one table beside the paper's, also
written to <RUNS>/table3.md. Per run (its first model: the average, else the final weights): parameters; perplexity,
BLEU (tokenized, compounds split: the paper's "dev") and sacreBLEU on the validation split; the difference from
base, marked * beyond the base seeds' spread."""

from __future__ import annotations

import re
from pathlib import Path

from transformer_mt.errors import CommandParser, InputError, MissingInputError, exit_on_user_error
from transformer_mt.files import RESULTS, RunFolder, atomic_write
from transformer_mt.results import Results

GROUPS = ["base", "(A)", "(B)", "(C)", "(D)", "(E)", "big"]  # Table 3's order of rows


def read_runs(runs: Path) -> tuple[list[dict], list[Path]]:
    """(an entry per finished run, the job folders without results.json)."""
    if not runs.is_dir():
        raise MissingInputError(f"RUNS={runs}: no such folder (a sweep's folder, multirun/<date>/<time>)")
    entries, unfinished = [], []
    for job in sorted(p for p in runs.iterdir() if p.is_dir() and (p / ".hydra").is_dir()):
        path = RunFolder(job).results
        if not path.is_file():
            unfinished.append(job)
            continue
        results = Results.read(path)
        row = results.table3_row or {}
        model = next(iter(results.models.values()))
        dev, test = model.get("validation"), model.get("test")
        entries.append(
            dict(
                name=row.get("name", job.name),
                row=row.get("row", ""),
                paper=row.get("paper") or {},
                change=row.get("change", " ".join(results.overrides or [])),
                seed=results.seed,
                params_millions=results.parameters / 1e6,
                updates=results.updates,
                train_seconds=results.train_seconds,
                dev_ppl=dev and dev["ppl"],
                dev_bleu=dev and dev["tokenized_bleu_compound_split"],
                dev_sacrebleu=dev and dev["bleu"],
                test_sacrebleu=test and test["bleu"],
            )
        )
    if not entries and not unfinished:
        raise InputError(f"RUNS={runs}: no job folders (with .hydra/) in it; give the sweep's folder")
    return entries, unfinished


def why_unfinished(job: Path) -> str:
    """Why a job folder has no results.json: its end was off, or it did not reach it."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    config = job / ".hydra" / "config.yaml"
    if config.is_file() and OmegaConf.select(OmegaConf.load(config), "final.enabled") is False:
        return f"it ran with final.enabled=false: make finish RUN={job} scores it"
    return f"still running, failed, or stopped before its end; see {job}/train.log, or make finish RUN={job}"


def order(entry: dict) -> tuple:
    """Table 3's order: base, (A) ... (E), big; within a group by name ('A-h4' before 'A-h16'), then seed."""
    group = GROUPS.index(entry["row"]) if entry["row"] in GROUPS else len(GROUPS)
    natural = [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", entry["name"])]
    return group, natural, entry["seed"] or 0


METRICS = ("dev_ppl", "dev_bleu", "dev_sacrebleu", "test_sacrebleu")


def base_spread(entries: list[dict]) -> tuple[dict, dict]:
    """(mean, spread = max - min) of each metric over the base row's runs (its seeds)."""
    base = [e for e in entries if e["row"] == "base" and e["name"].startswith("base")]
    mean, spread = {}, {}
    for metric in METRICS:
        values = [e[metric] for e in base if e[metric] is not None]
        if values:
            mean[metric] = sum(values) / len(values)
            spread[metric] = max(values) - min(values) if len(values) > 1 else None
    return mean, spread


def number(value, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def difference(entry: dict, metric: str, mean: dict, spread: dict) -> str:
    """The difference from base's mean, * when larger than the base seeds' spread."""
    if entry[metric] is None or metric not in mean or entry["row"] == "base":
        return ""
    delta = entry[metric] - mean[metric]
    beyond = spread.get(metric) is not None and abs(delta) > spread[metric]
    return f"{delta:+.2f}{'*' if beyond else ''}"


def table(entries: list[dict]) -> str:
    mean, spread = base_spread(entries)
    has_test = any(e["test_sacrebleu"] is not None for e in entries)
    rows = []
    for e in entries:
        paper = e["paper"]
        params = f"{e['params_millions']:.1f}" + (f" / {p}" if (p := paper.get("params_millions")) else "")
        cells = {  # column: cell
            "row": e["name"],
            "change": e["change"],
            "seed": str(e["seed"]),
            "params (M) ours / paper": params,
            "PPL dev ours / paper": f"{number(e['dev_ppl'])} / {paper.get('ppl', '')}",
            "BLEU dev ours / paper": f"{number(e['dev_bleu'], 1)} / {paper.get('bleu', '')}",
            "Δ BLEU dev": difference(e, "dev_bleu", mean, spread),
            "sacreBLEU dev": number(e["dev_sacrebleu"], 1),
        }
        if has_test:
            cells |= {"sacreBLEU test": number(e["test_sacrebleu"], 1)}
            cells |= {"Δ test": difference(e, "test_sacrebleu", mean, spread)}
        cells |= {"updates": f"{e['updates']:,}", "training": f"{e['train_seconds'] / 60:.1f} min"}
        rows.append(cells)
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cells.values()) + " |" for cells in rows]
    shown = ", ".join(f"{k} {v:.2f}" for k, v in spread.items() if v is not None)
    note = f"Base's run-to-run spread (max - min over its seeds): {shown}. * marks a difference beyond it."
    if not mean:
        note = "No base run: no difference from base is given (add the base row, and base with a second seed)."
    elif not shown:
        note = "One base run only: no run-to-run spread, so no difference is marked (run base with 2 seeds)."
    minutes = sum(e["train_seconds"] for e in entries) / 60
    return "\n".join(lines) + f"\n\n{note}\n{len(entries)} runs, {minutes:.0f} minutes of training in all.\n"


def collect(*folders: str | Path) -> str:
    """One table of one or more sweep folders' runs, written to <first folder>/table3.md."""
    found = [read_runs(Path(folder)) for folder in folders]
    entries = sorted((entry for finished, _ in found for entry in finished), key=order)
    unfinished = [job for _, left in found for job in left]
    runs = Path(folders[0])
    text = table(entries) if entries else ""
    for job in unfinished:
        text += f"{job}: no {RESULTS} ({why_unfinished(job)})\n"
    with atomic_write(runs / "table3.md") as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(f"{text}wrote {runs / 'table3.md'}")
    return text


def main() -> None:
    parser = CommandParser(__doc__)
    parser.add_argument("runs", nargs="+", help="the sweep's folder (multirun/<date>/<time>), or several")
    args = parser.parse()
    exit_on_user_error(collect, *args.runs)


if __name__ == "__main__":
    main()
