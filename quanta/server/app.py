"""The FastAPI application: OpenAI routes, /health, /version, /metrics, the API key and error bodies.

    app = build_app(engine, model_name="smollm2", api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every route but /health needs `Authorization: Bearer <api_key>` when an API key is set. Errors are
OpenAI-style bodies (errors.py): a body that is not valid JSON or does not fit the schema and
out-of-range values get 400, an unknown model 404, a missing or wrong key 401.
"""
from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quanta.engine.drivers.client import EngineClient
from quanta.server import metrics
from quanta.server.errors import APIError, error_response
from quanta.server.protocol import ChatCompletionRequest, CompletionRequest
from quanta.server.serving import Serving
from quanta.version import quanta_version

log = logging.getLogger(__name__)
OPEN_ROUTES = ("/health",)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the parameter at fault, from pydantic's error list."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg')}", param


def build_app(engine: EngineClient, model_name: str, api_key: str | None = None,
              chat_template: str | None = None) -> FastAPI:
    """The application over a (not yet started) engine; the engine loop runs for the app's lifetime."""
    serving = Serving(engine, model_name, chat_template)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await engine.start()
        yield
        await engine.stop()

    async def check_key(request: Request) -> None:
        # A dependency, not an HTTP middleware: BaseHTTPMiddleware would sit between a streaming
        # response and the client and hide disconnects from it.
        if api_key is not None and request.url.path not in OPEN_ROUTES:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    app = FastAPI(title="quanta", version=quanta_version(), lifespan=lifespan,
                  dependencies=[Depends(check_key)], docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        return error_response(400, *_validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception):
        log.exception("request failed")
        return error_response(500, f"internal error: {exc!r}")

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return error_response(503, f"the engine loop is not running: {engine.error!r}")
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
                "root": engine.model, "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    return app
