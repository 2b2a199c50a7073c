"""Errors a user can act on: bad input or configuration, reported by the entry points in one line."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from difflib import get_close_matches
from typing import NoReturn

from transformer_mt.stops import SIGNALS, Stopped, exit_stopped, raise_stopped


class UserError(Exception):
    """Bad input or configuration; the message names the file, line or key and the fix."""


class InputError(UserError, ValueError):
    """A file or value that cannot be used as it is."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or directory that is not where the configuration says."""


# A write the machine refused: a full disk or quota, a file-size limit, a read-only or forbidden folder.
WRITE_FAULTS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def exit_on_user_error(fn: Callable, *args, cleanup: Callable | None = None, failed: Callable | None = None):
    """fn(*args); a UserError or refused write: `cleanup`, one `error:` line, status 1 (or `failed()` raised); a stop
    signal (Ctrl+C, SIGTERM): `cleanup`, one `stopped` line, status 128 + it."""
    main = threading.current_thread() is threading.main_thread()
    before = {s: signal.signal(s, raise_stopped) for s in SIGNALS} if main else {}
    try:
        try:
            return fn(*args)
        except OSError as e:
            if e.errno not in WRITE_FAULTS:
                raise
            where = f" ({e.filename})" if e.filename else ""
            raise InputError(
                f"a write was refused{where}: {e.strerror} (a full disk or quota, a file-size limit, or a folder that "
                "cannot be written); free space there or write elsewhere, then run the command again"
            ) from None
        except KeyboardInterrupt:  # SIGINT before this handler (or a library's own): the same stop
            raise Stopped(signal.SIGINT) from None
    except UserError as e:
        if cleanup is not None:
            cleanup()
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        if failed is not None:
            raise failed() from None
        raise SystemExit(1) from None
    except Stopped as e:
        for signum in before:  # a second signal (make forwards one, timeout sends another) changes nothing now
            signal.signal(signum, signal.SIG_IGN)
        before = {}
        if cleanup is not None:
            cleanup()
        exit_stopped(e.signum, e.kept)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def required(cfg, key: str):
    """cfg[key], or a one-line error when it is Hydra's `???` (not given on the command line)."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    if OmegaConf.is_missing(cfg, key):
        raise MissingInputError(f"{key} is required: add {key}=<value> (make ... {key.upper()}=<value>)")
    return cfg[key]


def closest(name: str, options: Iterable[str]) -> str | None:
    """The option closest to a misspelled name, if one is close (difflib's ratio >= 0.6)."""
    return next(iter(get_close_matches(name, list(options), n=1)), None)


class CommandParser(argparse.ArgumentParser):
    """argparse for the commands that take options: a wrong option is one `error:` line with the closest option."""

    def __init__(self, doc: str | None):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str) -> NoReturn:
        options = [option for action in self._actions for option in action.option_strings]
        given = message.partition("unrecognized arguments: ")[2].split()
        hints = [f"did you mean {match}?" for g in given if g.startswith("-") and (match := closest(g, options))]
        listed = f" (the options: {', '.join(options)})" if given and not hints else " (--help says more)"
        raise InputError("; ".join([message, *hints]) + listed)

    def parse(self) -> argparse.Namespace:
        return exit_on_user_error(self.parse_args)
