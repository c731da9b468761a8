"""Per-request timings in, throughput and latency percentiles out (the figures every bench reports)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear between closest ranks (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(slots=True)
class Distribution:
    """One latency metric over many samples, in milliseconds."""

    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    count: int = 0


def distribution(seconds: Sequence[float]) -> Distribution:
    """Summarise samples given in seconds as a Distribution in milliseconds."""
    ms = [s * 1000.0 for s in seconds]
    if not ms:
        return Distribution()
    return Distribution(
        mean=sum(ms) / len(ms),
        p50=percentile(ms, 50),
        p90=percentile(ms, 90),
        p99=percentile(ms, 99),
        max=max(ms),
        count=len(ms),
    )


@dataclass(slots=True)
class RequestRecord:
    """One request's life as time.perf_counter() instants; token_times holds one entry per streamed chunk."""

    prompt_len: int
    expected_output_len: int = 0
    start: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0  # the server's usage count when it reports one, else the number of chunks
    ok: bool = False
    error: str = ""
    draft_tokens: int | None = None  # speculative drafts the server says it proposed / accepted for this request
    accepted_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first token."""
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None for single-token outputs)."""
        if len(self.token_times) < 2 or self.output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(slots=True)
class BenchResult:
    """What a benchmark run achieved; latencies in ms, throughputs per second of wall time."""

    name: str
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    errors: list[str] = field(default_factory=list)  # the first few distinct failure messages
    spec: dict = field(default_factory=dict)  # speculative decoding as the server reported it (spec_summary)


def summarize(name: str, records: Sequence[RequestRecord], duration_s: float) -> BenchResult:
    """Aggregate records of one run; failed requests count only in `failed`."""
    done = [r for r in records if r.ok]
    errors: list[str] = []
    for r in records:
        if not r.ok and r.error not in errors and len(errors) < 5:
            errors.append(r.error)
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    duration = max(duration_s, 1e-9)
    return BenchResult(
        name=name,
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=distribution([t for r in done if (t := r.ttft) is not None]),
        tpot_ms=distribution([t for r in done if (t := r.tpot) is not None]),
        itl_ms=distribution([gap for r in done for gap in r.itls]),
        e2el_ms=distribution([r.end - r.start for r in done]),
        errors=errors,
    )


def spec_summary(records: Sequence[RequestRecord], counters: dict[str, float] | None = None) -> dict:
    """Drafted and accepted tokens of the completed requests, and decode tokens per forward pass.

    From each request's own figures where the server sent them (llama.cpp's `timings`), else from the change of
    the server's `*spec_decode*` counters over the run (`counters`, Sluice's /metrics). Each request's first token
    comes from its prefill; every later forward yields one token plus the drafts it accepted. {} when neither
    source says anything.
    """
    done = [r for r in records if r.ok]
    if any(r.accepted_tokens is not None for r in done):
        source, drafted = "timings", sum(r.draft_tokens or 0 for r in done)
        accepted = sum(r.accepted_tokens or 0 for r in done)
    elif counters:
        source = "metrics"
        drafted = sum(v for k, v in counters.items() if "draft_tokens" in k)
        accepted = sum(v for k, v in counters.items() if "accepted" in k)
    else:
        return {}
    decode_tokens = sum(max(r.output_tokens - 1, 0) for r in done)
    forwards = decode_tokens - accepted
    return {"source": source, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_forward": decode_tokens / forwards if forwards > 0 else None, "counters": counters or {}}
