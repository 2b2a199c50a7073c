"""Decoding settings chosen on the development set, as the paper chose beam 4 and alpha 0.6 (§6.1): a grid
over the length penalty, then the beam size at the best alpha, then whether the output-length limit binds.
`make tune` (tune.py) and the end-of-run protocol (final.tune=true) run it on the validation split, never
on the test split; the choice is stored beside the checkpoint (<name>.decoding.json, with the checkpoint's
SHA-256) and `make translate` / `make evaluate` use it by default, saying so."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from transformer_mt.engines import file_digest
from transformer_mt.errors import InputError
from transformer_mt.files import atomic_write
from transformer_mt.scoring import evaluate_translations, paired_bootstrap_p

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


def ran_away(done: Sequence[str], lengths: Sequence[int], total: int) -> str | None:
    """Why a row is abandoned, if it is: the translations so far (`done`, before the last part of `total`) are
    RUNAWAY times longer in words than `lengths` (per sentence) on the same sentences."""
    words, usual = sum(len(h.split()) for h in done), max(sum(lengths[: len(done)]), 1)
    if len(done) < total and words > RUNAWAY * usual:
        return f"abandoned: {words / usual:.2f}x the usual length after {len(done):,} of {total:,} sentences"
    return None


def checked_for_runaway(translate: Callable[[list[str]], list], lengths: Sequence[int]) -> Callable:
    """`translate` over the split in CHUNKS parts; raises RunAway when what is translated so far ran_away."""

    def run(lines: list[str]) -> list:
        size, done = max(1, -(-len(lines) // CHUNKS)), []
        for start in range(0, len(lines), size):
            done += translate(lines[start : start + size])
            if why := ran_away(done, lengths, len(lines)):
                raise RunAway(why)
        return done

    return run


def alphas_in_one_search(
    translate: Callable[..., list],
    sources: Sequence[str],
    references: Sequence[str],
    tgt_lang: str,
    settings: dict,
    alphas: list,
) -> tuple[dict, float]:
    """The grid's rows at the starting beam, every alpha from one beam search (search.beam_search: the live
    hypotheses do not depend on alpha): ({alpha: evaluate_translations' result, or why it was abandoned}, seconds).
    In CHUNKS parts, as the grid's rows one by one: an alpha whose translations run away (ran_away, against the
    references and the first alpha's) leaves the search."""
    start, size = time.perf_counter(), max(1, -(-len(sources) // CHUNKS))
    done: dict[float, list[str]] = {alpha: [] for alpha in alphas}
    abandoned: dict[float, str] = {}
    for lo in range(0, len(sources), size):
        searched = [alpha for alpha in alphas if alpha not in abandoned]
        for alpha, out in zip(searched, translate(list(sources[lo : lo + size]), alpha=searched, **settings)):
            done[alpha] += out
        usual = [max(len(r.split()), len(h.split())) for r, h in zip(references, done[alphas[0]])]
        for alpha in searched[1:]:
            if why := ran_away(done[alpha], usual, len(sources)):
                abandoned[alpha] = why
    seconds = time.perf_counter() - start
    scored = dict(abandoned)
    for alpha in alphas:
        if alpha not in abandoned:
            scored[alpha] = evaluate_translations(lambda _, a=alpha: done[a], sources, references, tgt_lang)
    return scored, seconds


def tuned_path(ckpt: str | Path) -> Path:
    ckpt = Path(ckpt)
    return ckpt.with_name(ckpt.name.removesuffix(".ckpt") + ".decoding.json")


SETTINGS = ("beam_size", "alpha", "max_len_a", "max_len_b")
# A setting replaces the current choice only when it scores higher and sacreBLEU's paired bootstrap test (1,000
# resamples of the split's sentences) puts the difference beyond luck: p below this. A win of 26.92 against 26.91
# on 1,014 sentences is not one.
SIGNIFICANCE = 0.05


def setting_text(row: dict) -> str:
    return (
        f"beam {row['beam_size']}, alpha {row['alpha']}, max length {row['max_len_a']:g} x source + {row['max_len_b']}"
    )


class Grid:
    """The rows of a tuning grid scored so far, each with its translations, and the steps that choose among them."""

    def __init__(self, translate, sources, references, tgt_lang, decoding, report, say, significance) -> None:
        self.translate, self.sources, self.references, self.tgt_lang = translate, sources, list(references), tgt_lang
        self.decoding, self.report, self.say, self.significance = decoding, report, say, significance
        self.rows: list[dict] = []
        self.outputs: list[list[str] | None] = []  # rows[i]'s translations (None: abandoned)

    def add(
        self, settings: dict, scored, seconds: float, **extra
    ) -> dict:  # scored: evaluate_translations', or why not
        if isinstance(scored, str):
            row, best = {**settings, "bleu": None, "abandoned": scored, "seconds": round(seconds, 1)}, None
        else:
            _, best, scores = scored
            bp, ratio = map(float, DETAIL.search(scores["bleu_detail"]).groups())
            row = {**settings, "bleu": scores["bleu"], "bleu_signature": scores["bleu_signature"]}
            row |= {"chrf": scores["chrf"], "brevity_penalty": bp, "length_ratio": ratio, "seconds": round(seconds, 1)}
        self.rows.append(row | extra)
        self.outputs.append(best)
        self.report(self.rows[-1])
        return self.rows[-1]

    def run(self, **changes) -> dict:
        """The row of the starting settings with `changes`, decoded and scored (abandoned if it runs away)."""
        settings = {k: v for k, v in {**self.decoding, **changes}.items() if k in SETTINGS}
        start = time.perf_counter()
        row_translate = lambda lines: self.translate(lines, **settings)  # noqa: E731
        if self.outputs:  # the grid's first row sets the usual length (with the references'); the others are checked
            usual = [max(len(r.split()), len(h.split())) for r, h in zip(self.references, self.outputs[0])]
            row_translate = checked_for_runaway(row_translate, usual)
        try:
            scored = evaluate_translations(row_translate, self.sources, self.references, self.tgt_lang)
        except RunAway as e:
            return self.add(settings, str(e), time.perf_counter() - start)
        return self.add(settings, scored, scored[2]["seconds"])

    def step(self, what: str, current: dict, candidates: list[dict]) -> dict:
        """The best of `candidates` where it beats `current` clearly (SIGNIFICANCE), else `current`; says why."""
        others = [row for row in candidates if row is not current]
        best = max(others, key=best_first) if others else None
        if best is None or best["bleu"] is None:
            self.say(f"{what}: kept {setting_text(current)}: nothing else was scored")
            return current
        mine, theirs = (self.outputs[self.rows.index(row)] for row in (current, best))
        if theirs == mine:
            self.say(f"{what}: kept {setting_text(current)}: {setting_text(best)} gives the same translations")
            return current
        if current["bleu"] is None:
            self.say(f"{what}: chose {setting_text(best)}: {setting_text(current)} was abandoned")
            return best
        scores = f"{best['bleu']:.2f} against {current['bleu']:.2f} ({best['bleu'] - current['bleu']:+.2f})"
        if best["bleu"] <= current["bleu"]:
            self.say(f"{what}: kept {setting_text(current)}: the best other, {setting_text(best)}, scored {scores}")
            return current
        p = paired_bootstrap_p(mine, theirs, self.references)
        if p < self.significance or self.significance >= 1:
            test = f"paired bootstrap p = {p:.3f} (< {self.significance:g})"
            self.say(f"{what}: chose {setting_text(best)} over {setting_text(current)}: {scores}, {test}")
            return best
        test = f"paired bootstrap p = {p:.3f} (not < {self.significance:g})"
        self.say(f"{what}: kept {setting_text(current)}: {setting_text(best)} scored {scores}, {test}")
        return current


def best_first(row: dict) -> tuple:
    """The order of a step's rows: the highest sacreBLEU; a tie to the paper's settings, then the smaller beam and
    alpha."""
    paper = row["beam_size"] == PAPER["beam_size"] and row["alpha"] == PAPER["alpha"]
    return (-1.0 if row["bleu"] is None else row["bleu"], paper, -row["beam_size"], -row["alpha"])


def search_grid(
    translate: Callable[..., list],
    sources: Sequence[str],
    references: Sequence[str],
    tgt_lang: str,
    decoding: dict,
    alphas: Sequence[float] = ALPHAS,
    beams: Sequence[int] = BEAMS,
    report: Callable[[dict], None] = lambda row: None,
    alphas_at_once: bool = False,
    say: Callable[[str], None] = lambda line: None,
    significance: float = SIGNIFICANCE,
) -> tuple[dict, list[dict]]:
    """(the chosen decoding settings, every row scored). `translate(lines, **settings)`; `decoding` holds the
    starting settings: its alpha is the choice each alpha is measured against, its beam the one they are decoded at,
    and its length limit the one doubled last. Three steps (length penalty, beam, length limit), each keeping the
    current choice unless a row beats it clearly (Grid.step: higher sacreBLEU and paired bootstrap p < significance);
    `say` gets a line per step that says why. Each row reaches `report` as it is scored; a row whose translations run
    away (RUNAWAY) is abandoned early, with bleu None and why. alphas_at_once: `translate` takes a list of alphas
    (search.translate_lines, our engine): the alpha rows come from one search."""
    grid = Grid(translate, sources, references, tgt_lang, decoding, report, say, significance)
    if alphas_at_once and len(alphas) > 1:
        settings = {k: v for k, v in decoding.items() if k in SETTINGS and k != "alpha"}
        scored, seconds = alphas_in_one_search(translate, sources, references, tgt_lang, settings, list(alphas))
        shared = f"one search for {len(alphas)} alphas: {seconds:.1f} s"
        for alpha in alphas:
            grid.add({**settings, "alpha": alpha}, scored[alpha], seconds / len(alphas), search=shared)
    else:
        for alpha in alphas:
            grid.run(alpha=alpha)
    current = next((r for r in grid.rows if r["alpha"] == decoding["alpha"]), None)
    if current is None:  # the starting alpha is not in the grid: the grid's best is the choice to beat
        current = max(grid.rows, key=best_first)
        say(f"length penalty: the starting alpha {decoding['alpha']} is not in the grid; its best, {current['alpha']}")
    current = grid.step("length penalty", current, grid.rows)
    for beam in beams:
        if beam != current["beam_size"]:
            grid.run(alpha=current["alpha"], beam_size=beam)
    current = grid.step("beam", current, [r for r in grid.rows if r["alpha"] == current["alpha"]])
    # Does the length limit bind? Twice the offset: where no translation changes, it did not.
    longer = grid.run(**{**current, "max_len_b": 2 * current["max_len_b"]})
    chosen = grid.step("length limit", current, [longer])
    return {k: chosen[k] for k in SETTINGS}, grid.rows


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
    check_settings(chosen, path)
    return chosen, (
        f"decoding: beam {chosen['beam_size']}, alpha {chosen['alpha']}, max length {chosen['max_len_a']} x source + "
        f"{chosen['max_len_b']}, chosen on the {split} split by make tune ({path}); tuned=false for conf/decoding's"
    )


# What make tune's record may hold for each setting: (a whole number only, the least value, what it is)
SETTING_KINDS = {
    "beam_size": (True, 1, "a whole number of hypotheses, at least 1"),
    "alpha": (False, 0, "a length penalty exponent, a number at least 0"),
    "max_len_a": (False, 0, "a number at least 0 (the length limit's factor of the source length)"),
    "max_len_b": (True, 0, "a whole number at least 0 (the length limit's offset)"),
}


def check_settings(chosen, path: Path) -> None:
    """make tune's record's settings each of the kind beam search takes (a hand-edited record may not be), or one
    line naming the file, the setting and the fix."""
    fix = "correct it, or delete the file to decode as conf/decoding says (make tune writes it again)"
    if not isinstance(chosen, dict):
        raise InputError(f"{path}: 'decoding' holds {chosen!r}, not the settings {', '.join(SETTINGS)}; {fix}")
    for key, (whole, least, what) in SETTING_KINDS.items():
        if key not in chosen:
            raise InputError(f"{path}: decoding.{key} is missing ({what}); {fix}")
        value = chosen[key]
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (whole and not isinstance(value, int)) or value < least:
            raise InputError(f"{path}: decoding.{key}={json.dumps(value)} is not {what}; {fix}")


TABLE_HEADER = f"{'beam':>4} {'alpha':>5} {'max len':>10} {'sacreBLEU':>9} {'chrF':>6} {'BP':>6} {'ratio':>6} {'s':>6}"


def table_row(r: dict) -> str:
    """One setting of the grid for a person: its sacreBLEU, chrF, brevity penalty, length ratio and seconds."""
    limit = f"{r['max_len_a']:g}x+{r['max_len_b']}"
    shared = f" ({r['search']})" if "search" in r else ""  # the alpha rows of one search: its time, shared
    if r["bleu"] is None:
        return f"{r['beam_size']:>4} {r['alpha']:>5} {limit:>10} {r['abandoned']} ({r['seconds']:.1f} s){shared}"
    return (
        f"{r['beam_size']:>4} {r['alpha']:>5} {limit:>10} {r['bleu']:>9.2f} {r['chrf']:>6.2f} "
        f"{r['brevity_penalty']:>6.3f} {r['length_ratio']:>6.3f} {r['seconds']:>6.1f}{shared}"
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
