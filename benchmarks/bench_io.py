"""What every benchmark script does last: its result as one JSON line on stdout, and in --out when given."""
from __future__ import annotations

import json


def emit(result: dict, out: str | None) -> None:
    """Print `result` as one JSON line (the last line of the script's output) and write it to `out`."""
    text = json.dumps(result)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)

