"""The API's client-facing error: OpenAI's error shape, its HTTP status and type decided by its code.

A code is an ErrorCode (scheduling/outcomes.py: how the engine ended or refused a request) or one of the API's own
ApiErrorCode below, of the same shape; a RequestError takes nothing else, so no status, type or code is ever
written by hand at a raise.
"""

from __future__ import annotations

from sluice.scheduling.outcomes import CodedEnum, ErrorCode


class ApiErrorCode(CodedEnum):
    """Codes only the HTTP layer answers: routes, auth, readiness, the runtime LoRA routes, request checks.

    They stay out of scheduling/outcomes.py, whose codes are the engine's word on a request: a missing route or a
    bad API key means nothing below the API. The values are the `code` clients have always seen.
    """

    # A bad parameter: 400 with OpenAI's null `code` (the default of a RequestError).
    INVALID_REQUEST = ("invalid_request", 400, "invalid_request_error", False, True, False)
    UNSUPPORTED_PARAMETER = ("unsupported_parameter", 400, "invalid_request_error")
    UNSUPPORTED_SCHEMA_KEYWORD = ("unsupported_schema_keyword", 400, "invalid_request_error")
    GRAMMAR_UNAVAILABLE = ("grammar_unavailable", 400, "invalid_request_error")  # named by the engine's GrammarError
    GRAMMAR_TOO_COMPLEX = ("grammar_too_complex", 400, "invalid_request_error")
    MODEL_NOT_FOUND = ("model_not_found", 404, "invalid_request_error")
    MODEL_NOT_RERANKER = ("model_not_reranker", 400, "invalid_request_error")
    POOLING_RUNNER_DISABLED = ("pooling_runner_disabled", 404, "invalid_request_error")
    # aiohttp's own refusals, and the API key
    NOT_FOUND = ("not_found", 404, "invalid_request_error")
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405, "invalid_request_error")
    REQUEST_TOO_LARGE = ("request_too_large", 413, "invalid_request_error")
    INVALID_API_KEY = ("invalid_api_key", 401, "invalid_request_error")
    # load and readiness: another replica, or a later moment, can serve it
    RATE_LIMIT_EXCEEDED = ("rate_limit_exceeded", 429, "rate_limit_error")
    LOADING = ("loading", 503, "server_error", True)
    DRAINING = ("draining", 503, "server_error", True)
    DEAD = ("dead", 503, "server_error", True)  # /ready's word for ErrorCode.ENGINE_DEAD
    # the runtime LoRA routes (lora_routes.py); the engine's LoRAError names all but the first by value
    RUNTIME_LORA_DISABLED = ("runtime_lora_disabled", 404, "invalid_request_error")
    INVALID_LORA_NAME = ("invalid_lora_name", 400, "invalid_request_error")
    LORA_NAME_TAKEN = ("lora_name_taken", 400, "invalid_request_error")
    LORA_ALREADY_LOADED = ("lora_already_loaded", 400, "invalid_request_error")
    LORA_PATH_NOT_ALLOWED = ("lora_path_not_allowed", 400, "invalid_request_error")
    TOO_MANY_RUNTIME_LORAS = ("too_many_runtime_loras", 400, "invalid_request_error")
    TOO_MANY_LORAS = ("too_many_loras", 400, "invalid_request_error")
    INVALID_LORA_ADAPTER = ("invalid_lora_adapter", 400, "invalid_request_error")
    LORA_NOT_REMOVABLE = ("lora_not_removable", 403, "invalid_request_error")


def code_named(value: str | None) -> CodedEnum:
    """The code a lower layer names as text (GrammarError, LoRAError); None: INVALID_REQUEST. ValueError for a
    name no enum holds (tests/api/test_error_codes.py checks every name the engine writes)."""
    if value is None:
        return ApiErrorCode.INVALID_REQUEST
    for enum in (ErrorCode, ApiErrorCode):
        try:
            return enum(value)
        except ValueError:
            pass
    raise ValueError(f"no error code {value!r}")


class RequestError(Exception):
    """A client error, rendered as OpenAI's `{"error": {...}}`; its `code` decides the HTTP status and type."""

    def __init__(self, message: str, param: str | None = None, code: CodedEnum = ApiErrorCode.INVALID_REQUEST,
                 headers: dict | None = None):
        if not isinstance(code, CodedEnum):  # a str would compare equal to a member but carry no status
            raise TypeError(f"RequestError takes an ErrorCode or ApiErrorCode, not {type(code).__name__} {code!r}")
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.headers = headers  # extra response headers: Retry-After, Allow, WWW-Authenticate

    @property
    def status(self) -> int:
        """The HTTP status, the code's."""
        return self.code.status

    @property
    def type(self) -> str:
        """OpenAI's error type, the code's."""
        return self.code.type

    def to_dict(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code.wire}}


def context_length_error(max_model_len: int, however: str, param: str) -> RequestError:
    """The 400 for a prompt past the context, in OpenAI's words; `however` says by how much."""
    return RequestError(f"This model's maximum context length is {max_model_len} tokens. However, {however}",
                        param, ErrorCode.CONTEXT_LENGTH_EXCEEDED)


def param_path(path: tuple) -> str:
    """('tools', 0, 'function') -> 'tools[0].function'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
