"""The `quanta` command: thin sub-commands over the library."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from quanta.quant.errors import QuantaError
from quanta.cli.options import sampling_params

# Sub-commands, each a module with register(subparsers).
COMMANDS: tuple[str, ...] = ("quanta.cli.generate", "quanta.cli.inspect", "quanta.cli.plan",
                             "quanta.cli.quantize", "quanta.cli.convert", "quanta.cli.serve",
                             "quanta.cli.validate", "quanta.cli.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quanta", description=__doc__)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info logs")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        __import__(module, fromlist=["register"]).register(sub)
    return parser


def set_quiet(quiet: bool) -> None:
    """Logging at WARNING and no progress bars when quiet; INFO otherwise."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s")
    if quiet:
        os.environ["TQDM_DISABLE"] = "1"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_quiet(args.quiet)
    try:
        if hasattr(args, "max_tokens"):          # sampling flags are checked before any model loads
            args.sampling = sampling_params(args)
        if hasattr(args, "check"):
            args.check(args)
        args.func(args)
    except QuantaError as e:
        print(f"quanta: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
