"""make tune's record beside a checkpoint, <name>.decoding.json: the chosen settings, the split, the grid's rows and the
checkpoint's SHA-256. make translate and evaluate use it while those bytes hold (tuned=auto)."""

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
    record = {
        "decoding": chosen.settings(),
        "chosen_on": split,
        "chosen_by": "make tune",
        "checkpoint_sha256": file_digest(Path(ckpt)),
    }
    with atomic_write(tuned_path(ckpt)) as tmp:
        tmp.write_text(json.dumps(record | {"grid": rows}, indent=2) + "\n", encoding="utf-8")
    return tuned_path(ckpt)


def decoding_for(
    ckpt: str | Path, configured: Decoding, tuned: bool | str, given: bool, say: Callable[[str], None]
) -> Decoding:
    """conf/decoding's settings, or with no decoding key `given` make tune's record for ckpt (tuned=auto, the default);
    tuned=false: never. `say` gets which, in one line."""
    if tuned not in (False, "auto"):
        raise InputError(f"tuned={tuned}: auto (make tune's settings, where it chose some) or false")
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
        raise InputError(f"{e}; correct it, or delete it for conf/decoding's (make tune rewrites it)") from None
    say(f"decoding: {decoding.text()}, chosen on the {split} split by {by} ({path}); tuned=false for conf/decoding's")
    return decoding
