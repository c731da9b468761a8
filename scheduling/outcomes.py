"""How a request ends: its finish reason, and when the server ended it, the error code clients see.

Both are str-valued so JSON bodies, log lines and metric labels keep the plain text ("stop", "queue_timeout").
They live here, in the lowest layer that ends requests; the API reads the HTTP side of each code, never the
reverse. Codes only the HTTP layer answers (a missing route, a bad API key, a LoRA route's refusal) are its own
ApiErrorCode, of the same shape (service/api/errors.py).
"""

from __future__ import annotations

from enum import Enum


class _StrEnum(str, Enum):
    """enum.StrEnum for Python 3.10: str() and format() give the value, not 'Class.MEMBER'."""

    __str__ = str.__str__
    __format__ = str.__format__


class FinishReason(_StrEnum):
    """Why a request stopped producing tokens (the API adds its own "tool_calls")."""

    STOP = "stop"  # EOS, a stop token id or string, or a completed grammar
    LENGTH = "length"  # max_tokens or the context reached
    ABORT = "abort"  # cancelled: the client left, or the server gave up on it
    ERROR = "error"  # the server failed it


class CodedEnum(_StrEnum):
    """Error codes, each with what the API answers for it: the base of ErrorCode and the API's own ApiErrorCode.

    `status` and `type` are the HTTP status and OpenAI error type. `retry` becomes `x-should-retry`, the header
    the OpenAI SDKs obey before their own status rules (they retry 408/409/429/5xx): a retry makes sense when
    another replica or a later moment can serve it (shutdown, dead engine), not when the same request would fail
    again (a failed step) or join the same overloaded queue (waited too long). `public`: the engine's message may
    reach the client; otherwise it stays in the log. `named`: the JSON's `code` names it (False: OpenAI's null).
    """

    def __new__(cls, value: str, status: int, type_: str, retry: bool = False, public: bool = True,
                named: bool = True):
        member = str.__new__(cls, value)
        member._value_ = value
        member.status, member.type, member.retry, member.public, member.named = status, type_, retry, public, named
        return member

    @property
    def wire(self) -> str | None:
        """What the error body's `code` holds: the plain value, or None."""
        return self.value if self.named else None


class ErrorCode(CodedEnum):
    """Why the server ended a request (or refused it at admission), with what the API answers for it."""

    QUEUE_TIMEOUT = ("queue_timeout", 429, "rate_limit_error", False, True)
    SHUTDOWN = ("shutdown", 503, "server_error", True, True)
    ENGINE_DEAD = ("engine_dead", 503, "server_error", True, True)
    STEP_FAILED = ("step_failed", 500, "server_error", False, False)
    DETOKENIZE_FAILED = ("detokenize_failed", 500, "server_error", False, False)
    SLOW_READER = ("slow_reader", 408, "timeout_error", False, True)
    # A constrained row that no token can continue, or whose grammar work passed its budget.
    CONSTRAINT_ERROR = ("constraint_error", 400, "invalid_request_error", False, True)
    INTERNAL_ERROR = ("internal_error", 500, "server_error", False, False)  # an ending that named no code
    # Refusals at admission (RequestRejected), never an ending.
    CONTEXT_LENGTH_EXCEEDED = ("context_length_exceeded", 400, "invalid_request_error", False, True)
    DUPLICATE_REQUEST_ID = ("duplicate_request_id", 400, "invalid_request_error", False, True)


class RequestRejected(ValueError):
    """A request refused at admission; `code` says why (the API maps it to a 400 naming the prompt)."""

    def __init__(self, message: str, code: ErrorCode):
        super().__init__(message)
        self.code = code
