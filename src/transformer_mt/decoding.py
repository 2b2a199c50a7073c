"""The decoding settings of §6.1 as one frozen type, and a long decode's progress line, importable without torch:
the paper's defaults are written here and nowhere else (configs.py stores them as the config decoding=beam; the tune
grid's keys read TUNE_GRID through ${tune_grid:...}).

A hypothesis Y scores log P(Y) / ((5 + |Y|) / 6)^alpha, GNMT's length penalty (Wu et al., 2016), as §6.1 uses
(search.length_penalty). fairseq's --lenpen, transformers and CTranslate2 divide by |Y|^alpha instead, a different
function: length_penalty="fairseq" (alpha 1: the mean log-probability per token). For GNMT's, the exports and
engine=ct2 use the |Y|^a that comes closest (docs/inference.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from transformer_mt.errors import InputError

# On Multi30k test2016, |Y|^0.45 with early_stopping="never" picked our alpha-0.6 translation for 99.2% of the
# sentences (|Y|^0.6: 96.7%): docs/inference.md. Measured at the paper's alpha; scaled with alpha elsewhere.
HF_LENGTH_PENALTY = 0.45

# What each setting may hold: (a whole number only, the least value, what it is)
KINDS = {
    "beam_size": (True, 1, "a whole number of hypotheses, at least 1"),
    "alpha": (False, 0, "a length penalty exponent, a number at least 0"),
    "max_len_a": (False, 0, "a number at least 0 (the length limit's factor of the source length)"),
    "max_len_b": (True, 0, "a whole number at least 0 (the length limit's offset)"),
}
LENGTH_PENALTIES = ("gnmt", "fairseq")  # ((5 + |Y|) / 6)^alpha (§6.1's), |Y|^alpha (fairseq's --lenpen)


@dataclass(frozen=True)
class Decoding:
    """§6.1's search: beam 4, GNMT's length penalty at alpha 0.6, at most max_len_a x source length + max_len_b
    tokens."""

    beam_size: int = 4
    alpha: float = 0.6
    max_len_a: float = 1.0
    max_len_b: int = 50
    length_penalty: str = "gnmt"

    @classmethod
    def of(cls, settings: Mapping, where: str = "decoding") -> Decoding:
        """From a mapping of the four settings (conf/decoding, make tune's record, results.json); a missing or
        wrong one is one line naming `where`, the setting and what it must be."""
        if not isinstance(settings, Mapping):
            raise InputError(f"{where}: {settings!r} is not the settings {', '.join(KINDS)}")
        for key, (whole, least, what) in KINDS.items():
            if key not in settings:
                raise InputError(f"{where}: decoding.{key} is missing ({what})")
            value = settings[key]
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not number or (whole and not isinstance(value, int)) or value < least:
                raise InputError(f"{where}: decoding.{key}={json.dumps(value)} is not {what}")
        penalty = settings.get("length_penalty", "gnmt")  # results.json and tune records before it was a choice
        if penalty not in LENGTH_PENALTIES:
            raise InputError(
                f"{where}: decoding.length_penalty={penalty!r} is not one of {', '.join(LENGTH_PENALTIES)}"
            )
        return cls(**{key: settings[key] for key in KINDS}, length_penalty=penalty)

    def settings(self) -> dict:
        """The settings as keyword arguments of search.translate_lines (and as JSON)."""
        return dataclasses.asdict(self)

    def but(self, **changes) -> Decoding:
        return dataclasses.replace(self, **changes)

    @property
    def ct2_length_penalty(self) -> float:
        """CTranslate2's |Y|^a exponent: fairseq's alpha, or the closest to GNMT's (0.45 for 0.6, HF_LENGTH_PENALTY)."""
        return self.alpha if self.length_penalty == "fairseq" else HF_LENGTH_PENALTY / PAPER.alpha * self.alpha

    def text(self) -> str:
        penalty = f"alpha {self.alpha}" if self.length_penalty == "gnmt" else f"length penalty |Y|^{self.alpha:g}"
        return f"beam {self.beam_size}, {penalty}, max length {self.max_len_a:g} x source + {self.max_len_b}"


PAPER = Decoding()
# make tune's grid (evaluation/grid.py), conf/tune.yaml through ${tune_grid:...}
TUNE_GRID = {"alphas": [0.0, 0.3, 0.6, 1.0, 1.5, 2.0], "beams": [2, 4, 8]}


class Heartbeat:
    """report(how far) once EVERY seconds have passed since the last: a long decode says so in a log, once a minute."""

    EVERY = 60.0

    def __init__(self, report: Callable[[str], None] | None, total: int):
        self.report, self.total, self.last = report, total, time.monotonic()

    def __call__(self, done: int) -> None:
        if self.report is not None and done < self.total and time.monotonic() - self.last >= self.EVERY:
            self.last = time.monotonic()
            self.report(f"{done:,} of {self.total:,} sentences decoded")
