"""make tune's record beside a checkpoint, <name>.decoding.json: the settings chosen on the development set, the
grid's rows and the SHA-256 of the checkpoint; make translate and evaluate use it while those bytes hold."""

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


def save_tuned(ckpt: str | Path, chosen: Decoding, rows: list[dict], split: str) -> Path:
    path = tuned_path(ckpt)
    record = {
        "decoding": chosen.settings(),
        "chosen_on": split,
        "checkpoint_sha256": file_digest(Path(ckpt)),
        "grid": rows,
    }
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def read_tuned(ckpt: str | Path) -> tuple[Decoding | None, str]:
    """(make tune's settings for ckpt as it is now, or None; a line that says which and why)."""
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
    try:
        decoding = Decoding.of(chosen, where=str(path))
    except InputError as e:
        fix = "correct it, or delete the file to decode as conf/decoding says (make tune writes it again)"
        raise InputError(f"{e}; {fix}") from None
    return (
        decoding,
        f"decoding: {decoding.text()}, chosen on the {split} split by make tune ({path}); "
        "tuned=false for conf/decoding's",
    )


def decoding_for(
    ckpt: str | Path, configured: Decoding, tuned: bool, given: bool, say: Callable[[str], None]
) -> Decoding:
    """conf/decoding's settings (`configured`), or make tune's for this checkpoint when `tuned` and no decoding key
    was `given` on the command line; `say` gets the line that tells which."""
    if not tuned or given:
        return configured
    chosen, line = read_tuned(ckpt)
    if line:
        say(line)
    return chosen or configured
