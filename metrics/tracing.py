"""Request timelines: timestamps the engine stamps as a request moves, the Server-Timing header made from them,
and (only with `--otlp-traces-endpoint`) one OpenTelemetry span per engine request built from them.

The engine thread only stamps floats and appends tuples; spans are built on the event loop once a request has
ended (as vLLM's output processor does), and opentelemetry is imported only when a RequestTracer is made.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: metrics must stay importable from anywhere without cycles
    from sluice.scheduling.output import SchedulerOutput
    from sluice.scheduling.request import Request

Event = tuple[str, float, dict[str, Any] | None]  # (name, monotonic time, attributes)
# Events kept per request (the SDK's own default span limit): a long prompt in small chunks, or a request
# preempted again and again, must not grow its list without bound. The finish is always kept.
MAX_EVENTS = 128


@dataclass(slots=True)
class RequestTimeline:
    """One engine request's timestamps (time.monotonic) and, when traced, its span events in order."""

    request_id: str
    request: Request | None  # dropped at the end: the finished timeline keeps only numbers
    arrival: float
    trace_headers: Mapping[str, str] | None = None  # W3C trace context from the client; None: not traced
    events: list[Event] | None = None  # recorded only for traced requests
    first_scheduled: float | None = None
    first_token: float | None = None
    end: float | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    dropped_events: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)  # request parameters, for the span

    def add(self, name: str, t: float, attrs: dict[str, Any] | None = None) -> None:
        """Record a span event, within MAX_EVENTS (one place stays free for the finish)."""
        if len(self.events) < MAX_EVENTS - 1 or name == "finished":
            self.events.append((name, t, attrs))
        else:
            self.dropped_events += 1

    def phases(self) -> tuple[float, float, float]:
        """(queue, prefill, decode) seconds: arrival to first scheduled, to first token, to the end."""
        end = self.end if self.end is not None else time.monotonic()
        scheduled = self.first_scheduled if self.first_scheduled is not None else end
        first = self.first_token if self.first_token is not None else end
        return scheduled - self.arrival, max(first - scheduled, 0.0), max(end - first, 0.0)


def server_timing(timelines: list[RequestTimeline]) -> str:
    """The Server-Timing header value (milliseconds) of the request among `timelines` that ended last.

    An API call's response waits for its slowest engine request (n > 1, several prompts), so its phases are
    the ones that explain the response time; sums over choices would count parallel work several times.
    """
    if not timelines:
        return ""
    last = max(timelines, key=lambda t: t.end or 0.0)
    queue, prefill, decode = last.phases()
    return f"queue;dur={queue * 1e3:.1f}, prefill;dur={prefill * 1e3:.1f}, decode;dur={decode * 1e3:.1f}"


class Timelines:
    """The engine's book of live timelines. Not thread-safe: the engine thread alone calls it."""

    __slots__ = ("_live", "_traced")

    def __init__(self) -> None:
        self._live: dict[str, RequestTimeline] = {}
        self._traced: dict[str, RequestTimeline] = {}  # the subset with events: empty when tracing is off

    def start(self, request: Request, trace_headers: Mapping[str, str] | None = None) -> None:
        """Open the timeline of a request the engine just accepted; `trace_headers` not None: record events."""
        tl = RequestTimeline(request.request_id, request, request.arrival_time, trace_headers)
        self._live[request.request_id] = tl
        self._traced.pop(request.request_id, None)
        if trace_headers is not None:
            p = request.sampling_params
            tl.events = [("queued", request.arrival_time, {"prompt_tokens": request.num_prompt_tokens})]
            tl.attributes = {"gen_ai.request.max_tokens": p.max_tokens, "gen_ai.request.temperature": p.temperature,
                             "gen_ai.request.top_p": p.top_p, "gen_ai.request.top_k": p.top_k,
                             "gen_ai.request.seed": p.seed, "sluice.priority": request.priority}
            self._traced[request.request_id] = tl

    def on_step(self, out: SchedulerOutput, scheduled_at: float, now: float) -> None:
        """Traced requests only: first schedule, preemptions, swap-ins and prefill chunks of one step."""
        if not self._traced:
            return
        swapped_out, decision = set(out.swapped_out_ids), out.decision.trace()
        for rid in out.preempted_ids:
            tl = self._traced.get(rid)
            if tl is not None:
                mode = "swap" if rid in swapped_out else "recompute"
                tl.add("preempted", scheduled_at, {"mode": mode})
        for rid in out.swapped_in_ids:
            tl = self._traced.get(rid)
            if tl is not None:
                tl.add("swapped_in", scheduled_at)
        for s in out.scheduled:
            tl = self._traced.get(s.request_id)
            if tl is None:
                continue
            if tl.first_scheduled is None and tl.request is not None:
                tl.first_scheduled = tl.request.first_scheduled_time or scheduled_at
                tl.add("first_scheduled", tl.first_scheduled, {"cached_tokens": max(tl.request.num_cached_tokens, 0)})
            # Anything but the one decode token (the newest output) is prefill, recomputed outputs included.
            if s.num_output_tokens == 0 or s.start_pos < s.num_prompt_tokens + s.num_output_tokens - 1:
                # With the scheduler's decision for the step: its latency target, the prompt tokens it allowed and
                # granted, the decoding rows and the flows served (step_budget.StepDecision).
                tl.add("prefill_chunk", now, {"tokens": s.num_tokens, "start": s.start_pos, **decision})

    def on_output(self, out, now: float) -> None:
        """Stamp the first token and the end; a finished output carries its timeline away (`out.timeline`)."""
        tl = self._live.get(out.request_id)
        if tl is None:
            return
        if out.token_ids and tl.first_token is None:
            tl.first_token = now
            if tl.events is not None:
                tl.add("first_token", now)
        if not out.finished:
            return
        del self._live[out.request_id]
        self._traced.pop(out.request_id, None)
        req, tl.request = tl.request, None
        if req is not None:
            tl.first_scheduled = tl.first_scheduled or req.first_scheduled_time
            tl.num_preemptions = req.num_preemptions
        tl.end, tl.finish_reason, tl.error_code = now, out.finish_reason, out.error_code
        tl.num_prompt_tokens, tl.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
        tl.num_cached_tokens = out.num_cached_tokens
        if tl.events is not None:
            tl.add("finished", now, {"finish_reason": out.finish_reason or "error",
                                     "prompt_tokens": out.num_prompt_tokens, "output_tokens": out.num_output_tokens})
        out.timeline = tl


class RequestTracer:
    """Builds one OpenTelemetry span per finished engine request (event loop side) and exports it over OTLP."""

    def __init__(self, model_name: str, endpoint: str = "", exporter=None) -> None:
        try:
            from opentelemetry.propagators.textmap import DefaultGetter
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise RuntimeError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'sluice[otel]'") from e
        if exporter is None:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as e:
                raise RuntimeError("--otlp-traces-endpoint needs the OTLP exporter: pip install 'sluice[otel]'") from e
            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))  # exports off the event loop
        else:  # tests: an in-memory exporter, spans visible at once
            processor = SimpleSpanProcessor(exporter)
        resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get(SERVICE_NAME, "unknown_service")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "sluice"}))
        self._provider = TracerProvider(resource=resource)  # ours, not the global one
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("sluice")
        self._propagator, self._getter = TraceContextTextMapPropagator(), DefaultGetter()
        self._kind, self._status, self._error = SpanKind.SERVER, Status, StatusCode.ERROR
        self.model_name = model_name

    def emit(self, tl: RequestTimeline) -> None:
        """Build, end and hand over the span of a finished, traced request."""
        offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic stamps -> epoch nanoseconds

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        queue, prefill, decode = tl.phases()
        attributes = {
            "gen_ai.request.id": tl.request_id, "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "gen_ai.usage.input_tokens": tl.num_prompt_tokens, "gen_ai.usage.output_tokens": tl.num_output_tokens,
            "gen_ai.response.finish_reasons": [tl.finish_reason or "error"],
            "gen_ai.latency.time_in_queue": queue, "gen_ai.latency.time_in_model_prefill": prefill,
            "gen_ai.latency.time_in_model_decode": decode, "gen_ai.latency.e2e": (tl.end or 0.0) - tl.arrival,
            "sluice.cached_tokens": tl.num_cached_tokens, "sluice.preemptions": tl.num_preemptions,
            "sluice.dropped_events": tl.dropped_events,
            **{k: v for k, v in tl.attributes.items() if v is not None},
        }
        if tl.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = tl.first_token - tl.arrival
        parent = self._propagator.extract(tl.trace_headers or {}, getter=self._getter)
        span = self._tracer.start_span("llm_request", context=parent, kind=self._kind, attributes=attributes,
                                       start_time=ns(tl.arrival))
        for name, t, attrs in sorted(tl.events or (), key=lambda e: e[1]):  # stable: same-time events keep order
            span.add_event(name, attrs or {}, timestamp=ns(t))
        if tl.error_code is not None or tl.finish_reason == "error":
            span.set_attribute("error.type", tl.error_code or "error")
            span.set_status(self._status(self._error, tl.error_code or "error"))
        span.end(end_time=ns(tl.end if tl.end is not None else time.monotonic()))

    def shutdown(self) -> None:
        """Flush what is queued and stop exporting."""
        self._provider.shutdown()
