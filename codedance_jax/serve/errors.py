"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

400 invalid request (bad field, bad image, context too long, a Host that is not this server), 401
no or a wrong API key, 403 a cross-site request, 404 unknown model or route, 408 a body that came
too slowly, 413 a body over the limit, 415 a body that is not JSON, 500 a bug (the message names
the exception, never a traceback), 503 the decode loop stopped.
"""

from __future__ import annotations

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error the client sees as JSON with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}
