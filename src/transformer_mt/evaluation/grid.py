"""Decoding settings chosen on the development set, as the paper chose beam 4 and alpha 0.6 (§6.1): a grid
over the length penalty, then the beam size at the best alpha, then whether the output-length limit binds.
`make tune` (tune.py) and the end-of-run protocol (final.tune=true) run it on the validation split, never
on the test split; the choice is stored beside the checkpoint (tuned.py) and `make translate` / `make evaluate`
use it by default, saying so."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

from transformer_mt.decoding import PAPER, TUNE_GRID, Decoding
from transformer_mt.scoring import evaluate_translations, paired_bootstrap_p

DETAIL = re.compile(r"BP = ([\d.]+) ratio = ([\d.]+)")
# A setting whose translations run away (a weak model under a strong length penalty decodes to the length limit,
# 7x the time of alpha 0.6 once) is abandoned as soon as a part of the split (one of CHUNKS) ends RUNAWAY times
# longer, in words, than both the references and the grid's first row on the same sentences; it cannot win.
RUNAWAY, CHUNKS = 2.0, 5


class RunAway(Exception):
    """A grid row's translations ran away (RUNAWAY): the row is abandoned."""


def checked_for_runaway(translate: Callable[[list[str]], list], lengths: Sequence[int]) -> Callable:
    """`translate` over the split in CHUNKS parts; raises RunAway when the translations so far are RUNAWAY times
    longer in words than `lengths` (per sentence) on the same sentences."""

    def run(lines: list[str]) -> list:
        size, done = max(1, -(-len(lines) // CHUNKS)), []
        for start in range(0, len(lines), size):
            done += translate(lines[start : start + size])
            words, usual = sum(len(h.split()) for h in done), max(sum(lengths[: len(done)]), 1)
            if len(done) < len(lines) and words > RUNAWAY * usual:
                raise RunAway(f"abandoned: {words / usual:.2f}x the usual length after {len(done):,} of {len(lines):,} "
                              "sentences")  # fmt: skip
        return done

    return run


SETTINGS = tuple(PAPER.settings())
# A setting replaces the current choice only when it scores higher and sacreBLEU's paired bootstrap test (1,000
# resamples of the split's sentences) puts the difference beyond luck: p below this. A win of 26.92 against 26.91
# on 1,014 sentences is not one.
SIGNIFICANCE = 0.05


def setting_text(row: dict) -> str:
    return Decoding.of(row).text()


class Grid:
    """The rows of a tuning grid scored so far, each with its translations, and the steps that choose among them."""

    def __init__(self, translate, sources, references, tgt_lang, decoding, report, say, significance) -> None:
        self.translate, self.sources, self.references, self.tgt_lang = translate, sources, list(references), tgt_lang
        self.decoding, self.report, self.say, self.significance = decoding, report, say, significance
        self.rows: list[dict] = []
        self.outputs: list[list[str] | None] = []  # rows[i]'s translations (None: abandoned)

    def run(self, **changes) -> dict:
        """The row of the starting settings with `changes`, decoded and scored (abandoned if it runs away)."""
        settings = {k: v for k, v in {**self.decoding, **changes}.items() if k in SETTINGS}
        start = time.perf_counter()
        row_translate = lambda lines: self.translate(lines, **settings)  # noqa: E731
        if self.outputs:  # the grid's first row sets the usual length (with the references'); the others are checked
            usual = [max(len(r.split()), len(h.split())) for r, h in zip(self.references, self.outputs[0])]
            row_translate = checked_for_runaway(row_translate, usual)
        try:
            _, best, scores = evaluate_translations(row_translate, self.sources, self.references, self.tgt_lang)
        except RunAway as e:
            row, best = {**settings, "bleu": None, "abandoned": str(e)}, None
        else:
            bp, ratio = map(float, DETAIL.search(scores["bleu_detail"]).groups())
            row = {**settings, "bleu": scores["bleu"], "bleu_signature": scores["bleu_signature"]}
            row |= {"chrf": scores["chrf"], "brevity_penalty": bp, "length_ratio": ratio}
        self.rows.append(row | {"seconds": round(time.perf_counter() - start, 1)})
        self.outputs.append(best)
        self.report(self.rows[-1])
        return self.rows[-1]

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
    paper = row["beam_size"] == PAPER.beam_size and row["alpha"] == PAPER.alpha
    return (-1.0 if row["bleu"] is None else row["bleu"], paper, -row["beam_size"], -row["alpha"])


def search_grid(
    translate: Callable[..., list],
    sources: Sequence[str],
    references: Sequence[str],
    tgt_lang: str,
    decoding: Decoding,
    alphas: Sequence[float] = tuple(TUNE_GRID["alphas"]),
    beams: Sequence[int] = tuple(TUNE_GRID["beams"]),
    report: Callable[[dict], None] = lambda row: None,
    say: Callable[[str], None] = lambda line: None,
    significance: float = SIGNIFICANCE,
) -> tuple[Decoding, list[dict]]:
    """(the chosen decoding settings, every row scored). `translate(lines, **settings)`; `decoding` holds the
    starting settings: its alpha is the choice each alpha is measured against, its beam the one they are decoded at,
    and its length limit the one doubled last. Three steps (length penalty, beam, length limit), each keeping the
    current choice unless a row beats it clearly (Grid.step: higher sacreBLEU and paired bootstrap p < significance);
    `say` gets a line per step that says why. Each row reaches `report` as it is scored; a row whose translations run
    away (RUNAWAY) is abandoned early, with bleu None and why."""
    grid = Grid(translate, sources, references, tgt_lang, decoding.settings(), report, say, significance)
    decoding = decoding.settings()
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
    return Decoding.of(chosen), grid.rows


def grid_for_a_person(
    translate: Callable[..., list],
    sources: Sequence[str],
    references: Sequence[str],
    tgt_lang: str,
    decoding: Decoding,
    alphas: Sequence[float],
    beams: Sequence[int],
    say: Callable[[str], None],
    significance: float = SIGNIFICANCE,
) -> tuple[Decoding, list[dict]]:
    """search_grid with its table told through `say` (make tune's console, the end of a run's log): the header,
    each row as it is scored, and why each step kept or chose."""
    say(TABLE_HEADER)
    report = lambda row: say(table_row(row))  # noqa: E731
    return search_grid(translate, sources, references, tgt_lang, decoding, alphas, beams, report, say, significance)


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
