"""Errors a user can act on: bad input or configuration, reported by the entry points in one line."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable


class UserError(Exception):
    """Bad input or configuration. The message names the file, line or key and the fix; entry
    points print it as one `error: ...` line instead of a traceback."""


class InputError(UserError, ValueError):
    """A file or value that cannot be used as it is."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or directory that is not where the configuration says."""


def exit_on_user_error(fn: Callable, *args, cleanup: Callable | None = None, failed: Callable | None = None):
    """fn(*args); a UserError ends the program with one `error: ...` line on stderr and exit status 1 (with
    HYDRA_FULL_ERROR=1, the full traceback instead). cleanup: called first (an entry point's run folder removed
    if it holds nothing but Hydra's own files); failed: the exception to end with instead of exit status 1 (a
    sweep's job: commandline.run_task)."""
    try:
        try:
            return fn(*args)
        except OSError as e:
            if (fault := write_fault(e)) is None:
                raise
            raise fault from None
    except UserError as e:
        if cleanup is not None:
            cleanup()
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        if failed is not None:
            raise failed() from None
        raise SystemExit(1) from None


# A write the machine refused: a full disk or quota, a file-size limit, a read-only or forbidden folder.
WRITE_FAULTS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def write_fault(e: OSError) -> InputError | None:
    """An OSError of WRITE_FAULTS as one line a user can act on (None: another fault). Checkpoints, exports, caches
    and make tune's record are written through files.atomic_write: the one cut short is removed."""
    if e.errno not in WRITE_FAULTS:
        return None
    where = f" ({e.filename})" if e.filename else ""
    return InputError(
        f"a write was refused{where}: {e.strerror} (a full disk or quota, a file-size limit, or a folder that cannot "
        "be written); free space there or write elsewhere, then run the command again"
    )


def required(cfg, key: str):
    """cfg[key], or a one-line error when it is Hydra's `???` (not given on the command line)."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    if OmegaConf.is_missing(cfg, key):
        raise MissingInputError(f"{key} is required: add {key}=<value> (make ... {key.upper()}=<value>)")
    return cfg[key]
