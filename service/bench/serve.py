"""`sluice bench serve`: a streaming load generator for any OpenAI-compatible server (Sluice, vLLM, llama.cpp)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from sluice.service.bench.progress import Progress
from sluice.service.bench.sse import CompletionStream, SSEError, SSEParser
from sluice.service.bench.stats import BenchResult, RequestRecord, spec_summary, summarize
from sluice.service.bench.workloads import Workload, arrival_offsets, text_prompts


@dataclass(slots=True)
class ServeConfig:
    """Where to send the workload and how; the body is the same for every OpenAI-compatible server."""

    workload: Workload = field(default_factory=Workload)
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"  # or /v1/chat/completions
    model: str = ""  # "": the first id from GET /v1/models
    tokenizer: str = ""  # HF dir / hub id / 'default' to build token-exact prompts; "": random words
    api_key: str = ""
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 3600.0
    num_warmups: int = 0
    progress: bool = True

    @property
    def chat(self) -> bool:
        """True for the chat endpoint (messages in, delta.content out)."""
        return self.endpoint.rstrip("/").endswith("chat/completions")


def request_body(cfg: ServeConfig, model: str, prompt: str, max_tokens: int) -> dict:
    """The JSON body: stream on, greedy, ignore_eos as the extra field vLLM, llama.cpp and Sluice all accept."""
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                  "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(cfg.extra_body)
    return body


async def _post(session: aiohttp.ClientSession, url: str, data: bytes) -> aiohttp.ClientResponse:
    """POST, once more on a fresh connection when the server had already closed the pooled keep-alive one
    (llama.cpp's server closes idle ones between one-at-a-time requests); no response had begun."""
    headers = {"Content-Type": "application/json"}
    try:
        return await session.post(url, data=data, headers=headers)
    except aiohttp.ServerDisconnectedError:
        return await session.post(url, data=data, headers=headers)


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord, chat: bool) -> None:
    """Send one request and time each streamed chunk that carries text; failures land in record.error."""
    record.start = time.perf_counter()
    try:
        async with await _post(session, url, orjson.dumps(body)) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                record.error = f"not an event stream: Content-Type {resp.headers.get('Content-Type')!r}"
                return
            parser, stream = SSEParser(), CompletionStream(chat)
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                for event in parser.feed(data):
                    if stream.on_event(event).text:
                        record.token_times.append(now)
            for event in parser.close():
                stream.on_event(event)
            stream.finish()
            record.output_tokens = stream.completion_tokens or len(record.token_times)
            if stream.timings is not None:  # llama.cpp: drafts appear only once a request had any
                record.draft_tokens = int(stream.timings.get("draft_n", 0))
                record.accepted_tokens = int(stream.timings.get("draft_n_accepted", 0))
            record.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError, SSEError) as e:
        record.error = f"{type(e).__name__}: {e}"
    finally:
        record.end = time.perf_counter()


async def first_model_id(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists at /v1/models."""
    async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def spec_counters(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The server's speculative-decoding counters on /metrics (Sluice's `sluice_spec_decode_*`), summed over
    their labels, per-position series left out; {} where there is no such page or counter."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with session.get(base_url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return {}
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.type != "counter" or "spec_decode" not in family.name:
                continue
            for sample in family.samples:
                if (sample.name.endswith("_total")
                        and "per_pos" not in sample.name and not {"position", "pos"} & set(sample.labels)):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    except ValueError:  # not Prometheus text
        return {}
    return out


def load_tokenizer(name: str):
    """A tokenizer for building prompts: 'default' is Sluice's embedded model."""
    from transformers import AutoTokenizer

    if name in ("default", "SmolLM2-135M-Instruct"):
        from sluice.service.executor.model_loader import ensure_default_model

        name = str(ensure_default_model())
    return AutoTokenizer.from_pretrained(name)


async def run_serve(cfg: ServeConfig) -> BenchResult:
    """Run the workload against the server; returns the summary (failed requests included as counts)."""
    w = cfg.workload
    w.validate()
    prompts = text_prompts(w, load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None)
    offsets = arrival_offsets(len(prompts), w.request_rate, w.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    connector = aiohttp.TCPConnector(limit=w.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = cfg.model = cfg.model or await first_model_id(session, cfg.base_url)
        for _ in range(cfg.num_warmups):
            warm = RequestRecord(prompts[0][1])
            await stream_one(session, url, request_body(cfg, model, prompts[0][0], 4), warm, cfg.chat)
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        records = [RequestRecord(n, m) for _, n, m in prompts]
        gate = asyncio.Semaphore(w.max_concurrency) if w.max_concurrency else None
        progress = Progress(len(prompts), f"{w.name} ", cfg.progress)

        async def one(i: int) -> None:
            body = request_body(cfg, model, prompts[i][0], prompts[i][2])
            if gate is None:
                await stream_one(session, url, body, records[i], cfg.chat)
            else:
                async with gate:  # the clock starts when the request is sent, not while it queues here
                    await stream_one(session, url, body, records[i], cfg.chat)
            progress.update(records[i].ok)

        before = await spec_counters(session, cfg.base_url)
        start = time.perf_counter()
        tasks = []
        for i, offset in enumerate(offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()
        after = await spec_counters(session, cfg.base_url)
    result = summarize(w.name, records, duration)
    result.spec = spec_summary(records, {k: v - before.get(k, 0.0) for k, v in after.items()})
    return result


def serve_report(cfg: ServeConfig, result: BenchResult) -> dict:
    """The JSON result file: what was run and what it achieved."""
    config = dataclasses.asdict(cfg)
    config["workload"]["request_rate"] = str(cfg.workload.request_rate)  # JSON has no inf
    return {"kind": "serve", "config": config, "result": dataclasses.asdict(result)}
