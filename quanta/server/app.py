"""The FastAPI application: OpenAI routes, /health, /version, /metrics, the API key and error bodies.

    app = build_app(engine, model_name="smollm2", api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every route but /health needs `Authorization: Bearer <api_key>` when an API key is set. Errors are
OpenAI-style bodies (errors.py): a body that is not valid JSON or does not fit the schema, out-of-range
values and requests over the limits (limits.py) get 400, a body over --max-request-bytes 413, an unknown
model 404, a missing or wrong key 401, a stopped engine 503 (and `on_engine_death` is called, so that the
server exits and a supervisor restarts it), anything else a 500 naming a request id (guards.py).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager, suppress

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quanta.engine.drivers.client import EngineClient
from quanta.server import metrics
from quanta.server.errors import APIError, error_response
from quanta.server.guards import Guard
from quanta.server.limits import Limits
from quanta.server.protocol import ChatCompletionRequest, CompletionRequest
from quanta.server.serving import Serving
from quanta.version import quanta_version

log = logging.getLogger(__name__)
OPEN_ROUTES = ("/health",)
WATCH_SECONDS = 0.25        # how often the app looks whether the engine still runs


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the parameter at fault, from pydantic's error list: its most specific error
    (a validator's own message first, then the deepest location), with the union members' tags left out of
    the parameter's path."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = max(errors, key=lambda e: (e.get("type") == "value_error", len(e.get("loc", ()))))
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {str(first.get('msg')).removeprefix('Value error, ')}", param


def _union_tag(part) -> bool:
    """Whether a location part names a member of a union (`list[int]`, `str`), not a field or an index."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def build_app(engine: EngineClient, model_name: str, api_key: str | None = None,
              chat_template: str | None = None, limits: Limits = Limits(),
              on_engine_death: Callable[[], None] | None = None, loras: dict | None = None) -> FastAPI:
    """The application over a (not yet started) engine; the engine loop runs for the app's lifetime.
    `on_engine_death` is called once if the engine stops while the app runs. `loras`: {name: LoRARequest} of
    the adapters served, each picked by a request's model field."""
    serving = Serving(engine, model_name, chat_template, limits, loras)
    created = int(time.time())

    async def watch() -> None:
        while engine.healthy:
            await asyncio.sleep(WATCH_SECONDS)
        log.error("the engine stopped: %s", engine.error)
        if on_engine_death is not None:
            on_engine_death()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await engine.start()
        watcher = asyncio.create_task(watch())
        yield
        watcher.cancel()
        with suppress(asyncio.CancelledError):
            await watcher
        await engine.stop()
        serving.pool.shutdown(wait=False, cancel_futures=True)

    async def check_key(request: Request) -> None:
        # A dependency, not an HTTP middleware: BaseHTTPMiddleware would sit between a streaming
        # response and the client and hide disconnects from it.
        if api_key is not None and request.url.path not in OPEN_ROUTES:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    app = FastAPI(title="quanta", version=quanta_version(), lifespan=lifespan,
                  dependencies=[Depends(check_key)], docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, max_bytes=serving.limits.max_request_bytes)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        return error_response(400, *_validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return error_response(503, f"the engine is not running: {engine.error}")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version():
        return {"version": quanta_version()}

    @app.get("/metrics")
    async def metrics_page():
        return PlainTextResponse(metrics.render(engine, model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "quanta",
                "root": engine.model, "parent": None, "max_model_len": engine.max_model_len}
        adapters = [card | {"id": name, "root": lora.lora_path, "parent": model_name}
                    for name, lora in serving.loras.items()]
        return {"object": "list", "data": [card, *adapters]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    return app
