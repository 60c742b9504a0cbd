"""What the command-line tools share: ``--version``, a quiet exit when stdout's reader
goes away (``tool | head -1``), and usage errors that list the known names.

Each tool's ``main`` is wrapped by :func:`entry_point`, which exits 141 (128 + SIGPIPE, as
a shell reports a tool ended by a closed pipe) for a closed stdout, and 2 with the message
for a :class:`UsageError`.
"""

from __future__ import annotations

import argparse
import functools
import os
import select
import sys
from collections.abc import Callable, Iterable

import opcontract

EXIT_USAGE = 2
EXIT_CLOSED_PIPE = 141


class UsageError(Exception):
    """A command line that names something that doesn't exist."""


def add_version(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--version", action="version", version=f"opcontract {opcontract.__version__}")


def unknown(name: str, known: dict[str, Iterable[str]]) -> UsageError:
    """``unknown op 'x'; known ops: a, b`` (two kinds: ``unknown op or implementation 'x';
    known ops: ...; known implementations: ...``)."""
    lists = "; ".join(
        f"known {kind}s: {', '.join(sorted(names)) or '(none)'}" for kind, names in known.items()
    )
    return UsageError(f"unknown {' or '.join(known)} {name!r}; {lists}")


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
            # a reader gone shows here (what is still buffered), not at interpreter exit
            return code if _flush() else EXIT_CLOSED_PIPE

        return run

    return wrap
