"""How a command that writes an output ends when interrupted: SIGTERM unwinds as Ctrl-C does (the command's
staged output is removed on the way), then the process ends with 128 + the signal, at once."""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that what unwinds on Ctrl-C unwinds on it too."""


def _raise_terminated(signum, frame):
    raise Terminated()


@contextmanager
def ends_cleanly(command: str, out) -> Iterator[None]:
    """Run the body with SIGTERM raised as Terminated; on it or on Ctrl-C, once the body has unwound, say that
    nothing was written at `out` and end the process with 128 + the signal (exit_now)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except BaseException as e:
        interrupt = interrupt_of(e)
        if interrupt is None:
            raise
        terminated = isinstance(interrupt, Terminated)
        print(f"quanta {command}: {'terminated' if terminated else 'interrupted'}; nothing was written at {out}",
              file=sys.stderr)
        exit_now(128 + (signal.SIGTERM if terminated else signal.SIGINT))
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt_of(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM that `e` is or, through its causes, came from, else None. A signal that lands inside
    a lazy import (transformers re-raises what stops one as a RuntimeError from it) is still the signal."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def exit_now(code: int) -> NoReturn:
    """End the process with `code` (128 + the signal), stdout and stderr flushed, once the command has removed its
    partial output. Not SystemExit: CPython marks a KeyboardInterrupt that passed through exec() of a string
    (dataclasses, namedtuple and many imports run such code) as unhandled even after it was caught, and a
    `python -m` process then ends by SIGINT instead of with its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
