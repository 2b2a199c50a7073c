"""Writing files so that a crash never leaves a half-written one, and errors a user can act on."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """Bad input or configuration. The message names the file, line or key and the fix; entry
    points print it as one `error: ...` line instead of a traceback."""


class InputError(UserError, ValueError):
    """A file or value that cannot be used as it is."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or directory that is not where the configuration says."""


def exit_on_user_error(fn: Callable, *args, cleanup: Callable[[], None] | None = None):
    """fn(*args); a UserError ends the program with one `error: ...` line on stderr and exit
    status 1 (with HYDRA_FULL_ERROR=1, the full traceback instead). `cleanup` runs first."""
    try:
        return fn(*args)
    except UserError as e:
        if cleanup is not None:
            cleanup()
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


@contextmanager
def atomic_write(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `target` (a file or a directory); rename it to `target`
    when the block succeeds, remove it when it fails.

    The rename is atomic: readers see the old content or the new, never part of it. The
    temporary name carries the process id, so that ranks writing the same target never share
    one. A directory that another process renamed into place first is kept.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    remove(tmp)
    try:
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    try:
        os.replace(tmp, target)
    except OSError:
        remove(tmp)
        if not target.is_dir():  # a directory that another rank renamed into place first is kept
            raise


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
