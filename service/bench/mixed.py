"""`sluice bench serve --mixed`: streams decoding while long prompts arrive (issue 54's stall-free check).

A few streams start first and decode alone for `idle_s`; then one large piece of work is sent (`large`): a
/v1/completions call with a list of long prompts (Sluice's fan-out case), the same prompts as separate requests
(which any OpenAI-compatible server takes), one /v1/embeddings call with them as inputs, or a prompt list whose rows
are held to a small grammar; `probe_delay_s` later, a one-line chat. With `tenant_header`, the large request is one
tenant and the streams and the chat another (the server's --tenant-header: fair shares by tenant). Reported: the
streams' inter-token latency p50/p99 and token rate, idle and while the long prompts are in flight; the long
prompts' time to first token and the batch's completion time (and, with `alone`, the same batch timed alone first);
the chat's time to first token. The idle rate is the mean of the streams' rate alone before the long prompts and
again for `idle_s` after them: a stream's step grows with its context, which grows while the long prompts run. Works
against Sluice, vLLM or llama.cpp's server alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from sluice.service.bench.serve import ServeConfig, first_model_id, load_tokenizer, request_body, stream_one
from sluice.service.bench.sse import CompletionStream, SSEError, SSEParser
from sluice.service.bench.stats import Distribution, RequestRecord, distribution
from sluice.service.bench.workloads import LARGE_KINDS, Workload, text_prompts

PROBE = "Say hello in one short sentence."
SMALL_GRAMMAR = {"regex": "[a-z]{1,8}( [a-z]{1,8}){0,31}"}  # words: a grammar every row's mask must follow


@dataclass(slots=True)
class MixedWorkload:
    """The mixed scenario's shape."""

    streams: int = 2
    stream_input_len: int = 32
    stream_output_len: int = 4096  # to outlast the long prompts (cancelled after them; one that ends sooner counts
    # up to its end, and its idle rate from before them only)
    long_prompts: int = 32
    long_input_len: int = 1024
    long_output_len: int = 1
    large: str = "prompts"  # one of LARGE_KINDS
    idle_s: float = 3.0  # streams alone before the long prompts and after them: their idle rate
    probe_delay_s: float = 2.0  # the one-line chat, this long after the long prompts were sent
    alone: bool = False  # first time the long prompts alone, for the slowdown
    seed: int = 0
    tenant_header: str = ""  # where set: the large request is tenant "bulk", the streams and the chat "interactive"

    def validate(self) -> None:
        """Raise ValueError on impossible settings."""
        if min(self.streams, self.stream_input_len, self.stream_output_len, self.long_prompts, self.long_input_len,
               self.long_output_len) < 1:
            raise ValueError("the mixed workload's counts and lengths must be >= 1")
        if self.idle_s <= 0 or self.probe_delay_s < 0:
            raise ValueError("idle_s must be > 0 and probe_delay_s >= 0")
        if self.large not in LARGE_KINDS:
            raise ValueError(f"large must be one of {', '.join(LARGE_KINDS)}")


@dataclass(slots=True)
class MixedResult:
    """What the streams, the long prompts and the probe got (latencies in ms, rates in tokens per second)."""

    stream_idle_itl_ms: Distribution = field(default_factory=Distribution)
    stream_loaded_itl_ms: Distribution = field(default_factory=Distribution)
    stream_idle_rate: float = 0.0  # tokens per second per stream while alone
    stream_loaded_rate: float = 0.0  # while the long prompts are in flight
    long_ttft_ms: Distribution = field(default_factory=Distribution)
    long_completion_s: float = 0.0
    long_alone_s: float | None = None
    probe_ttft_ms: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def rate_ratio(self) -> float | None:
        """Loaded over idle stream rate (issue 54 asks >= 0.5)."""
        return self.stream_loaded_rate / self.stream_idle_rate if self.stream_idle_rate else None

    @property
    def slowdown(self) -> float | None:
        """The long batch's completion time beside the streams over alone (issue 54 asks <= 2.5)."""
        return self.long_completion_s / self.long_alone_s if self.long_alone_s else None


async def _long_call(session: aiohttp.ClientSession, url: str, body: dict, count: int) -> tuple[list[float], str]:
    """One completions call with a prompt list, streamed: each choice's first-token time; and an error, if any."""
    firsts: dict[int, float] = {}
    try:
        async with session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                return [], f"HTTP {resp.status}: {(await resp.text())[:200]}"
            parser, stream = SSEParser(), CompletionStream(False)
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                for event in parser.feed(data):
                    stream.on_event(event)
                    if event.data != "[DONE]":
                        for choice in orjson.loads(event.data).get("choices") or ():
                            if choice.get("text") or choice.get("finish_reason"):
                                firsts.setdefault(int(choice.get("index", 0)), now)
            stream.finish()
    except (aiohttp.ClientError, asyncio.TimeoutError, SSEError) as e:
        return list(firsts.values()), f"{type(e).__name__}: {e}"
    missing = count - len(firsts)
    return list(firsts.values()), f"{missing} of {count} prompts got no token" if missing else ""


async def _embeddings_call(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[list[float], str]:
    """One /v1/embeddings call: its answer's time stands for every input's first token; and an error, if any."""
    try:
        async with session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
            text = await resp.text()
            if resp.status != 200:
                return [], f"HTTP {resp.status}: {text[:200]}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return [], f"{type(e).__name__}: {e}"
    now, got = time.perf_counter(), len(orjson.loads(text).get("data") or ())
    missing = len(body["input"]) - got
    return [now] * got, f"{missing} of {len(body['input'])} inputs got no vector" if missing else ""


async def _send_long(session, cfg: ServeConfig, model: str, w: MixedWorkload, prompts: list[str]):
    """Send the large request; returns (seconds to complete, first-token times, errors)."""
    base = cfg.base_url.rstrip("/")
    start = time.perf_counter()
    plain = dataclasses.replace(cfg, endpoint="/v1/completions")
    if w.large == "separate":
        records = [RequestRecord(0, w.long_output_len) for _ in prompts]
        url = base + "/v1/completions"
        await asyncio.gather(*(stream_one(session, url, request_body(plain, model, p, w.long_output_len), r, False)
                               for p, r in zip(prompts, records, strict=True)))
        firsts = [r.token_times[0] for r in records if r.token_times]
        errors = sorted({r.error for r in records if not r.ok})
        return time.perf_counter() - start, [t - start for t in firsts], errors
    if w.large == "embeddings":
        firsts, error = await _embeddings_call(session, base + "/v1/embeddings", {"model": model, "input": prompts})
    else:
        body = request_body(plain, model, "", w.long_output_len) | {"prompt": prompts}
        if w.large == "grammar":
            body |= {"structured_outputs": SMALL_GRAMMAR, "ignore_eos": False}
        firsts, error = await _long_call(session, base + "/v1/completions", body, len(prompts))
    return time.perf_counter() - start, [t - start for t in firsts], [error] if error else []


def _window(records: list[RequestRecord], t0: float, t1: float) -> tuple[list[float], list[float]]:
    """The streams' inter-token gaps inside [t0, t1], and each stream's rate there in tokens/s (a stream that ended
    inside the window counts up to its end; one that had ended before it, not at all)."""
    gaps, rates = [], []
    for r in records:
        times = [t for t in r.token_times if t0 <= t <= t1]
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
        end = min(t1, r.token_times[-1] if r.end and r.token_times else t1)
        if end > t0 and times:
            rates.append(len(times) / (end - t0))
    return gaps, rates


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


async def run_mixed(cfg: ServeConfig, w: MixedWorkload) -> MixedResult:
    """Run the mixed scenario against the server at cfg.base_url."""
    w.validate()
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    def prompts(n: int, length: int, seed: int) -> list[str]:
        return [p for p, _, _ in text_prompts(Workload("mixed", n, length, 1, seed=seed), tokenizer)]

    long_prompts = prompts(w.long_prompts, w.long_input_len, w.seed)
    stream_prompts = prompts(w.streams, w.stream_input_len, w.seed + 7)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    bulk = headers | ({w.tenant_header: "bulk"} if w.tenant_header else {})
    if w.tenant_header:
        headers[w.tenant_header] = "interactive"
    result = MixedResult()
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=aiohttp.TCPConnector(limit=0)) as \
            session, aiohttp.ClientSession(timeout=timeout, headers=bulk,
                                           connector=aiohttp.TCPConnector(limit=0)) as bulk_session:
        model = cfg.model = cfg.model or await first_model_id(session, cfg.base_url)
        if w.alone:
            # Other prompts of the same lengths: the mixed run must not find these in the prefix cache.
            alone = prompts(w.long_prompts, w.long_input_len, w.seed + 13)
            result.long_alone_s, _, errors = await _send_long(bulk_session, cfg, model, w, alone)
            result.errors += errors
        records = [RequestRecord(w.stream_input_len) for _ in stream_prompts]
        url = cfg.base_url.rstrip("/") + cfg.endpoint
        streams = [asyncio.create_task(stream_one(session, url, request_body(cfg, model, p, w.stream_output_len), r,
                                                  cfg.chat)) for p, r in zip(stream_prompts, records, strict=True)]
        while not all(len(r.token_times) >= 2 or r.end for r in records):
            await asyncio.sleep(0.05)
        idle_from = time.perf_counter()
        await asyncio.sleep(w.idle_s)
        sent = time.perf_counter()
        long_task = asyncio.create_task(_send_long(bulk_session, cfg, model, w, long_prompts))
        probe = RequestRecord(0, 8)
        await asyncio.sleep(w.probe_delay_s)
        chat = dataclasses.replace(cfg, endpoint="/v1/chat/completions")
        probe_task = asyncio.create_task(stream_one(session, cfg.base_url.rstrip("/") + "/v1/chat/completions",
                                                    request_body(chat, model, PROBE, 8), probe, True))
        result.long_completion_s, firsts, errors = await long_task
        done = time.perf_counter()
        await probe_task
        await asyncio.sleep(w.idle_s)  # alone again: their contexts grew meanwhile, and so did their step time
        after = time.perf_counter()
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    stream_errors = sorted({r.error for r in records if r.error and not r.ok and len(r.token_times) < 2})
    result.errors += errors + stream_errors + ([probe.error] if probe.error else [])
    before_gaps, before = _window(records, idle_from, sent)
    after_gaps, after_rates = _window(records, done, after)
    idle_gaps = before_gaps + after_gaps
    result.stream_idle_rate = _mean([_mean(before), _mean(after_rates)] if after_rates else [_mean(before)])
    loaded_gaps, loaded = _window(records, sent, done)
    result.stream_loaded_rate = _mean(loaded)
    result.stream_idle_itl_ms, result.stream_loaded_itl_ms = distribution(idle_gaps), distribution(loaded_gaps)
    result.long_ttft_ms = distribution(firsts)
    result.probe_ttft_ms = probe.ttft * 1e3 if probe.ttft is not None else None
    return result


def mixed_lines(r: MixedResult) -> list[str]:
    """The console block of a mixed run."""
    def dist(d: Distribution) -> str:
        return f"{d.p50:>9.1f}{d.p99:>9.1f}"

    def num(x: float | None, fmt: str = ".2f") -> str:
        return "–" if x is None else format(x, fmt)

    lines = [f"{'=' * 16} mixed {'=' * 34}",
             f"{'Stream ITL idle (ms) p50/p99:':<38}{dist(r.stream_idle_itl_ms)}",
             f"{'Stream ITL loaded (ms) p50/p99:':<38}{dist(r.stream_loaded_itl_ms)}",
             f"{'Stream rate idle / loaded (tok/s):':<38}{r.stream_idle_rate:>9.1f}{r.stream_loaded_rate:>9.1f}"
             f"  ({num(r.rate_ratio and 100 * r.rate_ratio, '.0f')}% of idle)",
             f"{'Long prompts TTFT (ms) p50/max:':<38}{r.long_ttft_ms.p50:>9.1f}{r.long_ttft_ms.max:>9.1f}",
             f"{'Long batch completion (s):':<38}{r.long_completion_s:>9.2f}"
             f"  (alone {num(r.long_alone_s)} s, x{num(r.slowdown)})",
             f"{'One-line chat TTFT (ms):':<38}{num(r.probe_ttft_ms, '9.1f')}"]
    return lines + [f"  error: {e}" for e in r.errors]
