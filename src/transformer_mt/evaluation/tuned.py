"""The record of a grid's choice beside a checkpoint, <name>.decoding.json: the chosen settings, who chose them (make
tune, or the end of a run's final.tune), the grid's rows and the checkpoint's SHA-256. make translate and evaluate use
make tune's while those bytes hold (tuned=auto); the end of a run's only when asked (tuned=true): a significant gain on
Multi30k's validation split did not carry over to its test sets (issue 56: -0.55 BLEU on test2016)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from transformer_mt.decoding import Decoding
from transformer_mt.errors import InputError
from transformer_mt.files import atomic_write, file_digest


def tuned_path(ckpt: str | Path) -> Path:
    ckpt = Path(ckpt)
    return ckpt.with_name(ckpt.name.removesuffix(".ckpt") + ".decoding.json")


MAKE_TUNE, RUN_END = "make tune", "final.tune"  # who chose: the record's chosen_by


def save_tuned(ckpt: str | Path, chosen: Decoding, rows: list[dict], split: str, by: str) -> Path:
    record = {"decoding": chosen.settings(), "chosen_on": split, "chosen_by": by,
              "checkpoint_sha256": file_digest(Path(ckpt))}  # fmt: skip
    with atomic_write(tuned_path(ckpt)) as tmp:
        tmp.write_text(json.dumps(record | {"grid": rows}, indent=2) + "\n", encoding="utf-8")
    return tuned_path(ckpt)


def decoding_for(
    ckpt: str | Path, configured: Decoding, tuned: bool | str, given: bool, say: Callable[[str], None]
) -> Decoding:
    """conf/decoding's settings, or with no decoding key `given` the record's for ckpt: make tune's (tuned=auto, the
    default), or whoever chose them (tuned=true); tuned=false: never. `say` gets which, in one line."""
    if tuned not in (True, False, "auto"):
        raise InputError(f"tuned={tuned}: auto (make tune's settings), true (also the end of a run's) or false")
    path = tuned_path(ckpt)
    if tuned is False or given or not path.is_file():
        return configured
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        chosen, split, by, digest = (record[k] for k in ("decoding", "chosen_on", "chosen_by", "checkpoint_sha256"))
    except (OSError, ValueError, KeyError, TypeError):
        say(f"{path} is not make tune's record: decoding as conf/decoding says")
        return configured
    if digest != file_digest(Path(ckpt)):
        say(f"{path} was chosen for another version of {ckpt}: decoding as conf/decoding says (make tune again)")
        return configured
    try:
        decoding = Decoding.of(chosen, where=str(path))
    except InputError as e:
        raise InputError(f"{e}; correct it, or delete the file to decode as conf/decoding says (make tune writes it "
                         "again)") from None  # fmt: skip
    if by != MAKE_TUNE and tuned is not True:
        say(f"decoding: {configured.text()} (conf/decoding); the end of the run chose {decoding.text()} on the "
            f"{split} split ({path}): tuned=true decodes with those, make tune chooses again")  # fmt: skip
        return configured
    say(f"decoding: {decoding.text()}, chosen on the {split} split by {by} ({path}); tuned=false for "
        "conf/decoding's")  # fmt: skip
    return decoding
