"""What every benchmark script does last: its result as one JSON line on stdout, and in --out when given; and, for
the scripts that load tokenizers, this folder taken off the import path."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def emit(result: dict, out: str | None) -> None:
    """Print `result` as one JSON line (the last line of the script's output) and write it to `out`."""
    text = json.dumps(result)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)


def leave_path() -> None:
    """Take this folder off sys.path (where a script inserted it, and where Python put it to run one): its kernels.py
    would shadow the `kernels` package that transformers imports while it builds a tokenizer."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
