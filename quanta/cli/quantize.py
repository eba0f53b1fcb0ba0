"""`quanta quantize MODEL --method M --out DIR`: quantize any checkpoint quanta reads (quanta.quantize).

    quanta quantize model.gguf --method rtn --bits 4 --group-size 64 --out model-awq
    quanta quantize model/ --method gptq --act-order --samples 32 --seqlen 512 --out model-gptq
    quanta quantize model.gguf --method gptq --scheme fp8 --out model-fp8
    quanta quantize model/ --method gguf --type Q4_K_M --imatrix --out model-Q4_K_M.gguf
    quanta quantize model.gguf --method gguf --type Q4_K_M --imatrix imatrix.gguf --out model-Q4_K_M.gguf
    quanta quantize model/ --method gguf --type Q4_K_M --imatrix --save-imatrix imatrix.gguf --out model-Q4_K_M.gguf

SIGTERM is turned into an exception while it runs, so an interrupted run removes its temporary
output as Ctrl-C (SIGINT) does: nothing appears under --out unless the run completes.
"""
from __future__ import annotations

import argparse

from quanta.cli.interrupt import ends_cleanly
from quanta.cli.options import quiet_parent
from quanta.loaders.formats import quantize_formats
from quanta.toolkit.quantize.options import DEFAULT_SAMPLES, DEFAULT_SEQLEN, METHODS, SCHEMES


def cmd_quantize(args) -> None:
    from quanta.toolkit.quantize.pipeline import quantize
    from quanta.cli.default_model import default_model_path

    model = args.model or str(default_model_path())
    with ends_cleanly("quantize", args.out):
        summary = quantize(model, args.out, args.method, bits=args.bits, group_size=args.group_size,
                           symmetric=args.symmetric, act_order=args.act_order, type=args.type, format=args.format,
                           calibration=args.calibration, n_samples=args.samples, seqlen=args.seqlen,
                           imatrix=args.imatrix, save_imatrix=args.save_imatrix, scheme=args.scheme,
                           lm_head=args.lm_head, device=args.device, overwrite=args.overwrite,
                           quiet=args.quiet or args.json)
    print(summary.to_json() if args.json else summary.table(worst=args.worst))


def register(sub: argparse._SubParsersAction) -> None:
    formats = sorted({f for method in METHODS for f in quantize_formats(method)})
    p = sub.add_parser("quantize", help="quantize a checkpoint (RTN, AWQ, GPTQ, FP8, NF4, GGUF types)",
                       parents=[quiet_parent()])
    p.add_argument("model", nargs="?", help="checkpoint to quantize: GGUF file or HF / AWQ / GPTQ / ... directory "
                                            "(default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--out", required=True, help="output directory (a .gguf file for --method gguf)")
    p.add_argument("--bits", type=int, help="integer bits for rtn/awq/gptq (default 4)")
    p.add_argument("--group-size", type=int, help="input columns per scale for rtn/awq/gptq (default 128, -1: per "
                                                  "channel); blocksize for nf4 (default 64)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="symmetric", action="store_true", default=None, help="symmetric (gptq default)")
    sym.add_argument("--asym", dest="symmetric", action="store_false", help="zero points (rtn/awq default)")
    p.add_argument("--scheme", choices=SCHEMES, help="gptq: the grid it rounds onto: int (default; --bits, "
                                                     "--group-size) or fp8 (e4m3 per channel, compressed-tensors)")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--act-order", action="store_true", default=None,
                       help="gptq: quantize columns by decreasing activation (default with --scheme fp8)")
    order.add_argument("--no-act-order", dest="act_order", action="store_false", help="gptq: in column order")
    p.add_argument("--lm-head", action="store_true", help="rtn/awq/gptq: quantize the lm_head too (RTN for awq), "
                                                          "written in the gptq format")
    p.add_argument("--type", help="GGUF type or mix: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL "
                                         "IQ4_XS Q3_K_M Q4_K_M Q5_K_M")
    p.add_argument("--imatrix", nargs="?", const=True, default=False, metavar="FILE",
                   help="gguf: weight the rounding by an importance matrix: llama-imatrix's FILE (GGUF or legacy), "
                        "or, alone, one collected on the calibration text")
    p.add_argument("--format", choices=formats, help="output layout (default: awq for asymmetric 4-bit rtn/awq, "
                                                    "gptq otherwise; compressed-tensors for fp8, bnb for nf4)")
    p.add_argument("--save-imatrix", metavar="FILE", help="gguf --imatrix: also write the collected importance matrix "
                                                          "as llama-imatrix does (llama-quantize --imatrix reads it)")
    p.add_argument("--calibration", help="calibration text for awq, gptq, --imatrix "
                                         "(default: ../shared/data/wikitext-2-raw-test.txt)")
    p.add_argument("--samples", type=int, help=f"calibration windows (default {DEFAULT_SAMPLES})")
    p.add_argument("--seqlen", type=int, help=f"tokens per calibration window (default {DEFAULT_SEQLEN})")
    p.add_argument("--device", default="auto", help="where rtn/awq/gptq/fp8/nf4 run, a layer at a time: auto (the GPU "
                                                     "when there is one), cpu or cuda[:N]; gguf runs on the CPU")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--worst", type=int, default=5, help="layers listed in the summary (default 5)")
    p.add_argument("--json", action="store_true", help="the summary as JSON, every layer's error included")
    p.set_defaults(func=cmd_quantize)
