"""`quanta validate [MODEL]`: perplexity on WikiText-2 (or --text) in fixed windows and, with --reference,
KL divergence, top-1 agreement and per-layer weight error against a reference model (quanta.eval).

    quanta validate model-Q4_K_M.gguf --reference model-f16.gguf --windows 40
    quanta validate big-f16/ --save-reference big.ref       # the reference alone, once
    quanta validate big-Q4_K_M.gguf --reference big.ref      # later, against the stored top-k

The engine flags apply to the model and to a reference given as a checkpoint.
"""
from __future__ import annotations

import argparse

from quanta.cli.options import add_engine_args, engine_kwargs, quiet_parent


def cmd_validate(args) -> None:
    from quanta.engine import host_heap
    from quanta.eval import validate
    from quanta.cli.default_model import default_model_path

    host_heap.map_large_blocks()

    model = args.path or args.model or str(default_model_path())
    result = validate(model, args.reference, text=args.text, ctx=args.ctx, n_windows=args.windows,
                      stride=args.stride, score=args.score, model_options=engine_kwargs(args),
                      layer_errors=not args.no_layer_errors, save_reference=args.save_reference,
                      top_k=args.top_k, exact=args.exact)
    print(result.to_json() if args.json else result.table(layers=args.layers))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="perplexity, KL divergence against a reference, per-layer weight error",
                       parents=[quiet_parent()])
    p.add_argument("path", nargs="?", help="checkpoint to evaluate (default: --model, else the embedded "
                                           "SmolLM2-135M Q4_1)")
    p.add_argument("--reference", help="reference checkpoint, or a file written by --save-reference")
    p.add_argument("--text", help="UTF-8 text file (default: ../shared/data/wikitext-2-raw-test.txt)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--windows", type=int, default=None, help="evaluate the first N windows (default: all)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: ctx)")
    p.add_argument("--score", choices=("second-half", "all"), default="second-half",
                   help="which tokens of a window are scored (default: the second half, as llama.cpp)")
    p.add_argument("--save-reference", metavar="FILE",
                   help="also store this model's top-k log-probabilities in FILE, for a later --reference FILE")
    p.add_argument("--top-k", type=int, default=64, help="log-probabilities kept a position by --save-reference")
    p.add_argument("--no-layer-errors", action="store_true", help="skip the per-layer weight comparison")
    p.add_argument("--layers", action="store_true", help="list each weight matrix's error")
    p.add_argument("--json", action="store_true", help="the result as JSON")
    p.add_argument("--exact", action="store_true",
                   help="both sides on the float32 dequantized path (a lossless conversion: KL 0, perplexity equal)")
    add_engine_args(p)
    p.set_defaults(func=cmd_validate)
