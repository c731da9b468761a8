"""What the engine hands out: EngineOutput per step and request (and its named constructors), Completion per finished
offline generation."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.metrics.tracing import RequestTimeline
from sluice.scheduling.outcomes import ErrorCode, FinishReason
from sluice.scheduling.output import TokenLogprobs


@dataclass(slots=True)
class EngineOutput:
    """One step's news for one request."""

    request_id: str
    text: str  # new text since the previous output (stop strings cut, no broken UTF-8)
    token_ids: list[int]  # new token ids
    logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    stop_reason: int | str | None = None
    # Why the engine ended it, when it was not the request's own stop.
    error_code: ErrorCode | None = None
    timeline: RequestTimeline | None = None  # on the final output: queue/prefill/decode times, span events
    embedding: object | None = None  # an embedding request's vector (a host float32 tensor), on its only output

    @classmethod
    def ended(cls, request_id: str, reason: FinishReason, code: ErrorCode | None = None, message: str | None = None,
              num_prompt_tokens: int = 0, num_output_tokens: int = 0, num_cached_tokens: int = 0) -> EngineOutput:
        """The last output of a request that ended without new tokens (aborted, failed, cut off)."""
        return cls(request_id, "", [], [], True, reason, num_prompt_tokens, num_output_tokens,
                   max(num_cached_tokens, 0), error=message, error_code=code)

    @classmethod
    def ended_from(cls, ro, reason: FinishReason, code: ErrorCode | None = None,
                   message: str | None = None) -> EngineOutput:
        """`ended` with the token counts of `ro` (a Request or a RequestOutput)."""
        return cls.ended(ro.request_id, reason, code, message, ro.num_prompt_tokens, ro.num_output_tokens,
                         ro.num_cached_tokens)

    @classmethod
    def tokens(cls, request_id: str, text: str, token_ids: list[int], logprobs: list[TokenLogprobs],
               finish_reason: FinishReason | None, num_prompt_tokens: int, num_output_tokens: int,
               num_cached_tokens: int, stop_reason: int | str | None = None) -> EngineOutput:
        """New tokens of a request; `finish_reason` set on its last."""
        return cls(request_id, text, token_ids, logprobs, finish_reason is not None, finish_reason,
                   num_prompt_tokens, num_output_tokens, num_cached_tokens, stop_reason=stop_reason)

    @classmethod
    def pooled(cls, ro) -> EngineOutput:
        """The one output of an embedding request (`ro` a RequestOutput carrying its vector)."""
        return cls(ro.request_id, "", [], [], True, FinishReason.STOP, ro.num_prompt_tokens, 0,
                   ro.num_cached_tokens, embedding=ro.pooled)


@dataclass(slots=True)
class Completion:
    """A finished offline generation."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
