"""Measure the autoscaling signal: drive one replica at rising request rates and record, per rate, the waiting
requests (from /metrics), TTFT p99 and throughput. Shows where a replica saturates, which sets the HPA target.

    sluice serve &   # one replica, as deployed
    python -m sluice.service.bench.measure_scaling --url http://127.0.0.1:8000 --rates 0.5,1,2,4 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class RateResult:
    """What one offered request rate did to the replica."""

    rate: float
    sent: int = 0
    completed: int = 0
    rejected: int = 0
    failed: int = 0
    duration_s: float = 0.0
    throughput_rps: float = 0.0
    output_tok_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    waiting_mean: float = 0.0
    waiting_max: float = 0.0
    running_mean: float = 0.0
    kv_usage_mean: float = 0.0
    ttfts: list[float] = field(default_factory=list, repr=False)


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def gauges(text: str) -> dict[str, float]:
    """Sum of each sluice_* gauge over its series, from a /metrics body."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "gauge" and fam.name.startswith("sluice_"):
            out[fam.name] = sum(s.value for s in fam.samples)
    return out


async def sample_gauges(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, into: list[dict]) -> None:
    """Poll /metrics every 0.5 s until `stop` is set."""
    while not stop.is_set():
        try:
            async with session.get(f"{url}/metrics") as resp:
                into.append(gauges(await resp.text()))
        except aiohttp.ClientError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, result: RateResult,
                      out_tokens: list[int]) -> None:
    """Stream one completion; record TTFT and output tokens (from the usage chunk)."""
    start = time.perf_counter()
    first = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status in (429, 503):
                result.rejected += 1
                return
            if resp.status != 200:
                result.failed += 1
                return
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    out_tokens.append(chunk["usage"]["completion_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError):
        result.failed += 1
        return
    result.completed += 1
    if first is not None:
        result.ttfts.append(first)


async def run_rate(url: str, model: str, rate: float, duration: float, prompt_tokens: int, max_tokens: int,
                   vocab: int, seed: int) -> RateResult:
    """Poisson arrivals at `rate` req/s for `duration` s, then wait for the stragglers."""
    rng = random.Random(seed)
    result = RateResult(rate)
    samples: list[dict] = []
    out_tokens: list[int] = []
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=duration * 4 + 300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        sampler = asyncio.create_task(sample_gauges(session, url, stop, samples))
        tasks = []
        start = time.perf_counter()
        next_at = 0.0
        while next_at < duration:
            await asyncio.sleep(max(0.0, start + next_at - time.perf_counter()))
            body = {
                "model": model, "prompt": [rng.randrange(100, vocab) for _ in range(prompt_tokens)],
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
            }
            tasks.append(asyncio.create_task(one_request(session, url, body, result, out_tokens)))
            result.sent += 1
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        result.duration_s = time.perf_counter() - start
        stop.set()
        await sampler
    result.throughput_rps = result.completed / result.duration_s
    result.output_tok_s = sum(out_tokens) / result.duration_s
    result.ttft_p50_s = quantile(result.ttfts, 0.5)
    result.ttft_p99_s = quantile(result.ttfts, 0.99)
    if samples:
        result.waiting_mean = statistics.fmean(s.get("sluice_requests_waiting", 0) for s in samples)
        result.waiting_max = max(s.get("sluice_requests_waiting", 0) for s in samples)
        result.running_mean = statistics.fmean(s.get("sluice_requests_running", 0) for s in samples)
        result.kv_usage_mean = statistics.fmean(s.get("sluice_kv_cache_usage_ratio", 0) for s in samples)
    return result


def table(results: list[RateResult]) -> str:
    """A markdown table of the results."""
    rows = [
        "| offered req/s | done req/s | output tok/s | TTFT p50 | TTFT p99 | waiting mean | waiting max "
        "| running mean | KV usage | rejected |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.rate:g} | {r.throughput_rps:.2f} | {r.output_tok_s:.0f} | {r.ttft_p50_s:.2f} s "
            f"| {r.ttft_p99_s:.2f} s | {r.waiting_mean:.1f} | {r.waiting_max:.0f} | {r.running_mean:.1f} "
            f"| {r.kv_usage_mean:.0%} | {r.rejected} |"
        )
    return "\n".join(rows)


async def measure(args: argparse.Namespace) -> list[RateResult]:
    """Every rate in turn against one server."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{args.url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
    results = []
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        r = await run_rate(args.url, model, rate, args.duration, args.prompt_tokens, args.max_tokens,
                           args.vocab, seed=i)
        print(f"rate {rate:g}: {r.completed} done, TTFT p99 {r.ttft_p99_s:.2f}s, waiting mean "
              f"{r.waiting_mean:.1f}, {r.output_tok_s:.0f} tok/s", file=sys.stderr)
        results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--rates", default="0.25,0.5,1,2,4", help="Comma-separated request rates (req/s).")
    parser.add_argument("--duration", type=float, default=60.0, help="Seconds of arrivals per rate.")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=20000, help="Random prompt token ids are drawn below this.")
    parser.add_argument("--out", help="Write the results as JSON here.")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args))
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{k: v for k, v in asdict(r).items() if k != "ttfts"} for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
