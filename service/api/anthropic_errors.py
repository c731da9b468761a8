"""Anthropic's error shape: the same RequestError the OpenAI routes answer (one place decides the status), rendered
as `{"type": "error", "error": {"type", "message"}}` on the /v1/messages paths.

The HTTP status is the shared path's, so retry logic reads the same answer on either protocol: a server that is
loading, draining or whose engine died answers 503 (with `x-should-retry`), typed `overloaded_error`. Anthropic's
own API answers overload with 529; Sluice keeps 503, the status load balancers, gateways and Kubernetes probes
know, and which Anthropic's SDKs and Claude Code retry as they retry 529 (every 5xx, `x-should-retry` first).
"""

from __future__ import annotations

from sluice.service.api.errors import RequestError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def speaks_anthropic(path: str) -> bool:
    """Whether errors on `path` take Anthropic's shape (/v1/messages and below)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(e: RequestError) -> dict:
    """The error as Anthropic's body (and, streamed, its `error` event's data)."""
    return {"type": "error", "error": {"type": error_type(e.status), "message": e.message}}
