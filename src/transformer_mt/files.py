"""Files: atomic writes, reading UTF-8 lines, a file's SHA-256, and a training run's folder (its names, its lock,
the commands that use its model)."""

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from transformer_mt.errors import InputError, MissingInputError

log = logging.getLogger(__name__)
RESULTS = "results.json"  # in a run folder: the end-of-run protocol's scores (results.py)
TMP_MARK = ".tmp-"  # .<name>.tmp-<host>-<pid>-<random>


@contextmanager
def atomic_write(target: str | Path) -> Iterator[Path]:
    """A temporary path beside `target` (file or folder), renamed to it when the block succeeds, else removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in filter(is_stale, target.parent.glob(f".{glob.escape(target.name)}{TMP_MARK}*")):  # by killed writers
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


def remove_stale_temporaries(directory: Path, say: Callable[[str], None]) -> None:
    """Remove atomic_write's temporaries in `directory` (or a folder in it) whose writer, of this host, is gone."""
    for path in filter(is_stale, [*directory.glob(f".*{TMP_MARK}*"), *directory.glob(f"*/.*{TMP_MARK}*")]):
        remove(path)
        say(f"removed {path} (the unfinished write of a killed process)")


def is_stale(path: Path) -> bool:
    owner = path.name.rsplit(TMP_MARK, 1)[1].rsplit("-", 2)  # host, pid, a random part
    if len(owner) != 3 or owner[0] != socket.gethostname() or not owner[1].isdigit():
        return False
    try:
        os.kill(int(owner[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        pass
    return False


def decode_line(line: bytes, number: int, where: str) -> str:
    """UTF-8 bytes as text, without "\\n" nor, on line 1, a byte-order mark; invalid UTF-8 names `where`, the line."""
    try:
        text = line.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}, line {number}: invalid UTF-8 ({e.reason} at byte {e.start} of the line); "
            "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    return text.removesuffix("\n")


def iter_lines(path: str | Path) -> Iterator[str]:
    """Lines of a UTF-8 file, split on "\\n" only (splitlines() splits on U+0085, in WMT sentences)."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"no such file: {path}")
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            yield decode_line(line, number, str(path))


def read_lines(path: str | Path) -> list[str]:
    return list(iter_lines(path))


def file_digest(*paths: Path, algorithm: Callable = hashlib.sha256) -> str:
    """The files' bytes, one after the other, hashed: by default a SHA-256 (which checkpoint an export or make tune's
    record was made from)."""
    digest = algorithm()
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def shown(path: Path) -> str:
    """A path relative to the working directory when it is below it (what a user types)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def next_commands(model: Path) -> list[str]:
    """The commands that use a run's model, as the end of a run and make finish print them."""
    return [
        f"  make evaluate CKPT={shown(model)}",
        f'  echo "A sentence to translate." | make translate CKPT={shown(model)}',
    ]


class RunFolderLock:
    """<run>/.lock, an flock held for a training's lifetime (SIGKILL releases it): a second training is refused."""

    def __init__(self, run_dir: Path):
        self.run = RunFolder(run_dir)

    def __enter__(self) -> RunFolderLock:
        self.run.path.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.run.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise InputError(
                f"{self.run.path} is in use by another training ({self.run.holder()}); two trainings in one folder "
                "overwrite each other's checkpoints and log. Wait for it to end, or start this one in another "
                "folder (hydra.run.dir=...)"
            ) from None
        os.ftruncate(self.fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode(), 0)
        return self

    def __exit__(self, *exc) -> None:
        os.ftruncate(self.fd, 0)  # no holder now: a later start leaves the folder's files as it found them
        os.close(self.fd)  # releases the lock; the file stays, free for the next start


class RunFolder:
    """A run's folder: checkpoints/ (step<N>, last, best, average-last<N>, ema .ckpt), results.json, .lock."""

    LAST, BEST, AVERAGE = "last.ckpt", "best.ckpt", "average-"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.last, self.ema = self.checkpoints / self.LAST, self.checkpoints / "ema.ckpt"
        self.results, self.lock_file = self.path / RESULTS, self.path / ".lock"

    @staticmethod
    def average_name(n: int) -> str:
        return f"{RunFolder.AVERAGE}last{n}.ckpt"

    def in_use(self) -> bool:
        """Whether a training holds the folder's lock."""
        with contextlib.suppress(FileNotFoundError), open(self.lock_file) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
        return False

    def holder(self) -> str:
        """Who holds the lock (pid, host, since when)."""
        return self.lock_file.read_text(encoding="utf-8", errors="replace").strip() or "a process"

    def remove_if_empty(self) -> None:
        """A folder of a start's files only (Hydra's, the logs, the vocabulary's copy, the loggers' first files; no
        checkpoint) and a free .lock removed, and its emptied parents below the working directory."""
        cwd, run_dir = Path.cwd().resolve(), self.path.resolve()
        if run_dir == cwd or run_dir in cwd.parents:  # translate runs in "."; never remove the working directory
            return
        start_only = (".hydra", ".lock", "sentencepiece.model", "csv", "tensorboard", "wandb")  # and the logs
        if not run_dir.is_dir() or any(p.name not in start_only and p.suffix != ".log" for p in run_dir.iterdir()):
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

    def keep_earlier_results(self) -> None:
        """An earlier results.json (a run finished again) is kept as results.<n>.json, the first free n, and said."""
        if not self.results.is_file():
            return
        n = 1
        while (kept := self.results.with_name(f"{self.results.stem}.{n}{self.results.suffix}")).exists():
            n += 1
        self.results.rename(kept)
        log.warning("%s was there already (an earlier end of this run): kept as %s", self.results, kept.name)
