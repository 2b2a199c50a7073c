"""Decoding settings chosen on the development set (§6.1), for make tune: alpha, beam, length limit."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from functools import partial

from transformer_mt.decoding import PAPER, Decoding
from transformer_mt.scoring import evaluate_translations, paired_bootstrap_p

DETAIL = re.compile(r"BP = ([\d.]+) ratio = ([\d.]+)")
# A row is abandoned once a fifth of the split (CHUNKS) comes out RUNAWAY times longer than both the references and
# the first row (the first row: than the references; a weak model at a strong penalty decoded to the length limit: 7x
# alpha 0.6's time), so no row passes 4x the references' length. Length in characters: a weak model's "Ein Mann
# Mann......" is 3 words, and rows of it ran at 5-9x the references' length.
RUNAWAY, CHUNKS = 2.0, 5
SIGNIFICANCE = 0.05  # a row wins only at paired bootstrap p below this: 26.92 against 26.91 is luck
TABLE_HEADER = f"{'beam':>4} {'alpha':>5} {'max len':>10} {'sacreBLEU':>9} {'chrF':>6} {'BP':>6} {'ratio':>6} {'s':>6}"


class RunAway(Exception):
    pass


def table_row(r: dict) -> str:
    limit = f"{r['max_len_a']:g}x+{r['max_len_b']}"
    if r["bleu"] is None:
        return f"{r['beam_size']:>4} {r['alpha']:>5} {limit:>10} {r['abandoned']} ({r['seconds']:.1f} s)"
    return (
        f"{r['beam_size']:>4} {r['alpha']:>5} {limit:>10} {r['bleu']:>9.2f} {r['chrf']:>6.2f} "
        f"{r['brevity_penalty']:>6.3f} {r['length_ratio']:>6.3f} {r['seconds']:>6.1f}"
    )


def best_first(row: dict) -> tuple:
    """The highest sacreBLEU; a tie goes to the paper's settings, then the smaller beam and alpha."""
    paper = row["beam_size"] == PAPER.beam_size and row["alpha"] == PAPER.alpha
    return (-1.0 if row["bleu"] is None else row["bleu"], paper, -row["beam_size"], -row["alpha"])


class Grid:
    """The rows scored so far, each with its translations, and the step that chooses among them."""

    def __init__(self, translate, sources, references, tgt_lang, say, significance) -> None:
        self.translate, self.sources, self.references, self.tgt_lang = translate, sources, list(references), tgt_lang
        self.say, self.significance = say, significance
        self.rows: list[dict] = []
        self.outputs: list[list[str] | None] = []  # rows[i]'s translations (None: abandoned)

    def checked(self, settings: dict, lines: list[str]) -> list:
        """translate at `settings` in CHUNKS parts, raising RunAway if the output runs away."""
        first = self.outputs[0] if self.outputs and self.outputs[0] is not None else self.references
        usual = [max(len(r), len(h)) for r, h in zip(self.references, first)]
        size, done = max(1, -(-len(lines) // CHUNKS)), []
        for start in range(0, len(lines), size):
            done += self.translate(lines[start : start + size], **settings)
            length, expected = sum(map(len, done)), max(sum(usual[: len(done)]), 1)
            if len(done) < len(lines) and length > RUNAWAY * expected:
                raise RunAway(
                    f"abandoned: {length / expected:.2f}x the usual length in characters after "
                    f"{len(done):,} of {len(lines):,} sentences"
                )
        return done

    def run(self, decoding: Decoding) -> dict:
        start, settings = time.perf_counter(), decoding.settings()
        try:
            translate = partial(self.checked, settings)
            _, best, scores = evaluate_translations(translate, self.sources, self.references, self.tgt_lang)
        except RunAway as e:
            row, best = {**settings, "bleu": None, "abandoned": str(e)}, None
        else:
            bp, ratio = map(float, DETAIL.search(scores["bleu_detail"]).groups())
            row = {**settings, "bleu": scores["bleu"], "bleu_signature": scores["bleu_signature"]}
            row |= {"chrf": scores["chrf"], "brevity_penalty": bp, "length_ratio": ratio}
        self.rows.append(row | {"seconds": round(time.perf_counter() - start, 1)})
        self.outputs.append(best)
        self.say(table_row(self.rows[-1]))
        return self.rows[-1]

    def step(self, what: str, current: dict, candidates: list[dict]) -> dict:
        """The best of `candidates` where it beats `current` clearly (significance), else `current`; says why."""
        rest = [row for row in candidates if row is not current]
        best = max(rest, key=best_first) if rest else None
        mine, theirs = Decoding.of(current).text(), best and Decoding.of(best).text()
        if best is None or best["bleu"] is None:
            self.say(f"{what}: kept {mine}: nothing else was scored")
            return current
        ours, others = (self.outputs[self.rows.index(row)] for row in (current, best))
        if others == ours:
            self.say(f"{what}: kept {mine}: {theirs} gives the same translations")
            return current
        if current["bleu"] is None:
            self.say(f"{what}: chose {theirs}: {mine} was abandoned")
            return best
        scores = f"{best['bleu']:.2f} against {current['bleu']:.2f} ({best['bleu'] - current['bleu']:+.2f})"
        if best["bleu"] <= current["bleu"]:
            self.say(f"{what}: kept {mine}: the best other, {theirs}, scored {scores}")
            return current
        p = paired_bootstrap_p(ours, others, self.references)
        won = p < self.significance or self.significance >= 1
        test = f"paired bootstrap p = {p:.3f} ({'' if won else 'not '}< {self.significance:g})"
        verdict = f"chose {theirs} over {mine}: {scores}" if won else f"kept {mine}: {theirs} scored {scores}"
        self.say(f"{what}: {verdict}, {test}")
        return best if won else current


def search_grid(
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
    """(the chosen settings, every row). `translate(lines, **settings)`; `decoding` starts the grid: its alpha is
    the choice to beat, its beam the alphas', its length offset the one doubled. `say` gets the table and each why."""
    say(TABLE_HEADER)
    grid = Grid(translate, sources, references, tgt_lang, say, significance)
    for alpha in alphas:
        grid.run(decoding.but(alpha=alpha))
    current = next((r for r in grid.rows if r["alpha"] == decoding.alpha), None)
    if current is None:  # the starting alpha is not in the grid: the grid's best is the choice to beat
        current = max(grid.rows, key=best_first)
        say(f"length penalty: the starting alpha {decoding.alpha} is not in the grid; its best, {current['alpha']}")
    current = grid.step("length penalty", current, grid.rows)
    for beam in beams:
        if beam != current["beam_size"]:
            grid.run(Decoding.of(current).but(beam_size=beam))
    current = grid.step("beam", current, [r for r in grid.rows if r["alpha"] == current["alpha"]])
    # Does the length limit bind? Twice the offset: where no translation changes, it did not.
    longer = grid.run(Decoding.of(current).but(max_len_b=2 * current["max_len_b"]))
    return Decoding.of(grid.step("length limit", current, [longer])), grid.rows
