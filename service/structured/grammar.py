"""Grammar-constrained decoding with xgrammar: compile once per constraint text, mask the batch's logits per step.

A request's matcher is its grammar state. It advances only when a token is sampled for the request, so it
follows the request through chunked prefill (no token until the prompt is done), recompute preemption (the
generated tokens are kept, only their KV is recomputed) and swap, and each of `n` samples has its own.

Every bound is in GrammarConfig: compiles run in child processes under a time limit (grammar_compile.py),
compiled grammars are cached by bytes, and a row whose grammar work per token passes its budget is ended.
When a row's grammar can only end, its end wins over `min_tokens`: the stop token is let through.

A row's mask depends only on the tokens its matcher has accepted, so it is known before the step's forward:
`start_masks` fills the bitmask on a worker thread (xgrammar releases the GIL) while the model runs, and
`mask_logits` waits for it. A grammar whose mask takes milliseconds a row then costs the step the part of its fill
that the forward does not cover, not the whole of it.

A reasoning model's constraint (`StructuredOutput.after_reasoning`) waits for the end of the thinking: its
matcher is neither applied nor advanced until the end tag's tokens have been generated, then starts fresh.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sluice.scheduling.output import ScheduledRequest
from sluice.scheduling.sampling_params import ReasoningSpan, StructuredOutput
from sluice.service.config import GrammarConfig
from sluice.service.structured.grammar_checks import TOO_COMPLEX, GrammarError
from sluice.service.structured.grammar_compile import CompileJob, CompileService, GrammarBusyError

__all__ = ["GrammarBusyError", "GrammarCompiler", "GrammarError", "GrammarState", "GrammarStep", "GrammarUnavailable"]
logger = logging.getLogger("sluice.grammar")
ERRORS_KEPT = 256  # refusals remembered by constraint text: a client resending one never recompiles it
STRIKES = 3  # tokens in a row over the budget before a row is ended: one slow step (a busy host) is not enough


class GrammarUnavailable(RuntimeError):
    """xgrammar is not installed: every constrained request is refused, the rest are served."""


class GrammarCompiler:
    """Compiles StructuredOutput constraints for one tokenizer in child processes; cached by text and bytes."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], config: GrammarConfig | None = None):
        try:
            import xgrammar as xgr  # imported on first use: engines without constrained requests never pay for it
        except ImportError:
            raise GrammarUnavailable("structured outputs and tool grammars need xgrammar, which this server lacks "
                                     "(pip install xgrammar)") from None

        self._xgr = xgr
        self.config = config = config or GrammarConfig()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self.cache_bytes = 0
        self._errors: OrderedDict[tuple[str, str], GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self._service = CompileService(self.info.serialize_json(), config.grammar_compile_workers,
                                       config.grammar_compile_timeout, config.grammar_compile_queue, self._finish,
                                       config.grammar_queue_timeout)

    def compile(self, constraint: StructuredOutput):
        """The compiled grammar, waiting for it; GrammarError when it is invalid or too complex."""
        found = self._lookup(constraint)
        if found is not None:
            return found
        job = self._service.submit(constraint)
        return self._result(constraint, job, lambda: job.future.result())

    async def compile_async(self, constraint: StructuredOutput):
        """compile() for the event loop: a waiter that is cancelled releases its share of the job."""
        found = self._lookup(constraint)
        if found is not None:
            return found
        job = self._service.submit(constraint)
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def done(future):  # in the compile thread
            loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))

        job.future.add_done_callback(done)
        try:
            await waiter
        except asyncio.CancelledError:
            self._service.release(job)
            raise
        return self._result(constraint, job, lambda: job.future.result(timeout=0))

    def _lookup(self, c: StructuredOutput):
        """A cached grammar, a cached refusal raised, or a refusal on size; None: it must be compiled."""
        with self._lock:
            compiled = self._cache.get(c.key)
            if compiled is not None:
                self._cache.move_to_end(c.key)
                return compiled
            error = self._errors.get(c.key)
        if error is not None:
            raise _for_param(error, c.param)
        if len(c.spec.encode()) > self.config.grammar_max_bytes:
            raise GrammarError(f"{c.param} is larger than {self.config.grammar_max_bytes} bytes "
                               "(--grammar-max-bytes)", c.param, TOO_COMPLEX)
        return None

    def _result(self, c: StructuredOutput, job: CompileJob, get):
        try:
            return get()
        except GrammarError as e:
            if job.abandoned:
                raise
            with self._lock:  # a refusal is as deterministic as a compile (a timeout nearly so)
                self._errors[c.key] = e
                if len(self._errors) > ERRORS_KEPT:
                    self._errors.popitem(last=False)
            raise _for_param(e, c.param) from None

    def _finish(self, c: StructuredOutput, serialized: str):
        """Compile thread: the child's JSON as a CompiledGrammar, cached within the byte bound."""
        compiled = self._xgr.CompiledGrammar.deserialize_json(serialized, self.info)
        size = compiled.memory_size_bytes
        limit = self.config.grammar_cache_bytes
        if size > limit:
            raise GrammarError(f"{c.param} compiles to {size} bytes, more than the grammar cache holds "
                               f"({limit}, --grammar-cache-bytes); simplify it", c.param, TOO_COMPLEX)
        with self._lock:
            if c.key not in self._cache:
                self._cache[c.key], self._sizes[c.key] = compiled, size
                self.cache_bytes += size
            while self.cache_bytes > limit:
                key, _ = self._cache.popitem(last=False)
                self.cache_bytes -= self._sizes.pop(key)
        return compiled


def _for_param(e: GrammarError, param: str) -> GrammarError:
    """The same refusal, naming the parameter of the request at hand (identical texts share one compile)."""
    if e.param == param:
        return e
    return GrammarError(str(e).replace(e.param, param), param, e.code)


class GrammarStep(enum.Enum):
    """What advancing a row's matcher by its sampled token came to."""

    CONTINUE = "continue"
    COMPLETE = "complete"  # the grammar is satisfied: the request stops
    REJECTED = "rejected"  # the token broke the grammar (the mask was not applied): an error
    OVER_BUDGET = "over_budget"  # the row's grammar work per token passed the budget: an error


class Thinking:
    """A row whose constraint waits for the end of its reasoning: its last tokens, matched against the end tag."""

    __slots__ = ("span", "tail", "first", "done")

    def __init__(self, span: ReasoningSpan):
        self.span, self.tail, self.first, self.done = span, (), True, False

    @property
    def offers_start(self) -> bool:
        """The first token may open the thinking or start the constraint: the mask is the grammar's plus it."""
        return self.first and self.span.start is not None

    def feed(self, token_id: int) -> bool:
        """Whether the token belongs to the thinking (`done` once it closed it); False: the constraint starts with
        this token (an optional thinking the output did not open)."""
        if self.first:
            self.first = False
            if self.span.start is not None and token_id != self.span.start:
                return False
        self.tail = (*self.tail, token_id)[-len(self.span.end):]
        self.done = self.tail == self.span.end
        return True


class GrammarState:
    """The matchers of the constrained requests in flight, and the bitmask the sampler's logits are masked by."""

    def __init__(self, compiler: GrammarCompiler, max_num_seqs: int):
        self.compiler = compiler
        self._xgr = compiler._xgr
        self.matchers: dict[str, object] = {}
        self.constraints: dict[str, StructuredOutput] = {}
        self.thinking: dict[str, Thinking] = {}  # rows whose constraint waits for the end of the reasoning
        self._bitmask = self._xgr.allocate_token_bitmask(max_num_seqs, compiler.vocab_size)
        self._budget = compiler.config.grammar_token_budget_ms / 1000
        self._mask_seconds: dict[str, float] = {}  # this step's mask fill per row, until its token is accepted
        self._strikes: dict[str, int] = {}
        self.last_cost_ms: dict[str, float] = {}  # the latest token's grammar work per row, for error messages
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar-mask")
        # The step's rows start_masks is filling: (the rows sampled, the constrained ones among them, the fill).
        self._filling: tuple[list[ScheduledRequest], list[int], Future] | None = None

    def add(self, request_id: str, constraint: StructuredOutput) -> None:
        """Start a request's matcher (the compile is a cache hit when the API compiled it first)."""
        self.matchers[request_id] = self._xgr.GrammarMatcher(self.compiler.compile(constraint))
        self.constraints[request_id] = constraint
        if constraint.after_reasoning is not None and constraint.after_reasoning.end:
            self.thinking[request_id] = Thinking(constraint.after_reasoning)

    def remove(self, request_id: str) -> None:
        """Forget a request that ended."""
        for d in (self.matchers, self.constraints, self.thinking, self._mask_seconds, self._strikes, self.last_cost_ms):
            d.pop(request_id, None)

    def start_masks(self, to_sample: list[ScheduledRequest]) -> None:
        """Begin filling the bitmask rows of this step's constrained rows on the worker thread (called before the
        forward; mask_logits waits for it)."""
        self._wait()  # a step that failed after starting its fill: its rows are not this step's
        rows = self._rows(to_sample)
        if rows:
            fill = self._filler.submit(_fill, self._jobs(to_sample, rows), self._bitmask_for(len(to_sample)))
            self._filling = (to_sample, rows, fill)

    def mask_logits(self, logits: torch.Tensor, to_sample: list[ScheduledRequest]) -> None:
        """Set the logits of every token the grammar forbids to -inf, for the constrained rows only."""
        if self._filling is not None and self._filling[0] is to_sample:
            rows, seconds = self._filling[1], self._wait()
        else:
            self._wait()
            rows = self._rows(to_sample) if self.matchers else []
            if not rows:
                return
            seconds = _fill(self._jobs(to_sample, rows), self._bitmask_for(len(to_sample)))
        bitmask = self._bitmask
        thinking = self.thinking
        for i in rows:
            rid = to_sample[i].request_id
            self._mask_seconds[rid] = seconds.get(rid, 0.0)
            if rid in thinking:  # the first token may also open the thinking
                _set_bit(bitmask[i], thinking[rid].span.start, True)
            if to_sample[i].min_tokens_pending and self._only_stops(bitmask[i], rid):
                to_sample[i].min_tokens_pending = False  # the grammar's end wins over min_tokens
        mask = bitmask[: len(to_sample)]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        width = min(logits.shape[-1], self.compiler.vocab_size)
        self._xgr.apply_token_bitmask_inplace(logits[:, :width], mask, indices=rows)
        if logits.shape[-1] > width:  # padded vocabulary rows past the tokenizer's: never grammatical
            logits[rows, width:] = float("-inf")

    def _rows(self, to_sample: list[ScheduledRequest]) -> list[int]:
        """Indices of the rows a matcher constrains now (a reasoning row only once its thinking may start)."""
        thinking = self.thinking
        return [i for i, r in enumerate(to_sample) if r.request_id in self.matchers
                and (r.request_id not in thinking or thinking[r.request_id].offers_start)]

    def _jobs(self, to_sample: list[ScheduledRequest], rows: list[int]) -> list[tuple[int, str, object]]:
        """(bitmask row, request id, matcher) of each constrained row: what _fill fills."""
        return [(i, to_sample[i].request_id, self.matchers[to_sample[i].request_id]) for i in rows]

    def _bitmask_for(self, rows: int) -> torch.Tensor:
        if self._bitmask.shape[0] < rows:
            self._bitmask = self._xgr.allocate_token_bitmask(rows, self.compiler.vocab_size)
        return self._bitmask

    def _wait(self) -> dict[str, float]:
        """Wait for a fill in flight; its CPU seconds per request."""
        if self._filling is None:
            return {}
        future, self._filling = self._filling[2], None
        return future.result()

    def _only_stops(self, row: torch.Tensor, request_id: str) -> bool:
        """Whether a filled bitmask row allows stop tokens and nothing else (read only for completed grammars)."""
        if not self.matchers[request_id].is_completed():
            return False
        words = row.clone()
        for t in self.compiler.stop_token_ids:
            _set_bit(words, t, False)
        return not bool(words.any())

    def accept(self, request_id: str, token_id: int) -> GrammarStep:
        """Advance a request's matcher by its sampled token, timing its grammar work for this token."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return GrammarStep.CONTINUE
        thinking = self.thinking.get(request_id)
        if thinking is not None:
            if thinking.feed(token_id):  # still reasoning: the matcher waits, fresh, for the first answer token
                self._mask_seconds.pop(request_id, None)
                if thinking.done:
                    del self.thinking[request_id]
                return GrammarStep.CONTINUE
            del self.thinking[request_id]
        started = time.perf_counter()
        accepted = matcher.accept_token(token_id)
        cost = time.perf_counter() - started + self._mask_seconds.pop(request_id, 0.0)
        self.last_cost_ms[request_id] = cost * 1000
        if not accepted:
            logger.error("request %s: sampled token %d rejected by its grammar", request_id, token_id)
            return GrammarStep.REJECTED
        if matcher.is_terminated():
            return GrammarStep.COMPLETE
        strikes = self._strikes[request_id] = self._strikes.get(request_id, 0) + 1 if cost > self._budget else 0
        return GrammarStep.OVER_BUDGET if strikes >= STRIKES else GrammarStep.CONTINUE


def _fill(matchers: list[tuple[int, str, object]], bitmask: torch.Tensor) -> dict[str, float]:
    """Fill bitmask row i from each matcher; the CPU seconds each took (the thread's own time: the budget is the
    grammar's cost, not the forward's contention for the cores)."""
    seconds = {}
    for i, rid, matcher in matchers:
        started = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask, i)
        seconds[rid] = time.thread_time() - started
    return seconds


def _set_bit(row: torch.Tensor, token_id: int, on: bool) -> None:
    """Set or clear one token's bit in a bitmask row of signed 32-bit words (xgrammar's layout)."""
    bit = 1 << (token_id & 31)
    word = int(row[token_id >> 5])
    word = word | bit if on else word & ~bit
    row[token_id >> 5] = (word + (1 << 31)) % (1 << 32) - (1 << 31)  # back to a signed 32-bit word
