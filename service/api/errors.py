"""The API's client-facing error: OpenAI's error shape with an HTTP status."""

from __future__ import annotations


class RequestError(Exception):
    """A client error, rendered as OpenAI's `{"error": {...}}` with `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers  # extra response headers: Retry-After, Allow, WWW-Authenticate

    def to_dict(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def param_path(path: tuple) -> str:
    """('tools', 0, 'function') -> 'tools[0].function'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
