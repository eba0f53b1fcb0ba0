"""`quanta generate` (one completion) and `quanta chat` (a conversation on stdin/stdout).

Both drive the engine request by request (add_request / step), which is what lets `--stats` time the
first token apart from the rest, as llama.cpp's timings do.
"""
from __future__ import annotations

import argparse
import sys
import time

from quanta.quant.errors import ConfigError, QuantaError
from quanta.cli.timing import Timing
from quanta.cli.options import (add_engine_args, add_sampling_args, engine_kwargs, quiet_parent,
                                  token_ids)


def load_llm(args: argparse.Namespace):
    """The LLM the command line describes (the embedded default model unless --model); with --lora, the
    adapter's LoRARequest goes to args.lora_request and the engine gets slots of its rank."""
    from quanta.engine import LLM
    from quanta.cli.default_model import default_model_path
    kwargs = engine_kwargs(args)
    args.lora_request = None
    if getattr(args, "lora", None):
        from quanta.lora.adapter import load_adapter
        from quanta.lora.request import LoRARequest
        rank = load_adapter(args.lora).rank
        kwargs = {"enable_lora": True, "max_lora_rank": rank} | kwargs
        args.lora_request = LoRARequest("lora", 1, args.lora)
    return LLM(model=str(args.model or default_model_path()), **kwargs)


def complete(llm, prompt, params, lora_request=None):
    """Run one request (with `lora_request`'s adapter, or none) to its end: (RequestOutput, Timing)."""
    start = time.perf_counter()
    request_id = llm.add_request(prompt, params, lora_request=lora_request)
    out, first = None, None
    while llm.has_unfinished():
        for step_out in llm.step():
            if step_out.request_id != request_id:
                continue
            out = step_out
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
        if out is not None and out.finished:
            break
    if out is None:
        raise QuantaError(f"request {request_id} produced no output")
    total = time.perf_counter() - start
    return out, Timing(len(out.prompt_token_ids), len(out.outputs[0].token_ids), first or total, total)


def chat_prompt(llm, messages: list[dict]) -> dict:
    """The conversation through the tokenizer's chat template, as token ids."""
    if llm.tokenizer is None or getattr(llm.tokenizer, "chat_template", None) is None:
        raise QuantaError("the model's tokenizer has no chat template: drop --chat-template, or pass --tokenizer")
    from quanta.engine.chat_template import chat_token_ids
    return {"prompt_token_ids": chat_token_ids(llm.tokenizer, messages)}


def _text(llm, out) -> str:
    """The sample's text, or its token ids where the model has no tokenizer."""
    sample = out.outputs[0]
    return sample.text if llm.tokenizer is not None else " ".join(map(str, sample.token_ids))


def _remote_client(args: argparse.Namespace):
    """The server behind --url, asked for its model once per command."""
    if getattr(args, "remote", None) is None:
        from quanta.cli.remote import Remote
        args.remote = Remote(args.url, api_key=args.api_key, model=args.model)
    return args.remote


def _print_remote(args: argparse.Namespace, path: str, body: dict) -> str:
    """Send one request to the server behind --url, print its text (and --stats), return the text."""
    from quanta.cli.remote import sampling_body
    text, timing = _remote_client(args).complete(path, {**body, **sampling_body(args)})
    print(text, flush=True)
    if args.stats:
        print(timing.line(), file=sys.stderr)
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    if args.url:
        if args.prompt_token_ids is not None:
            _print_remote(args, "/completions", {"prompt": args.prompt_token_ids})
        elif args.chat_template:
            _print_remote(args, "/chat/completions", {"messages": [{"role": "user", "content": args.prompt}]})
        else:
            _print_remote(args, "/completions", {"prompt": args.prompt})
        return
    llm = load_llm(args)
    if args.prompt_token_ids is not None:
        prompt = {"prompt_token_ids": args.prompt_token_ids}
    elif args.chat_template:
        prompt = chat_prompt(llm, [{"role": "user", "content": args.prompt}])
    elif llm.tokenizer is None:
        raise ConfigError(f"{args.model}: the model has no tokenizer: pass --prompt-token-ids, or --tokenizer DIR")
    else:
        prompt = args.prompt
    out, timing = complete(llm, prompt, args.sampling, args.lora_request)
    print(_text(llm, out))
    if args.stats:
        print(timing.line(), file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> None:
    llm = None if args.url else load_llm(args)
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
        if llm is None:
            reply = _print_remote(args, "/chat/completions", {"messages": messages})
        else:
            out, timing = complete(llm, chat_prompt(llm, messages), args.sampling, args.lora_request)
            reply = _text(llm, out)
            print(reply, flush=True)
            if args.stats:
                print(timing.line(), file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})


def check_generate(args: argparse.Namespace) -> None:
    """What can be checked before loading: one prompt, given one way."""
    if (args.prompt is None) == (args.prompt_token_ids is None):
        raise ConfigError("give a prompt or --prompt-token-ids, not both and not neither")
    if args.prompt_token_ids is not None and args.chat_template:
        raise ConfigError("--chat-template applies to a text prompt, not to --prompt-token-ids")
    if args.lora and args.url:
        raise ConfigError("--lora loads an adapter locally; with --url, name a served adapter with --model")


def _add_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", default=None, metavar="ADAPTER",
                   help="run with a LoRA adapter (a peft directory or a GGUF LoRA file) over the model")


def _add_remote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="talk to a running OpenAI-compatible server (quanta serve) "
                                               "instead of loading a model; --model names the served model")
    p.add_argument("--api-key", default=None, help="the server's API key (with --url)")


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="complete one prompt", parents=[quiet_parent()])
    gen.add_argument("prompt", nargs="?", help="the prompt text")
    gen.add_argument("--prompt-token-ids", type=token_ids, default=None,
                     help="the prompt as token ids (e.g. 1,2,3), for models without a tokenizer")
    gen.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user chat message")
    add_engine_args(gen)
    _add_lora_arg(gen)
    add_sampling_args(gen)
    _add_remote_args(gen)
    gen.set_defaults(func=cmd_generate, check=check_generate)
    chat = sub.add_parser("chat", help="chat on stdin/stdout with the tokenizer's chat template",
                          parents=[quiet_parent()])
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _add_lora_arg(chat)
    add_sampling_args(chat)
    _add_remote_args(chat)
    chat.set_defaults(func=cmd_chat)
