"""AsyncEngine: the asyncio face of the sync LLMEngine — one worker thread steps, per-request queues stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from sluice.cpu import release_freed_memory
from sluice.metrics.tracing import RequestTracer
from sluice.scheduling.outcomes import ErrorCode, FinishReason, RequestRejected
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import SluiceConfig
from sluice.service.engine.engine import LLMEngine
from sluice.service.engine.outputs import EngineOutput
from sluice.service.executor.pooling import ClassifierSpec, EmbeddingSpec
from sluice.service.structured.grammar import GrammarBusyError

logger = logging.getLogger("sluice.async_engine")
READER_LAG_FACTOR = 8
# Idle this long after work (CPU), the loop hands glibc's freed memory back: a trim walks the heap (1-2 ms with
# nothing to return, ~50 ms for 750 MB), so back-to-back requests never wait on one.
IDLE_TRIM_S = 0.25


class EngineDeadError(RuntimeError):
    """The engine loop died; nothing more will be served."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and takes no new requests."""


class QueueFullError(RuntimeError):
    """Too many requests are already waiting for their first token."""


class SyncEngine(Protocol):
    """What AsyncEngine drives in its worker thread: LLMEngine, or tests/support/fake_engine.py's stand-in."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    loras: Any  # the LoRA adapter registry, or None
    embedding: EmbeddingSpec | None  # how /v1/embeddings pools, or None where it serves none
    num_waiting: int
    num_running: int
    num_swapped: int
    device: torch.device  # where the steps run: idle trims are for a CPU's malloc only

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, trace_headers: Mapping[str, str] | None = None,
                    flow: str | None = None, tenant: str | None = None) -> int: ...
    def abort_request(self, request_id: str) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[EngineOutput]: ...
    def kv_stats(self) -> dict: ...
    # Optional: compile_grammar_async (structured outputs) and last_stats (preemption counts).


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the API reads about the served model: the engine client's whole static surface."""

    served_model_name: str
    max_model_len: int  # prompt plus completion tokens, capped at what the KV cache holds
    vocab_size: int  # token ids run 0 .. vocab_size - 1 (the model's, which may exceed the tokenizer's)
    tokenizer: Any  # a transformers tokenizer: encode, decode, apply_chat_template, convert_ids_to_tokens
    loras: Any = None  # the LoRA adapter registry (lora/manager.py: LoRARegistry, thread-safe); None: LoRA off
    embedding: EmbeddingSpec | None = None  # how /v1/embeddings pools (None: a stand-in that serves none)
    runner_type: str = "generate"  # --runner resolved: 'pooling' serves /v1/rerank and /v1/score
    classifier: ClassifierSpec | None = None  # a decoder reranker's classifier tokens (None: not a reranker)

    @classmethod
    def of(cls, engine: SyncEngine) -> ModelInfo:
        """Read from an LLMEngine (or a stand-in with the same attributes)."""
        return cls(engine.served_model_name, engine.max_model_len, engine.vocab_size, engine.tokenizer,
                   engine.loras, engine.embedding, getattr(engine, "runner_type", "generate"),
                   getattr(engine, "classifier", None))


@dataclass(slots=True, eq=False)  # identity semantics: groups live in sets
class _Group:
    """The engine requests of one API call (n samples, several prompts) and their shared output queue."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)  # as seen by the dispatcher
    size: int = 1  # engine requests in the group: each step may queue one output for every one of them
    last_read: float = field(default_factory=time.monotonic)  # when its reader last took an output


class RequestStream:
    """Outputs of one API call's engine requests; `async with` it so leaving early aborts the rest."""

    __slots__ = ("_engine", "_group", "_remaining")

    def __init__(self, engine: AsyncEngine, group: _Group, count: int):
        self._engine, self._group, self._remaining = engine, group, count

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._remaining == 0:
            raise StopAsyncIteration
        out = await self._group.queue.get()
        self._group.last_read = time.monotonic()
        if out.finished:
            self._remaining -= 1
        return out

    async def aclose(self) -> None:
        """Abort whatever has not finished (client gone, handler failed); idempotent."""
        self._engine._release(self._group)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncEngine:
    """Runs LLMEngine.step() in one dedicated thread; every engine call goes through that thread, in order."""

    def __init__(self, engine: SyncEngine, max_queued_requests: int = 256, max_stream_buffer: int = 4096,
                 executor: ThreadPoolExecutor | None = None, tracer: RequestTracer | None = None,
                 reader_stall_timeout: float = 30.0):
        self.engine = engine  # the engine thread's own: the API reads `model`, `stats` and the streams instead
        self.model = ModelInfo.of(engine)
        self.tracer = tracer  # None: tracing off, requests carry no trace headers
        self.max_queued_requests = max_queued_requests
        self.max_stream_buffer = max_stream_buffer
        # A full buffer cuts a stream off only once its reader has taken nothing for this long: a reader that
        # keeps taking outputs, however far a loaded machine leaves it behind, is slow, not gone.
        self.reader_stall_timeout = reader_stall_timeout
        # One worker: add, abort and step never overlap, and FIFO order means an abort queued after an
        # add always finds the request.
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-engine")
        self._owner: dict[str, _Group] = {}  # unfinished engine request id -> its group
        self._no_output: set[str] = set()  # admitted, no output yet: what the queue limit counts
        self._groups: set[_Group] = set()  # groups whose stream is still open
        self._idle = asyncio.Event()
        self._idle.set()
        self._wakeup = asyncio.Event()
        # the engine ran out of work since the last trim; due at start, for what start-up freed (the prompt bound's
        # tables, the app's set-up)
        self._trim_due = engine.device.type == "cpu"
        self._task: asyncio.Task | None = None
        self.dead: BaseException | None = None
        self.draining = False
        self.stats: dict = {}
        self._preemptions = {"swap": 0, "recompute": 0}  # since start; written by the worker thread only

    # --- lifecycle ---------------------------------------------------------------------------------

    @classmethod
    async def load(cls, config: SluiceConfig) -> AsyncEngine:
        """Build the LLMEngine (loading the model) in the worker thread that will run its steps."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-engine")
        endpoint = config.server.otlp_traces_endpoint
        tracer = RequestTracer(config.model.served_model_name, endpoint) if endpoint else None  # fails fast
        engine = await asyncio.get_running_loop().run_in_executor(executor, LLMEngine, config)
        if tracer is not None:
            tracer.model_name = engine.served_model_name
        return cls(engine, config.server.max_queued_requests, config.server.max_stream_buffer, executor, tracer,
                   config.server.stream_write_timeout)

    def start(self) -> None:
        """Start the background loop; call from the event loop."""
        self.stats = self._read_stats()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sluice-engine-loop")

    @property
    def is_alive(self) -> bool:
        """False once the loop has died (or was never started)."""
        return self.dead is None and self._task is not None and not self._task.done()

    async def drain(self, timeout: float) -> None:
        """Stop accepting; let in-flight requests finish for up to `timeout` s, then abort them with an error."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            logger.warning("shutdown timeout: aborting %d in-flight requests", len(self._owner))
            for group in set(self._owner.values()):
                self._fail(group, FinishReason.ABORT, ErrorCode.SHUTDOWN, "the server is shutting down")
            try:  # the handlers write their error events and return
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except asyncio.TimeoutError:
                logger.warning("%d streams still open after the shutdown timeout", len(self._groups))

    async def shutdown(self) -> None:
        """Stop the loop and the worker thread."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.tracer is not None:
            self.tracer.shutdown()

    # --- requests ----------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Admitted requests that have produced nothing yet (queued or prefilling)."""
        return len(self._no_output)

    @property
    def num_open_streams(self) -> int:
        """API calls whose output stream is still open."""
        return len(self._groups)

    @property
    def num_running(self) -> int:
        """Requests in the engine's running batch after the last step."""
        return self.stats.get("running", 0)

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        """Admit one request; the returned stream yields its outputs. ValueError: the prompt can never run."""
        return await self.add_requests([(request_id, prompt, params)], priority)

    async def add_requests(
        self, requests: list[tuple[str, str | list[int], SamplingParams]], priority: int = 0,
        trace_headers: Mapping[str, str] | None = None, tenant: str | None = None,
    ) -> RequestStream:
        """Admit several requests atomically (all or none) with one stream of their outputs.

        `trace_headers` (with a tracer): each engine request's span is a child of the context they carry.
        They are one flow for fair shares, charged to `tenant` (None: to the flow itself).
        """
        if self.dead is not None or self._task is None:
            raise EngineDeadError("the engine is not running")
        if self.draining:
            raise EngineDrainingError("the server is shutting down")
        if self.num_waiting + len(requests) > self.max_queued_requests:
            raise QueueFullError(f"more than {self.max_queued_requests} requests are waiting")
        ids = [rid for rid, _, _ in requests]
        # Checked here, not only by the scheduler: the groups are registered below before the add job runs, and
        # a duplicate would take over the routing of a live request's outputs.
        if len(set(ids)) != len(ids) or any(rid in self._owner for rid in ids):
            raise RequestRejected("duplicate request id", ErrorCode.DUPLICATE_REQUEST_ID)
        loop = asyncio.get_running_loop()
        for constraint in {p.structured_output for _, _, p in requests} - {None}:
            # Compiled in the grammar pool (and cached): the add in the worker then finds it ready. A handler
            # cancelled here (client gone) gives up its share of the compile.
            try:
                await self.engine.compile_grammar_async(constraint)
            except GrammarBusyError as e:
                raise QueueFullError(str(e)) from None
        group = _Group(unfinished=set(ids), size=len(ids))
        # Registered before the add job runs, so the step that follows cannot emit unclaimed outputs.
        for rid in ids:
            self._owner[rid] = group
        self._no_output.update(ids)
        self._groups.add(group)
        self._idle.clear()
        try:
            await loop.run_in_executor(self._executor, self._add_in_worker, requests, priority,
                                       trace_headers if self.tracer is not None else None, tenant)
        except GrammarBusyError as e:  # a grammar evicted since its compile above, compiled again and queued out
            self._release(group)
            raise QueueFullError(str(e)) from None
        except BaseException:  # ValueError, or the handler cancelled: the add may still run, abort after it
            self._release(group)
            raise
        self._wakeup.set()
        return RequestStream(self, group, len(ids))

    def _add_in_worker(self, requests, priority: int, trace_headers: Mapping[str, str] | None,
                       tenant: str | None = None) -> None:
        added, flow = [], requests[0][0]  # the call's first request id names its flow
        try:
            for rid, prompt, params in requests:
                self.engine.add_request(rid, prompt, params, priority, trace_headers=trace_headers, flow=flow,
                                        tenant=tenant)
                added.append(rid)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise

    def _release(self, group: _Group) -> None:
        """Forget a group; abort its unfinished requests in the worker (after any add still queued there)."""
        self._groups.discard(group)
        self._abort(self._detach(group))
        if not self._groups:
            self._idle.set()

    def _detach(self, group: _Group) -> list[str]:
        """Stop routing outputs to a group; returns its unfinished request ids."""
        left = [rid for rid in group.unfinished if self._owner.get(rid) is group]
        for rid in left:
            del self._owner[rid]
            self._no_output.discard(rid)
        group.unfinished.clear()
        return left

    def _abort(self, ids: list[str]) -> None:
        """Queue aborts behind whatever the worker has queued; the next step returns their blocks."""
        if not ids:
            return
        try:
            self._executor.submit(self._abort_in_worker, ids)
        except RuntimeError:  # the executor is shut down: the process is exiting
            return
        self._wakeup.set()

    def _abort_in_worker(self, ids: list[str]) -> None:
        for rid in ids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)

    def _fail(self, group: _Group, reason: FinishReason, code: ErrorCode, message: str) -> None:
        """End every unfinished request of a group with a terminal error output (stream stays open)."""
        left = self._detach(group)  # a second failure finds nothing left
        for rid in left:
            group.queue.put_nowait(EngineOutput.ended(rid, reason, code, message))
        self._abort(left)

    # --- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                # Cleared before the step is queued: an add that completes later sets it again.
                self._wakeup.clear()
                outputs, busy, self.stats = await loop.run_in_executor(self._executor, self._step)
                self._dispatch(outputs)
                if not busy:
                    if self._trim_due and not await self._woken_within(IDLE_TRIM_S):
                        self._trim_due = False
                        # glibc keeps a burst's or a long prompt's freed activations resident; an idle server
                        # gives them back
                        await loop.run_in_executor(self._executor, release_freed_memory)
                    await self._wakeup.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # step() only raises for what it cannot contain: the engine is gone
            logger.exception("engine loop died")
            self.dead = exc
            for group in set(self._owner.values()):
                self._fail(group, FinishReason.ERROR, ErrorCode.ENGINE_DEAD, "the engine failed")

    def _step(self) -> tuple[list[EngineOutput], bool, dict]:
        """Worker thread: one step if there is work, then the state the loop needs."""
        outputs = []
        ran = self.engine.has_unfinished_requests()
        if ran:
            outputs = self.engine.step()
            last = getattr(self.engine, "last_stats", None)  # per-step counts: summed here for /health
            if last is not None:
                self._preemptions["swap"] += last.num_preemptions_swap
                self._preemptions["recompute"] += last.num_preemptions_recompute
        busy = self.engine.has_unfinished_requests()
        self._trim_due |= ran and not busy and self.engine.device.type == "cpu"
        return outputs, busy, self._read_stats()

    async def _woken_within(self, seconds: float) -> bool:
        """Whether new work arrives within `seconds`."""
        try:
            await asyncio.wait_for(self._wakeup.wait(), seconds)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            return False
        return True

    def _read_stats(self) -> dict:
        e = self.engine
        return {"waiting": e.num_waiting, "running": e.num_running, "swapped": e.num_swapped, **e.kv_stats(),
                "preemptions": dict(self._preemptions)}

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        """Hand outputs to their streams; a stream whose reader stopped taking them is cut off."""
        now = time.monotonic()
        for out in outputs:
            if out.timeline is not None and out.timeline.events is not None and self.tracer is not None:
                try:  # a request whose client left still gets its span: this is its abort notice
                    self.tracer.emit(out.timeline)
                except Exception:
                    logger.exception("building the span of %s failed", out.request_id)
            group = self._owner.get(out.request_id)
            if group is None:  # its stream was closed: this is the abort notice, or a late straggler
                continue
            self._no_output.discard(out.request_id)
            # The bound is per request: a 64-choice call fills 64 slots in one step even for a fast reader.
            # A reader still taking outputs may fall behind up to READER_LAG_FACTOR times the buffer, no further.
            buffered, bound = group.queue.qsize(), self.max_stream_buffer * group.size
            if buffered >= bound and (now - group.last_read >= self.reader_stall_timeout
                                      or buffered >= READER_LAG_FACTOR * bound):
                logger.warning("request %s: client not reading for %.1fs, %d outputs buffered; aborting",
                               out.request_id, now - group.last_read, buffered)
                self._fail(group, FinishReason.ERROR, ErrorCode.SLOW_READER,
                           "the client did not read the stream fast enough")
                continue
            if out.finished:
                group.unfinished.discard(out.request_id)
                del self._owner[out.request_id]
            group.queue.put_nowait(out)
