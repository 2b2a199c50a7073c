"""Writing files so that a crash never leaves a half-written one, and errors a user can act on."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
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


def exit_on_user_error(fn: Callable, *args):
    """fn(*args) as a Hydra task; a UserError ends the program with one `error: ...` line on stderr
    and exit status 1 (with HYDRA_FULL_ERROR=1, the full traceback instead), and a run folder that
    holds nothing but Hydra's own files is removed. In a sweep the error is raised on after its
    line, so that Hydra records the failed job and the other jobs still run."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415 (only entry points use Hydra)
    from hydra.types import RunMode  # noqa: PLC0415

    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None  # None: a plain argparse tool
    try:
        return fn(*args)
    except UserError as e:
        if hydra_cfg is not None:
            remove_if_empty(Path(hydra_cfg.runtime.output_dir))
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN:
            raise
        raise SystemExit(1) from None


def required(cfg, key: str):
    """cfg[key], or a one-line error when it is Hydra's `???` (not given on the command line)."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    if OmegaConf.is_missing(cfg, key):
        raise MissingInputError(f"{key} is required: add {key}=<value> (make ... {key.upper()}=<value>)")
    return cfg[key]


def remove_if_empty(run_dir: Path) -> None:
    """Remove a run folder that holds only Hydra's files (.hydra/, <job>.log), and the folders above
    it that it leaves empty, up to the working directory (outputs/<date>/ and outputs/)."""
    cwd, run_dir = Path.cwd().resolve(), run_dir.resolve()
    if run_dir == cwd or run_dir in cwd.parents:  # translate runs in "."; never remove the working directory
        return
    if not run_dir.is_dir() or any(p.name != ".hydra" and p.suffix != ".log" for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in run_dir.parents:
        if parent == cwd or cwd not in parent.parents or any(parent.iterdir()):
            break
        try:
            parent.rmdir()
        except OSError:
            break


TMP_MARK = ".tmp-"  # .<name>.tmp-<host>-<pid>-<random>


@contextmanager
def atomic_write(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `target` (a file or a directory); rename it to `target`
    when the block succeeds, remove it when it fails.

    The rename is atomic: readers see the old content or the new, never part of it. The
    temporary name is unique to this write. A directory that another process renamed into place
    first is kept.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # host, process and a random part: ranks on nodes that share the folder never share a temporary name
    tmp = target.with_name(f".{target.name}{TMP_MARK}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
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


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove the temporary files and folders that atomic_write left in `directory` (or a folder
    inside it) when its process was killed: those of this host whose process is gone (another
    host's may still be writing)."""
    host, removed = socket.gethostname(), []
    found = [*directory.glob(f".*{TMP_MARK}*"), *directory.glob(f"*/.*{TMP_MARK}*")] if directory.is_dir() else []
    for path in found:
        owner = path.name.rsplit(TMP_MARK, 1)[1].rsplit("-", 2)
        if len(owner) == 3 and owner[0] == host and owner[1].isdigit() and not process_exists(int(owner[1])):
            remove(path)
            removed.append(path)
    return removed


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
