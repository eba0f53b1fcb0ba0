"""Shared machinery of the reader fuzz tests (tests/test_fuzz_*.py).

The property every reader must keep: an input either loads (and every tensor of it reads) or raises a
QuantaError; never another exception type, a hang, or an allocation the input's size does not justify.

Budget: QUANTA_FUZZ_EXAMPLES examples per test (default DEFAULT_EXAMPLES, derandomized so the default
suite is repeatable); the full run sets it to 10000 or more and draws fresh random examples:

    QUANTA_FUZZ_EXAMPLES=10000 python -m pytest tests/test_fuzz_gguf.py tests/test_fuzz_safetensors.py \
        tests/test_fuzz_configs.py -q -p no:cacheprovider
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import hypothesis
from hypothesis import HealthCheck, settings

from quanta.quant.errors import QuantaError

DEFAULT_EXAMPLES = 300
EXAMPLES = int(os.environ.get("QUANTA_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
FULL_RUN = "QUANTA_FUZZ_EXAMPLES" in os.environ
HANG_SECONDS = 20            # one example running longer than this is a hang (the machine is shared: generous)
ALLOC_FLOOR = 64 << 20       # traced allocations an example may always make (torch/numpy scratch, tokenizer...)

FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not FULL_RUN, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True)

COUNTS: dict[str, int] = {}  # reader -> examples run; written to $QUANTA_FUZZ_REPORT (JSON) at exit if set


def _report() -> None:
    if path := os.environ.get("QUANTA_FUZZ_REPORT"):
        Path(path).write_text(json.dumps({"examples": COUNTS, "hypothesis": hypothesis.__version__}, indent=1))


atexit.register(_report)


def fuzz_dir(prefix: str) -> Path:
    """A scratch directory for one fuzz module, removed at exit unless it holds a `failing*` example."""
    path = Path(tempfile.mkdtemp(prefix=f"quanta-fuzz-{prefix}-"))
    atexit.register(lambda: any(path.glob("failing*")) or shutil.rmtree(path, ignore_errors=True))
    return path


class Hang(BaseException):
    """Raised inside an example that ran past HANG_SECONDS (a BaseException: no reader's `except Exception` hides it)."""


@contextmanager
def _alarm(seconds: float):
    def fire(signum, frame):
        raise Hang(f"example ran longer than {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def loads_or_refuses(reader: str, run: Callable[[], object], input_bytes: int) -> QuantaError | None:
    """Run `run()` (parse and read everything); return None if it succeeded, the QuantaError if it refused.

    Fails the example for any other exception, a run past HANG_SECONDS, or a traced allocation peak above
    ALLOC_FLOOR + 16 x `input_bytes` (the input's size, which bounds what a reader may justify allocating).
    """
    COUNTS[reader] = COUNTS.get(reader, 0) + 1
    limit = ALLOC_FLOOR + 16 * input_bytes
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with _alarm(HANG_SECONDS):
            run()
        outcome = None
    except QuantaError as e:
        outcome = e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= limit, f"{reader}: traced allocation peak {peak} bytes for a {input_bytes}-byte input"
    assert time.perf_counter() - start < HANG_SECONDS
    return outcome
