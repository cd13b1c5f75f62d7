"""OpenAI-style errors. Each knows its status; only these reach clients.

Anything not raised as an ApiError is a bug: the boundary
(dataplane.http.boundary) logs it and the client gets a generic 500 in the
same shape, never a traceback.
"""

from __future__ import annotations

from aiohttp import web

from dataplane import jsonio


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return web.Response(
            status=self.status,
            body=jsonio.dumps(body),
            content_type="application/json",
            headers={**self.headers, **(extra_headers or {})},
        )


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def upstream_error(message: str, status: int = 502) -> ApiError:
    return ApiError(status, message, type="upstream_error", code="upstream_unavailable")
