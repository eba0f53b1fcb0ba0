"""`quanta convert SRC --to FORMAT --out DST`: one checkpoint format to another (quanta.convert).

    quanta convert SmolLM2.Q4_1.gguf --to hf --out smollm2-hf/
    quanta convert llama-awq/ --to gptq --out llama-gptq/
    quanta convert llama-hf/ --to gguf:Q4_K_M --out llama.Q4_K_M.gguf
    quanta convert llama-hf/ --merge-lora my-lora/ --to awq --out llama-mine-awq/

Prints what happened to the tensors (lossless or re-quantized, and the error) and, unless --no-validate,
one line comparing the output with the source. SIGTERM and Ctrl-C stop the conversion cleanly: nothing is
left at DST.
"""
from __future__ import annotations

import argparse

from quanta.cli.interrupt import ends_cleanly
from quanta.loaders.formats import convert_targets


def cmd_convert(args) -> None:
    from quanta.engine import host_heap
    from quanta.toolkit.convert.pipeline import convert, validation_line

    host_heap.map_large_blocks()

    with ends_cleanly("convert", args.out):
        report = convert(args.src, args.to, args.out, force=args.force, validate=not args.no_validate,
                         dtype=args.dtype, calibration=args.calibration, group_size=args.group_size,
                         windows=args.windows, ctx=args.ctx, text=args.text, max_shard_size=args.max_shard_size,
                         validate_options={"device": args.device} if args.device else None,
                         quiet=getattr(args, "quiet", False), merge_lora=args.merge_lora)
    print(report.summary())
    if report.validation is not None:
        print(validation_line(report.validation))


def register(sub: argparse._SubParsersAction) -> None:
    from quanta.toolkit.convert.defaults import DEFAULT_CTX, DEFAULT_GROUP, DEFAULT_SHARD_SIZE, DEFAULT_WINDOWS
    from quanta.cli.options import quiet_parent

    p = sub.add_parser("convert", help="convert a checkpoint to another format (lossless where possible)",
                       parents=[quiet_parent()])
    p.add_argument("src", help="source checkpoint: GGUF file or HF-style directory")
    p.add_argument("--to", required=True, help=f"output format: {', '.join(convert_targets())}[:TYPE] (e.g. gguf:Q4_K_M)")
    p.add_argument("--out", required=True, help="output directory (a .gguf file for gguf)")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.add_argument("--no-validate", action="store_true", help="skip the validation against the source")
    p.add_argument("--dtype", help="float dtype of unquantized tensors (hf: of all): float32, float16, bfloat16")
    p.add_argument("--merge-lora", metavar="ADAPTER",
                   help="merge a LoRA adapter (peft directory or GGUF LoRA file) into the weights it targets")
    p.add_argument("--calibration", metavar="FILE", help="text file: re-quantize AWQ / GPTQ with calibration")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP,
                   help=f"group size of re-quantized int weights (default {DEFAULT_GROUP})")
    p.add_argument("--windows", type=int, default=DEFAULT_WINDOWS,
                   help=f"validation windows (default {DEFAULT_WINDOWS})")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"tokens per validation window (default {DEFAULT_CTX})")
    p.add_argument("--text", help="validation text file (default: WikiText-2 test)")
    p.add_argument("--device", help="device the validation runs on (default: cuda when available)")
    p.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE,
                   help=f"largest safetensors shard, held in memory while written (default {DEFAULT_SHARD_SIZE})")
    p.set_defaults(func=cmd_convert)
