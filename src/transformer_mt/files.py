"""Files: atomic writes (a crash never leaves a half-written file), stale temporaries, reading UTF-8 lines, a
file's SHA-256, and a training run's folder (RunFolder: the names in it, its lock)."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.errors import InputError, MissingInputError

log = logging.getLogger(__name__)
RESULTS = "results.json"  # in a run folder: the end-of-run protocol's scores (results.py)
TMP_MARK = ".tmp-"  # .<name>.tmp-<host>-<pid>-<random>


@contextmanager
def atomic_write(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `target` (a file or a directory); rename it to `target`
    when the block succeeds, remove it when it fails.

    The rename is atomic: readers see the old content or the new, never part of it. The
    temporary name is unique to this write. A directory that another process renamed into place
    first is kept. Temporaries of the same target left by killed writers (make export, make
    average, a cache) are removed first.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(target.name)}{TMP_MARK}*"):  # of this target, by killed writers
        if is_stale(stale):
            remove(stale)
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
    removed = []
    found = [*directory.glob(f".*{TMP_MARK}*"), *directory.glob(f"*/.*{TMP_MARK}*")] if directory.is_dir() else []
    for path in found:
        if is_stale(path):
            remove(path)
            removed.append(path)
    return removed


def is_stale(path: Path) -> bool:
    """A temporary of atomic_write whose writer, a process of this host, is gone."""
    owner = path.name.rsplit(TMP_MARK, 1)[1].rsplit("-", 2)
    return (
        len(owner) == 3
        and owner[0] == socket.gethostname()
        and owner[1].isdigit()
        and not process_exists(int(owner[1]))
    )


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def decode_line(line: bytes, number: int, where: str) -> str:
    """One line of UTF-8 bytes as text, without its "\\n" (and, on line 1, a byte-order mark: not text, it would
    stay glued to the first sentence, e.g. in BLEU references); invalid UTF-8 names `where` and the line."""
    try:
        text = line.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}, line {number}: invalid UTF-8 ({e.reason} at byte {e.start} of the line); "
            "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    return text.removesuffix("\n")


def iter_lines(path: str | Path) -> Iterator[str]:
    """Lines of a UTF-8 file, one at a time (a file is never held whole), split on "\\n" only:
    str.splitlines() also splits on U+0085, which occurs inside WMT sentences."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"no such file: {path}")
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            yield decode_line(line, number, str(path))


def read_lines(path: str | Path) -> list[str]:
    return list(iter_lines(path))


class RunFolderLock:
    """Holds <run>/.lock (an flock) for a training's lifetime: a second training started into the same
    folder is refused in one line naming the holder, instead of both writing the same checkpoints and
    log. The lock goes with its process, however it ends (even SIGKILL): a stale .lock file is taken
    over. Hydra writes the refused start's own .hydra/ files before it runs; the holder writes its
    own back when it ends."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = RunFolder(run_dir).lock_file
        self.fd: int | None = None
        self.hydra: dict[Path, bytes] = {}

    def __enter__(self) -> RunFolderLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise InputError(
                f"{self.run_dir} is in use by another training ({holder}); two trainings in one folder "
                "overwrite each other's checkpoints and log. Wait for it to end, or start this one in another "
                "folder (hydra.run.dir=...)"
            ) from None
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode(), 0)
        self.fd = fd
        self.hydra = {p: p.read_bytes() for p in (self.run_dir / ".hydra").glob("*.yaml")}
        return self

    def __exit__(self, *exc) -> None:
        for path, content in self.hydra.items():  # a refused start may have rewritten them
            with contextlib.suppress(OSError):
                if not path.is_file() or path.read_bytes() != content:
                    path.write_bytes(content)
        os.close(self.fd)  # releases the lock; the file stays, free for the next start


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes (which checkpoint an export or make tune's record was made from)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class RunFolder:
    """A training run's folder and the names in it: checkpoints/ (training's step<N>.ckpt, last.ckpt and
    best.ckpt; the end-of-run protocol's average-last<N>.ckpt and ema.ckpt), results.json, and .lock, which a
    training holds while it runs (RunFolderLock)."""

    path: Path

    CHECKPOINTS, LAST, BEST, EMA, AVERAGE, LOCK = (
        "checkpoints",
        "last.ckpt",
        "best.ckpt",
        "ema.ckpt",
        "average-",
        ".lock",
    )

    @staticmethod
    def average_name(n: int) -> str:
        return f"{RunFolder.AVERAGE}last{n}.ckpt"

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def last(self) -> Path:
        return self.checkpoints / self.LAST

    @property
    def best(self) -> Path:
        return self.checkpoints / self.BEST

    @property
    def ema(self) -> Path:
        return self.checkpoints / self.EMA

    def average(self, n: int) -> Path:
        return self.checkpoints / self.average_name(n)

    @property
    def results(self) -> Path:
        return self.path / RESULTS

    @property
    def lock_file(self) -> Path:
        return self.path / self.LOCK

    def lock(self) -> RunFolderLock:
        return RunFolderLock(self.path)

    def in_use(self) -> bool:
        """Whether a training holds the folder's lock (RunFolderLock)."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def remove_if_empty(self) -> None:
        """Remove the folder if it holds only Hydra's files (.hydra/, <job>.log) and a free .lock, and the folders
        above it that it leaves empty, up to the working directory (outputs/<date>/ and outputs/): a command that
        failed on bad input leaves no folder behind."""
        cwd, run_dir = Path.cwd().resolve(), self.path.resolve()
        if run_dir == cwd or run_dir in cwd.parents:  # translate runs in "."; never remove the working directory
            return
        hydra_only = (".hydra", self.LOCK)  # and the logs
        if not run_dir.is_dir() or any(p.name not in hydra_only and p.suffix != ".log" for p in run_dir.iterdir()):
            return
        if self.in_use():  # a start refused there: the folder is another training's, still building its data
            return
        shutil.rmtree(run_dir, ignore_errors=True)
        for parent in run_dir.parents:
            if parent == cwd or cwd not in parent.parents or any(parent.iterdir()):
                break
            try:
                parent.rmdir()
            except OSError:
                break

    def holder(self) -> str:
        """Who holds the lock, as its file says (pid, host, since when)."""
        return self.lock_file.read_text(encoding="utf-8", errors="replace").strip() or "a process"

    def keep_earlier_results(self) -> Path | None:
        """An earlier results.json of the run (make finish on a finished run, a run extended and finished again) is
        kept beside the new one as results.<n>.json, the first free n, and the log says so: nothing is overwritten."""
        if not self.results.is_file():
            return None
        n = 1
        while (kept := self.results.with_name(f"{self.results.stem}.{n}{self.results.suffix}")).exists():
            n += 1
        self.results.rename(kept)
        log.warning("%s was there already (an earlier end of this run): kept as %s, beside the new one", self.results,
                    kept.name)  # fmt: skip
        return kept
