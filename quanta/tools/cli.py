"""The `quanta` command: thin sub-commands over the library."""
from __future__ import annotations

import argparse
import logging
import sys

from quanta.quant.errors import QuantaError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint path (GGUF file or HF directory); default: SmolLM2-135M Q4_1")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", default=None, help="force one kernel by name for every quantized layer")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _llm(args):
    from quanta.engine import LLM
    from quanta.tools.default_model import default_model_path
    model = args.model or default_model_path()
    return LLM(model=str(model), dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               seed=args.seed, kernel=args.kernel)


def _sampling(args):
    from quanta.engine import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)


def cmd_generate(args) -> None:
    llm = _llm(args)
    params = _sampling(args)
    if args.chat_template:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)


def cmd_chat(args) -> None:
    llm = _llm(args)
    params = _sampling(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quanta", description=__doc__)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info logs")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user chat message")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="chat on stdin/stdout with the tokenizer's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    for name, module in COMMANDS.items():
        __import__(module, fromlist=["register"]).register(sub)
    return parser


# Further sub-commands, each a module with register(subparsers): name -> module path.
COMMANDS: dict[str, str] = {"inspect": "quanta.tools.inspect_cmd"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    if args.quiet:
        import os
        os.environ["TQDM_DISABLE"] = "1"
    try:
        args.func(args)
    except QuantaError as e:
        print(f"quanta: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
