"""Decoding settings chosen on the development set, as the paper chose beam 4 and alpha 0.6 (§6.1): a grid
over the length penalty, then the beam size at the best alpha, then whether the output-length limit binds.
`make tune` (tune.py) and the end-of-run protocol (final.tune=true) run it on the validation split, never
on the test split; the choice is stored beside the checkpoint (<name>.decoding.json, with the checkpoint's
SHA-256) and `make translate` / `make evaluate` use it by default, saying so."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from transformer_mt.engines import file_digest
from transformer_mt.files import atomic_write
from transformer_mt.scoring import evaluate_translations

PAPER = {"beam_size": 4, "alpha": 0.6}  # §6.1, conf/decoding/beam.yaml
ALPHAS = (0.0, 0.3, 0.6, 1.0, 1.5, 2.0)
BEAMS = (2, 4, 8)
DETAIL = re.compile(r"BP = ([\d.]+) ratio = ([\d.]+)")
# A setting whose translations run away (a weak model under a strong length penalty decodes to the length limit,
# 7x the time of alpha 0.6 once) is abandoned as soon as a part of the split (one of CHUNKS) ends RUNAWAY times
# longer, in words, than both the references and the grid's first row on the same sentences; it cannot win.
RUNAWAY, CHUNKS = 2.0, 5


class RunAway(Exception):
    """A grid row's translations ran away (RUNAWAY): the row is abandoned."""


def checked_for_runaway(translate: Callable[[list[str]], list], lengths: Sequence[int]) -> Callable:
    """`translate` over the split in CHUNKS parts; raises RunAway when what is translated so far, before the last
    part, is RUNAWAY times longer in words than `lengths` (per sentence) on the same sentences."""

    def run(lines: list[str]) -> list:
        size, done = max(1, -(-len(lines) // CHUNKS)), []
        for start in range(0, len(lines), size):
            done += translate(lines[start : start + size])
            words, usual = sum(len(h.split()) for h in done), max(sum(lengths[: len(done)]), 1)
            if len(done) < len(lines) and words > RUNAWAY * usual:
                raise RunAway(f"abandoned: {words / usual:.2f}x the usual length after {len(done):,} of "
                              f"{len(lines):,} sentences")  # fmt: skip
        return done

    return run


def tuned_path(ckpt: str | Path) -> Path:
    ckpt = Path(ckpt)
    return ckpt.with_name(ckpt.name.removesuffix(".ckpt") + ".decoding.json")


SETTINGS = ("beam_size", "alpha", "max_len_a", "max_len_b")


def search_grid(
    translate: Callable[..., list],
    sources: Sequence[str],
    references: Sequence[str],
    tgt_lang: str,
    decoding: dict,
    alphas: Sequence[float] = ALPHAS,
    beams: Sequence[int] = BEAMS,
    report: Callable[[dict], None] = lambda row: None,
) -> tuple[dict, list[dict]]:
    """(the chosen decoding settings, every row scored). `translate(lines, **settings)`; `decoding` holds the
    settings not searched (max_len_a, max_len_b) and the starting beam. The best sacreBLEU wins; a tie goes
    to the paper's settings, then to the smaller beam and alpha. Each row reaches `report` as it is scored; a row
    whose translations run away (RUNAWAY) is abandoned early, with bleu None and why."""
    rows: list[dict] = []
    outputs: list[list[str]] = []  # rows[i]'s translations

    def run(**changes) -> dict:
        settings = {k: v for k, v in {**decoding, **changes}.items() if k in SETTINGS}
        start = time.perf_counter()
        row_translate = lambda lines: translate(lines, **settings)  # noqa: E731
        if outputs:  # the grid's first row sets the usual length (with the references'); the others are checked
            usual = [max(len(r.split()), len(h.split())) for r, h in zip(references, outputs[0])]
            row_translate = checked_for_runaway(row_translate, usual)
        try:
            _, best, scores = evaluate_translations(row_translate, sources, references, tgt_lang)
        except RunAway as e:
            row = {**settings, "bleu": None, "abandoned": str(e), "seconds": round(time.perf_counter() - start, 1)}
            rows.append(row)
            outputs.append(None)
            report(row)
            return row
        bp, ratio = map(float, DETAIL.search(scores["bleu_detail"]).groups())
        row = {**settings, "bleu": scores["bleu"], "bleu_signature": scores["bleu_signature"]}
        row |= {"chrf": scores["chrf"], "brevity_penalty": bp, "length_ratio": ratio, "seconds": scores["seconds"]}
        rows.append(row)
        outputs.append(best)
        report(row)
        return row

    def key(row: dict):
        paper = row["beam_size"] == PAPER["beam_size"] and row["alpha"] == PAPER["alpha"]
        return (-1.0 if row["bleu"] is None else row["bleu"], paper, -row["beam_size"], -row["alpha"])

    for alpha in alphas:
        run(alpha=alpha)
    best = max(rows, key=key)
    for beam in beams:
        if beam != best["beam_size"]:
            run(alpha=best["alpha"], beam_size=beam)
    best = max(rows, key=key)
    # Does the length limit bind? Twice the offset: where no translation changes, it did not.
    longer = run(**{**best, "max_len_b": 2 * best["max_len_b"]})
    binds = outputs[-1] != outputs[rows.index(best)]
    chosen = longer if binds and key(longer) > key(best) else best
    return {k: chosen[k] for k in SETTINGS}, rows


def save_tuned(ckpt: str | Path, chosen: dict, rows: list[dict], split: str) -> Path:
    """<ckpt name>.decoding.json: the chosen settings, the grid, and the checkpoint they were chosen for."""
    path = tuned_path(ckpt)
    record = {"decoding": chosen, "chosen_on": split, "checkpoint_sha256": file_digest(Path(ckpt)), "grid": rows}
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def read_tuned(ckpt: str | Path) -> tuple[dict | None, str]:
    """(the settings make tune chose for ckpt as it is now, or None; a line that says which and why)."""
    path = tuned_path(ckpt)
    if not path.is_file():
        return None, ""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        chosen, split, digest = record["decoding"], record["chosen_on"], record["checkpoint_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"{path} is not make tune's record: decoding as conf/decoding says"
    if digest != file_digest(Path(ckpt)):
        return (
            None,
            f"{path} was chosen for another version of {ckpt}: decoding as conf/decoding says (make tune again)",
        )
    return chosen, (
        f"decoding: beam {chosen['beam_size']}, alpha {chosen['alpha']}, max length {chosen['max_len_a']} x source + "
        f"{chosen['max_len_b']}, chosen on the {split} split by make tune ({path}); tuned=false for conf/decoding's"
    )


TABLE_HEADER = f"{'beam':>4} {'alpha':>5} {'max len':>10} {'sacreBLEU':>9} {'chrF':>6} {'BP':>6} {'ratio':>6} {'s':>6}"


def table_row(r: dict) -> str:
    """One setting of the grid for a person: its sacreBLEU, chrF, brevity penalty, length ratio and seconds."""
    limit = f"{r['max_len_a']:g}x+{r['max_len_b']}"
    if r["bleu"] is None:
        return f"{r['beam_size']:>4} {r['alpha']:>5} {limit:>10} {r['abandoned']} ({r['seconds']:.1f} s)"
    return (
        f"{r['beam_size']:>4} {r['alpha']:>5} {limit:>10} {r['bleu']:>9.2f} {r['chrf']:>6.2f} "
        f"{r['brevity_penalty']:>6.3f} {r['length_ratio']:>6.3f} {r['seconds']:>6.1f}"
    )


def decoding_settings(cfg, say: Callable[[str], None]) -> dict:
    """What make translate / make evaluate decode with: conf/decoding's settings, or make tune's for this
    checkpoint when cfg.tuned, no decoding key is given on the command line, and the record is the checkpoint's
    as it is now; `say` gets the line that tells which."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415 (front doors only)
    from omegaconf import OmegaConf  # noqa: PLC0415

    decoding = OmegaConf.to_container(cfg.decoding)
    given = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    if not cfg.get("tuned") or any(o.lstrip("+~").startswith("decoding") for o in given):
        return decoding
    chosen, line = read_tuned(cfg.ckpt)
    if line:
        say(line)
    return {**decoding, **chosen} if chosen else decoding
