"""`quanta serve [MODEL]`: the OpenAI-compatible server (quanta/server) on one engine.

    quanta serve model.gguf --port 8000 --api-key secret
    curl -H "Authorization: Bearer secret" localhost:8000/v1/completions -d '{"prompt": "Hi", "max_tokens": 8}'
    quanta serve base.gguf --lora-modules sql=./sql-lora chat=./chat-lora.gguf     # "model": "sql" picks one
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from quanta.quant.errors import ConfigError
from quanta.cli.options import add_engine_args, engine_kwargs, quiet_parent

DEATH_GRACE_SECONDS = 1.0   # after the engine stops, the server answers 503 this long, then exits non-zero


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    import torch

    from quanta.engine.config import EngineConfig
    from quanta.engine.drivers.process_engine import ProcessEngine
    from quanta.cli.default_model import default_model_path

    template = _chat_template(args.chat_template)
    model = str(args.model_path or args.model or default_model_path())
    loras = lora_modules(args.lora_modules or [], model)
    kwargs = engine_kwargs(args)
    if loras:
        kwargs = {"enable_lora": True, "max_loras": len(loras)} | kwargs
    config = EngineConfig.from_kwargs(model, **kwargs)
    for request in loras.values():                 # every adapter read and checked before the model loads
        check_adapter(request, config, model)
    # Forking is safe on the CPU only before this process runs any torch op (ProcessEngine).
    engine = ProcessEngine(config, start_method="fork" if torch.device(config.device).type == "cpu" else "spawn")
    from quanta.server.app import build_app
    name = args.served_model_name or Path(model).name
    server = None

    def exit_soon() -> None:                # the engine stopped: exit, so that a supervisor restarts us
        import asyncio
        asyncio.get_running_loop().call_later(DEATH_GRACE_SECONDS, setattr, server, "should_exit", True)

    app = build_app(engine, name, api_key=args.api_key, chat_template=template, limits=_limits(args),
                    on_engine_death=exit_soon, loras=loras)
    logging.getLogger(__name__).warning("quanta serve: %s as %r on http://%s:%d", model, name, args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=5,
                                           log_level="warning" if args.quiet else "info"))
    server.run()
    if engine.error is not None:
        print(f"quanta: error: the engine stopped ({engine.error}); the server exited", file=sys.stderr)
        raise SystemExit(1)


def lora_modules(specs: list[str], model: str) -> dict:
    """{name: LoRARequest} from `--lora-modules` entries, each NAME=PATH or vLLM's JSON {"name": ..., "path":
    ...}; ids are given in order from 1. ConfigError for a malformed entry or a name used twice."""
    from quanta.lora.request import LoRARequest
    loras: dict[str, LoRARequest] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
                name, path = entry["name"], entry["path"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"--lora-modules {spec!r}: a JSON entry needs \"name\" and \"path\"") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {spec!r} is not NAME=PATH")
        if name in loras:
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice")
        loras[name] = LoRARequest(name, len(loras) + 1, path)
    return loras


def check_adapter(request, config, model: str) -> None:
    """Read `request`'s adapter and check it against the model's shapes and the slots' rank (ConfigError or
    the reader's typed error, naming the adapter)."""
    from quanta.lora.adapter import load_adapter
    from quanta.planner.model_shapes import resolve_config
    adapter = load_adapter(request.lora_path, resolve_config(model))
    if adapter.rank > config.max_lora_rank:
        raise ConfigError(f"--lora-modules {request.lora_name}: rank {adapter.rank} is more than "
                          f"--max-lora-rank {config.max_lora_rank}")


def _limits(args: argparse.Namespace):
    from quanta.server.limits import DEFAULT_MAX_N, Limits
    return Limits(args.max_prompt_chars, args.max_request_bytes, args.max_n or DEFAULT_MAX_N)


def check_serve(args: argparse.Namespace) -> None:
    """What can be checked before loading."""
    if args.model_path and args.model and args.model_path != args.model:
        raise ConfigError(f"two models given: {args.model_path} and --model {args.model}")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port")
    for flag in ("max_prompt_chars", "max_request_bytes", "max_n"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    lora_modules(args.lora_modules or [], args.model_path or args.model or "")


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                           parents=[quiet_parent()])
    serve.add_argument("model_path", nargs="?", metavar="MODEL", help="checkpoint (same as --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every route "
                                                       "but /health")
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API "
                                                                 "(default: the checkpoint's file name)")
    serve.add_argument("--chat-template", default=None, help="Jinja chat template, or a file holding one "
                                                             "(default: the tokenizer's)")
    serve.add_argument("--max-prompt-chars", type=int, default=None,
                       help="longest prompt text, refused before tokenizing (default: max_model_len times the "
                            "tokenizer's longest token)")
    serve.add_argument("--max-request-bytes", type=int, default=None,
                       help="largest request body, refused with 413 before it is read whole (default: room for "
                            "the longest prompt)")
    serve.add_argument("--max-n", type=int, default=None,
                       help="most samples one request may ask for, n times its prompts (default 128)")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters to serve (peft directories or GGUF LoRA files), each chosen by a "
                            "request's model field = NAME; implies --enable-lora")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve, check=check_serve)
