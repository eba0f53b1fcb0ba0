"""How an interrupted command ends: with its exit status, at once."""
from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End the process with `code` (128 + the signal), stdout and stderr flushed, once the command has removed its
    partial output. Not SystemExit: CPython marks a KeyboardInterrupt that passed through exec() of a string
    (dataclasses, namedtuple and many imports run such code) as unhandled even after it was caught, and a
    `python -m` process then ends by SIGINT instead of with its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
