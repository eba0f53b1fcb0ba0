"""`quanta generate --url` and `quanta chat --url`: the same commands against a running OpenAI-compatible
server (`quanta serve`, vLLM, ...) instead of a model loaded here. Streams over SSE with the standard
library alone, so the client side needs nothing the CLI does not already have."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from quanta.quant.errors import ConfigError, QuantaError
from quanta.cli.timing import Timing


class Remote:
    """An OpenAI-compatible server at `url` (with or without the trailing /v1)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600):
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers,
                                         method="GET" if body is None else "POST")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = e.reason
            raise QuantaError(f"{self.base}{path}: HTTP {e.code}: {message}") from None
        except urllib.error.URLError as e:
            raise ConfigError(f"cannot reach {self.base}: {e.reason}") from None

    def _first_model(self) -> str:
        with self._request("/models") as response:
            models = json.loads(response.read()).get("data", [])
        if not models:
            raise QuantaError(f"{self.base}/models lists no model")
        return models[0]["id"]

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        with self._request(path, {**body, "model": self.model, "stream": True}) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    return
                yield json.loads(payload)

    def complete(self, path: str, body: dict) -> tuple[str, Timing]:
        """Stream one completion (`/completions` or `/chat/completions`): its text and its timing."""
        start = time.perf_counter()
        first, pieces, usage = None, [], {}
        for chunk in self._stream(path, {**body, "stream_options": {"include_usage": True}}):
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - start
                    pieces.append(piece)
        total = time.perf_counter() - start
        return "".join(pieces), Timing(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                                       first if first is not None else total, total)


def sampling_body(args) -> dict:
    """The OpenAI request fields for the command line's sampling flags (vLLM's extras included)."""
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
            "seed": args.seed, "top_k": args.top_k, "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty, "ignore_eos": args.ignore_eos}
    if args.stop:
        body["stop"] = args.stop
    return body
