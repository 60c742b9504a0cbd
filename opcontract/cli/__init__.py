"""What the command-line tools share: ``--version``, a quiet exit when stdout's reader
goes away (``tool | head -1``), usage errors that list the known names, and the install
line for a missing extra.

Each tool's ``main`` is wrapped by :func:`entry_point`, which exits 141 (128 + SIGPIPE, as
a shell reports a tool ended by a closed pipe) for a closed stdout, 2 with the message for
a :class:`UsageError`, and 1 with it for a :class:`MissingExtra`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import select
import sys
from collections.abc import Callable, Iterable

import opcontract

EXIT_USAGE = 2
EXIT_CLOSED_PIPE = 141


class UsageError(Exception):
    """A command line that names something that doesn't exist."""


class MissingExtra(Exception):
    """An optional dependency group (``pip install "opcontract[tune]"``) isn't installed."""


def add_version(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--version", action="version", version=f"opcontract {opcontract.__version__}")


def unknown(name: str, known: dict[str, Iterable[str]]) -> UsageError:
    """``unknown op 'x'; known ops: a, b`` (two kinds: ``unknown op or implementation 'x';
    known ops: ...; known implementations: ...``)."""
    lists = "; ".join(
        f"known {kind}s: {', '.join(sorted(names)) or '(none)'}" for kind, names in known.items()
    )
    return UsageError(f"unknown {' or '.join(known)} {name!r}; {lists}")


def require_extra(extra: str, modules: Iterable[str], what: str) -> None:
    """Raise :class:`MissingExtra` with the install line unless every module imports."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise MissingExtra(
                f'{what} needs the [{extra}] extra: pip install "opcontract[{extra}]" ({e})'
            ) from None


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it);
    False when it can't be told (no file descriptor to ask about)."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _closed_pipe(e: BrokenPipeError) -> None:
    """After a BrokenPipeError: re-raise it unless stdout's reader is gone; else point
    stdout's descriptor at /dev/null, so that the interpreter's last flush of what is still
    buffered doesn't fail again ("Exception ignored ... BrokenPipeError")."""
    if not _stdout_reader_gone():
        raise e  # another pipe broke (a worker process's, say): a real failure
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _flush() -> bool:
    """Flush stdout; False if its reader has gone."""
    try:
        sys.stdout.flush()
    except BrokenPipeError as e:
        _closed_pipe(e)
        return False
    return True


def entry_point(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a tool's ``main(argv) -> int`` with the exits described in the module doc."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                code = main(argv)
            except BrokenPipeError as e:
                _closed_pipe(e)
                return EXIT_CLOSED_PIPE
            except SystemExit:  # argparse's --help, --version and usage errors
                _flush()
                raise
            except UsageError as e:
                _flush()
                print(f"{prog}: {e}", file=sys.stderr)
                return EXIT_USAGE
            except MissingExtra as e:  # it names the command itself
                _flush()
                print(e, file=sys.stderr)
                return 1
            # a reader gone shows here (what is still buffered), not at interpreter exit
            return code if _flush() else EXIT_CLOSED_PIPE

        return run

    return wrap
