"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with the HTTP status.

The `openai` client maps the status to its exception class (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, ...) and shows the message.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error the server reports to the client with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The JSON body of an error."""
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error as a JSON response with its status."""
    return JSONResponse(error_body(status, message, param), status_code=status)
