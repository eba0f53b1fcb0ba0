"""The outermost layer of the application, as plain ASGI: a request id on every request, bodies over the
size limit refused before they are read whole (413), and an error no handler took answered as a 500 that
names the request id, while its traceback goes to the log only.

It is plain ASGI, not an HTTP middleware class: those sit between a streaming response and the client and
hide its disconnects. And it answers the 500 itself: an exception that reached Starlette's last resort
would be raised again into the server, which then drops a keep-alive connection instead of answering.
"""
from __future__ import annotations

import json
import logging
import uuid

from quanta.server.errors import error_body

log = logging.getLogger(__name__)
REQUEST_ID = "quanta.request_id"        # the scope key holding the request's id
HEADER = b"x-request-id"


class BodyTooLarge(Exception):
    """The body went past the limit while it was being received."""


class Guard:
    """ASGI middleware over `app`: request ids, the body limit (`max_bytes`) and the last-resort 500."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = f"req-{uuid.uuid4().hex[:16]}"
        scope[REQUEST_ID] = rid
        started, over = False, False

        async def guarded_send(message):
            nonlocal started
            if over:                    # the app's answer to a body cut short stands in for nothing: 413
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await _answer(send, 413, self._too_large(), "body", rid)
                return
            if message["type"] == "http.response.start":
                started = True
                message = message | {"headers": [*message.get("headers", []), (HEADER, rid.encode())]}
            await send(message)

        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _answer(send, 413, self._too_large(), "body", rid)
        received = 0

        async def counted_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise BodyTooLarge()
            return message

        try:
            await self.app(scope, counted_receive, guarded_send)
        except BodyTooLarge:
            pass
        except Exception:
            log.exception("request %s failed", rid)
            if not started:
                await _answer(send, 500, internal_message(rid), None, rid)
        if over and not started:
            await _answer(send, 413, self._too_large(), "body", rid)

    def _too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes:,} bytes (--max-request-bytes)"


def internal_message(rid: str) -> str:
    """What a client is told of a failure inside the server: the request id to find it in the log by."""
    return f"internal error (request id {rid}); the server's log has the details"


async def _answer(send, status: int, message: str, param: str | None, rid: str) -> None:
    body = json.dumps(error_body(status, message, param)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (HEADER, rid.encode())]})
    await send({"type": "http.response.body", "body": body})
