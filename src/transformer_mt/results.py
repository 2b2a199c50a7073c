"""results.json, the end-of-run protocol's record of a run, as one type (make finish, the model card, make table3)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from transformer_mt.decoding import Decoding
from transformer_mt.errors import InputError
from transformer_mt.files import atomic_write
from transformer_mt.runtime import duration, flops_text

# results.json's scores, logged as final/<model>/<split>/<name> (the name without "_compound_split")
SCORES = ("bleu", "chrf", "tokenized_bleu_compound_split", "bleu_tokens", "ppl")


@dataclass
class Results:
    updates: int | None = None
    train_seconds: float = 0.0
    target_tokens: int = 0
    target_tokens_per_second: int | None = None
    model_flops_per_second: float | None = None
    devices: int = 1
    mfu: float | None = None
    peak: str | None = None  # where the training device's peak FLOP/s came from (the MFU's denominator)
    peak_flops_per_second: float | None = None
    parameters: int | None = None
    decoding: dict = field(default_factory=dict)  # Decoding.settings() of the splits' scores in `models`
    table3_row: dict | None = None
    seed: int | None = None
    code: dict | None = None  # runtime.code_record() of the training (None: a run before it was recorded)
    overrides: list[str] | None = None
    finished_by: str | None = None
    models: dict[str, dict] = field(default_factory=dict)  # average-last5/last/ema -> checkpoint path, split scores
    evaluation_seconds: float | None = None

    @classmethod
    def read(cls, path: Path) -> Results:
        try:
            return cls(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as e:
            raise InputError(f"{path}: not a results.json of a run's end ({e}); make finish rewrites it") from None

    def write(self, path: Path) -> None:
        with atomic_write(path) as tmp:
            tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def scored(self) -> list[tuple[str, str, dict]]:
        """(model, split, scores) of every scored split."""
        found = [(name, split, s) for name, splits in self.models.items() for split, s in splits.items()]
        return [(name, split, s) for name, split, s in found if isinstance(s, dict) and "bleu" in s]

    def metrics(self) -> dict[str, float]:
        """final/<model>/<split>/<bleu|chrf|tokenized_bleu|ppl>, for the loggers."""
        return {
            f"final/{name}/{split}/{key.removesuffix('_compound_split')}": scores[key]
            for name, split, scores in self.scored()
            for key in SCORES
            if key in scores
        }

    def block(self, path: Path) -> str:
        """The log's summary: one line per evaluated model and split."""
        rate, flops, mfu = self.target_tokens_per_second, self.model_flops_per_second, self.mfu
        lines = [
            f"results ({path}): {self.updates:,} updates, {duration(self.train_seconds)} of training"
            + (f", {rate:,} target tok/s" if rate else "")
            + (f", {flops_text(flops)}" if flops else "")
            + (f" (MFU {mfu:.1%})" if mfu else "")
            + f", {self.parameters:,} parameters; "
            + Decoding.of(self.decoding).text()
        ]
        for name, split, s in self.scored():
            lines.append(
                f"  {name} on {split} ({s['sentences']:,} sentences): sacreBLEU {s['bleu']:.2f}, chrF {s['chrf']:.2f}, "
                f"tokenized compound-split BLEU {s['tokenized_bleu_compound_split']:.2f} (the paper's metric), "
                + (f"BLEU4 on the text's own tokens {s['bleu_tokens']:.2f}, " if "bleu_tokens" in s else "")
                + f"ppl {s['ppl']:.2f}\n    {s['bleu_signature']}"
            )
        return "\n".join(lines)

    def scores_of(self, ckpt: Path) -> dict[str, dict]:
        """The scored splits of the model from `ckpt` (by file name: a moved run finds them)."""
        of_ckpt = [name for name, entry in self.models.items() if Path(entry.get("checkpoint", "")).name == ckpt.name]
        return {split: scores for name, split, scores in self.scored() if name in of_ckpt}
