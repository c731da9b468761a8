"""Tracing and Server-Timing: spans into the SDK's in-memory exporter, through the real app and tiny engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.metrics.tracing import RequestTimeline, server_timing

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
PROMPT = "The capital of France is Paris. Hello world, how are you today?"  # ~20 tokens of the tiny tokenizer


@pytest.fixture
def anyio_backend():
    return "asyncio"


# ---- the pure parts ---------------------------------------------------------------------------------------

def timeline(arrival, scheduled, first, end) -> RequestTimeline:
    return RequestTimeline("r", None, arrival, first_scheduled=scheduled, first_token=first, end=end)


def test_server_timing_reports_the_choice_that_ended_last_in_milliseconds():
    fast, slow = timeline(10.0, 10.5, 11.0, 12.0), timeline(10.0, 10.25, 12.0, 13.5)
    assert server_timing([slow, fast]) == "queue;dur=250.0, prefill;dur=1750.0, decode;dur=1500.0"
    assert server_timing([fast]) == "queue;dur=500.0, prefill;dur=500.0, decode;dur=1000.0"
    assert server_timing([]) == ""


def test_phases_of_a_request_that_never_produced_a_token():
    assert timeline(1.0, 3.0, None, 4.0).phases() == (2.0, 1.0, 0.0)  # aborted mid-prefill
    assert timeline(1.0, None, None, 4.0).phases() == (3.0, 0.0, 0.0)  # never scheduled


def test_events_per_request_are_bounded_and_the_finish_is_kept():
    from sluice.metrics.tracing import MAX_EVENTS

    tl = RequestTimeline("r", None, 0.0, events=[])
    for i in range(1000):
        tl.add("prefill_chunk", float(i), {"tokens": 1})
    tl.add("finished", 1000.0)
    assert len(tl.events) == MAX_EVENTS and tl.events[-1][0] == "finished"
    assert tl.dropped_events == 1000 - (MAX_EVENTS - 1)


def test_service_name_is_sluice_unless_the_environment_names_one(monkeypatch):
    from opentelemetry.sdk.resources import SERVICE_NAME
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sluice.metrics.tracing import RequestTracer

    def service(tracer):
        return tracer._provider.resource.attributes[SERVICE_NAME]

    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert service(RequestTracer("m", exporter=InMemorySpanExporter())) == "sluice"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sluice-eu-1")
    assert service(RequestTracer("m", exporter=InMemorySpanExporter())) == "sluice-eu-1"


def test_tracing_off_imports_no_opentelemetry():
    code = ("import sys; import sluice.service.api.api_server, sluice.service.engine.async_engine, "
            "sluice.service.cli; "
            "sys.exit(any(m.startswith('opentelemetry') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ---- through the app, on the tiny model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(model_dir):
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    config = SluiceConfig()
    config.model.model = model_dir
    config.model.device, config.model.dtype = "cpu", "float32"
    # 6 blocks of 16 tokens: three requests growing to ~50 tokens each cannot all stay; 8-token steps chunk
    # every prompt.
    config.cache.num_kv_blocks = 6
    config.scheduler.max_model_len = 96
    config.scheduler.max_num_batched_tokens = 8
    return LLMEngine(config)


@pytest.fixture
async def traced(engine):
    """(client, exporter): the app over the engine, with a tracer writing into an in-memory exporter."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sluice.metrics.tracing import RequestTracer
    from sluice.service.api.api_server import create_app
    from sluice.service.api.middlewares import STATE
    from sluice.service.engine.async_engine import AsyncEngine

    exporter = InMemorySpanExporter()
    aengine = AsyncEngine(engine, tracer=RequestTracer(engine.served_model_name, exporter=exporter))
    aengine.start()
    app = create_app(engine.config)
    app[STATE].engine = aengine
    client = TestClient(TestServer(app))
    await client.start_server()
    yield client, exporter
    await client.close()
    await aengine.shutdown()


def body(**kw) -> dict:
    return {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "temperature": 0, **kw}


def events(span) -> list[str]:
    return [e.name for e in span.events]


async def test_span_is_a_child_of_the_callers_with_events_in_order(traced, engine):
    client, exporter = traced
    r = await client.post("/v1/completions", json=body(), headers={"traceparent": TRACEPARENT})
    assert r.status == 200, await r.text()
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request" and span.kind.name == "SERVER"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN
    names = events(span)
    assert names[:2] == ["queued", "first_scheduled"] and names[-2:] == ["first_token", "finished"]
    chunks = [e for e in span.events if e.name == "prefill_chunk"]
    prompt_tokens = span.attributes["gen_ai.usage.input_tokens"]
    assert len(chunks) == -(-prompt_tokens // 8) > 1  # chunked by the 8-token budget
    assert [c.attributes["tokens"] for c in chunks][:-1] == [8] * (len(chunks) - 1)
    assert sum(c.attributes["tokens"] for c in chunks) == prompt_tokens
    times = [e.timestamp for e in span.events]
    assert times == sorted(times) and span.start_time <= times[0] and times[-1] <= span.end_time
    a = span.attributes
    assert a["gen_ai.request.max_tokens"] == 30 and a["gen_ai.usage.output_tokens"] == 30
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.response.model"] == engine.served_model_name
    assert span.events[-1].attributes["finish_reason"] == "length"
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    # Server-Timing: the same phases, in milliseconds.
    timing = dict(part.split(";dur=") for part in r.headers["Server-Timing"].split(", "))
    assert set(timing) == {"queue", "prefill", "decode"}
    e2e_ms = a["gen_ai.latency.e2e"] * 1e3
    assert sum(float(v) for v in timing.values()) == pytest.approx(e2e_ms, abs=0.5)
    assert float(timing["decode"]) > 0 and float(timing["prefill"]) > 0


async def test_preemption_is_an_event_with_its_mode(traced):
    client, exporter = traced
    replies = await asyncio.gather(*(client.post("/v1/completions", json=body()) for _ in range(3)))
    assert [r.status for r in replies] == [200] * 3
    spans = exporter.get_finished_spans()
    assert len(spans) == 3 and all(s.parent is None for s in spans)  # no traceparent: root spans
    preempted = [s for s in spans if "preempted" in events(s)]
    assert preempted, "6 blocks for three 50-token requests must preempt one"
    for s in preempted:
        names = events(s)
        e = s.events[names.index("preempted")]
        assert e.attributes["mode"] == "recompute" and s.attributes["sluice.preemptions"] >= 1
        # Recompute: the victim prefills again after its preemption, then runs to its finish.
        assert "prefill_chunk" in names[names.index("preempted"):] and names[-1] == "finished"
        assert names.index("first_scheduled") < names.index("preempted")


async def test_n_choices_give_one_span_each_under_the_same_parent(traced):
    client, exporter = traced
    r = await client.post("/v1/completions", json=body(n=2, max_tokens=4), headers={"traceparent": TRACEPARENT})
    assert r.status == 200 and len((await r.json())["choices"]) == 2
    spans = exporter.get_finished_spans()
    assert len(spans) == 2 and {s.attributes["gen_ai.request.id"][-2:] for s in spans} == {"-0", "-1"}
    assert all(format(s.parent.span_id, "016x") == PARENT_SPAN for s in spans)
    assert "Server-Timing" in r.headers


async def test_a_client_that_leaves_still_gets_its_span(traced):
    client, exporter = traced
    r = await client.post("/v1/completions", json=body(max_tokens=80, stream=True))
    assert r.status == 200
    await r.content.readline()  # the first event, then hang up
    r.close()
    for _ in range(200):
        if exporter.get_finished_spans():
            break
        await asyncio.sleep(0.05)
    (span,) = exporter.get_finished_spans()
    assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("abort",)
    assert events(span)[-1] == "finished" and span.attributes["gen_ai.usage.output_tokens"] < 80


async def test_streams_get_no_server_timing(engine):
    from sluice.service.api.api_server import create_app
    from sluice.service.api.middlewares import STATE
    from sluice.service.engine.async_engine import AsyncEngine

    aengine = AsyncEngine(engine)  # no tracer: the default
    aengine.start()
    app = create_app(engine.config)
    app[STATE].engine = aengine
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        r = await client.post("/v1/completions", json=body(max_tokens=3), headers={"traceparent": TRACEPARENT})
        assert r.status == 200 and r.headers["Server-Timing"].startswith("queue;dur=")
        r = await client.post("/v1/completions", json=body(max_tokens=3, stream=True))
        assert r.status == 200 and "Server-Timing" not in r.headers
        await r.read()
    finally:
        await client.close()
        await aengine.shutdown()


def test_untraced_requests_record_timestamps_but_no_events(engine):
    from sluice.scheduling.sampling_params import SamplingParams

    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    final = []
    while engine.has_unfinished_requests():
        final += [o for o in engine.step() if o.finished]
    (out,) = final
    tl = out.timeline
    assert tl.events is None and tl.request is None  # the Request is not kept past the end
    assert tl.arrival <= tl.first_scheduled <= tl.first_token <= tl.end
    assert (tl.num_prompt_tokens, tl.num_output_tokens, tl.finish_reason) == (out.num_prompt_tokens, 3, "length")


def test_a_swap_preemption_is_recorded_as_such():
    from sluice.metrics.tracing import Timelines
    from sluice.scheduling.output import SchedulerOutput
    from tests.support.sched_helpers import make_request

    book = Timelines()
    swapped, dropped, plain = (make_request(rid, [1, 2, 3]) for rid in ("swapped", "dropped", "plain"))
    book.start(swapped, {})
    book.start(dropped, {})
    book.start(plain)  # not traced
    out = SchedulerOutput(preempted_ids=["swapped", "dropped", "plain"], swapped_out_ids=["swapped"])
    book.on_step(out, 5.0, 6.0)
    assert book._traced["swapped"].events[-1] == ("preempted", 5.0, {"mode": "swap"})
    assert book._traced["dropped"].events[-1] == ("preempted", 5.0, {"mode": "recompute"})
    assert "plain" not in book._traced


# ---- the real server, exporting over OTLP/HTTP to a collector stand-in --------------------------------------

async def test_sluice_serve_exports_spans_over_otlp_http(model_dir, tmp_path):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from aiohttp import ClientSession, web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tests.support.server import Server

    spans = []

    async def collect(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        spans.extend(sp for rs in msg.resource_spans for ss in rs.scope_spans for sp in ss.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", collect)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    endpoint = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/traces"
    # The SDK's batch processor exports every 5 s unless its standard variable says otherwise.
    srv = await asyncio.to_thread(
        lambda: Server(model_dir, tmp_path, "--num-kv-blocks", "64", "--otlp-traces-endpoint", endpoint,
                       env={"OTEL_BSP_SCHEDULE_DELAY": "100"}).wait_ready())
    try:
        async with ClientSession() as s, s.post(srv.url + "/v1/completions", json=body(max_tokens=5),
                                                headers={"traceparent": TRACEPARENT}) as r:
            assert r.status == 200 and r.headers["Server-Timing"].startswith("queue;dur=")
        for _ in range(100):  # the batch processor sends within its schedule (0.1 s here)
            if spans:
                break
            await asyncio.sleep(0.1)
        (span,) = spans
        assert span.name == "llm_request" and span.trace_id.hex() == TRACE_ID
        assert span.parent_span_id.hex() == PARENT_SPAN
        assert [e.name for e in span.events][-2:] == ["first_token", "finished"]
    finally:
        assert srv.stop() == 0, srv.log()[-4000:]
        await runner.cleanup()
