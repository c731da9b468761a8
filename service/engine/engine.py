"""LLMEngine: the synchronous engine core — scheduler, model runner and detokenizers, one step at a time."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from sluice.cpu import configure_torch_threads
from sluice.kvcache.manager import KVCacheManager
from sluice.metrics.prometheus import SluiceMetrics
from sluice.metrics.tracing import Timelines
from sluice.metrics.vllm_names import CacheConfigInfo
from sluice.scheduling.outcomes import ErrorCode, FinishReason
from sluice.scheduling.output import SchedulerOutput, SchedulerStats
from sluice.scheduling.request import Request, RequestStatus
from sluice.scheduling.sampling_params import SamplingParams
from sluice.scheduling.scheduler import Scheduler
from sluice.service.config import SluiceConfig, parse_hf_overrides
from sluice.service.engine.constrained import ConstrainedDecoding
from sluice.service.engine.detokenizer import IncrementalDetokenizer
from sluice.service.engine.kv_events import KVEventPublisher, KVEventsConfig
from sluice.service.engine.outputs import Completion, EngineOutput
from sluice.service.executor.logits_controls import AllowedMasks, apply_logit_controls
from sluice.service.executor.pooling import resolve_embedding, resolve_runner
from sluice.service.structured.grammar import GrammarState

logger = logging.getLogger("sluice.engine")

__all__ = ["Completion", "EngineOutput", "LLMEngine", "freeze_startup_objects"]


class LLMEngine(ConstrainedDecoding):
    """Not thread-safe: call add_request / abort_request / step from one thread (AsyncEngine sees to it)."""

    def __init__(self, config: SluiceConfig | None = None, model=None, tokenizer=None) -> None:
        from sluice.service.executor.kv_sizing import format_bytes, model_context_length, model_weight_bytes
        from sluice.service.executor.model_loader import (
            apply_hf_overrides,
            auto_dtype,
            eos_token_ids,
            load_model,
            resolve_precision,
        )
        from sluice.service.executor.model_runner import ModelRunner
        from sluice.service.executor.weight_prep import prepare_weights

        config = config or SluiceConfig()
        config.validate()
        kv_events = KVEventsConfig.parse(config.server.kv_events_config)  # a bad one is refused before the load
        self.device, self.dtype, settings = resolve_precision(config.model.model if model is None else "",
                                                              config.model, config.model.device, config.model.dtype)
        config = dataclasses.replace(config, model=settings)  # --quantization auto resolved
        quantization = settings.quantization
        if quantization == "none" and config.model.dtype == "auto":  # (a quantized format computes in float32)
            if model is not None:  # a given model keeps the precision it was built in
                self.dtype = next(model.parameters()).dtype
                logger.info("dtype auto: %s, the given model's", str(self.dtype).removeprefix("torch."))
            else:
                logger.info("dtype auto: %s on %s, as %s", str(self.dtype).removeprefix("torch."), self.device,
                            auto_dtype(self.device)[1])
        threads = configure_torch_threads(config.model.num_threads) if self.device.type == "cpu" else 0
        # From here on the config holds what the engine really runs with (the auto budget resolved).
        sched = config.scheduler.resolved(self.device.type, threads)
        self.config = config = dataclasses.replace(config, scheduler=sched)
        given_model = model is not None
        if model is None:  # Sluice's own model where the architecture allows, in the weight formats asked for
            model, tokenizer = load_model(config.model.model, self.device, self.dtype,
                                          cache_dir=config.model.cache_dir or None, settings=config.model)
        elif tokenizer is None:
            raise ValueError("a tokenizer must accompany an explicitly given model")
        elif quantization == "gguf":
            raise ValueError("--quantization gguf needs the engine to load the model itself (from a .gguf file)")
        else:
            model = prepare_weights(model, config.model, self.device, self.dtype)
        if given_model and config.model.hf_overrides:  # (load_model applies them before it builds the model)
            apply_hf_overrides(model.config, parse_hf_overrides(config.model.hf_overrides))
        self.model, self.tokenizer = model, tokenizer
        self.served_model_name = config.model.served_model_name or _default_served_name(config.model.model)
        self.loras, lora_slots = None, None  # the adapter registry, where LoRA is on (lora/manager.py)
        if config.lora.enabled:  # before the runner sizes the KV cache: the adapter slots take memory too
            from sluice.service.executor.lora.manager import enable_lora

            self.loras, lora_slots = enable_lora(model, config.lora, self.device, self.dtype, self.served_model_name)
        self.vocab_size = int(model.config.vocab_size)
        m = config.model  # how /v1/embeddings pools this model (any model serves it: its final hidden state)
        self.embedding = resolve_embedding(m.pooling, m.embedding_normalize, m.embedding_dimensions, model.config)
        # --runner and a decoder reranker's classifier tokens (/v1/rerank, /v1/score), from the overridden config
        self.runner_type, self.classifier = resolve_runner(m.runner, model.config, tokenizer, self.vocab_size)

        self.runner = ModelRunner(
            model, config.cache, self.device, self.dtype, sched.max_num_batched_tokens, sched.max_num_seqs,
            sched.max_model_len, sched.preemption_mode,
        )
        self.runner.lora_slots = lora_slots
        if not config.model.enforce_eager:
            self.runner.capture_graphs()
        block_size = config.cache.block_size
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.kv_cache_bytes = self.runner.kv_cache_bytes
        # Logged before the max_model_len check below, so a refusal shows what the cache was sized to.
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %s %s on %s (%s)", self.num_kv_blocks,
                    config.cache.block_size, self.num_kv_blocks * config.cache.block_size,
                    format_bytes(self.kv_cache_bytes), str(self.runner.kv_dtype).removeprefix("torch."), self.device,
                    self.runner.kv_cache_source)
        if sched.preemption_mode == "swap" and not self.runner.num_host_blocks:
            block = format_bytes(self.kv_cache_bytes / self.num_kv_blocks)
            raise ValueError(f"--preemption-mode swap needs a host swap pool, but --swap-space "
                             f"{config.cache.swap_space} holds no KV block of {block}: pass --swap-space auto or a "
                             "size in GiB, or use --preemption-mode recompute")
        # A request longer than the whole cache could never run: the context is capped at what the cache holds.
        capacity = self.num_kv_blocks * block_size
        if sched.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {sched.max_model_len} is larger than the KV cache's {capacity} tokens "
                f"({self.num_kv_blocks} blocks of {block_size}); raise --kv-cache-memory or --num-kv-blocks, "
                "or lower --max-model-len"
            )
        model_len = sched.max_model_len or model_context_length(model)
        if model_len > capacity:
            logger.info("context capped at the KV cache's %d tokens (the model allows %d)", capacity, model_len)
        self.max_model_len = min(model_len, capacity)
        self.kv_events = None if kv_events is None else KVEventPublisher(  # drops are counted once metrics exist
            kv_events, on_drop=lambda n: self.metrics.observe_kv_events_dropped(n))
        self.kv_manager = KVCacheManager(
            self.num_kv_blocks, block_size, config.cache.enable_prefix_caching, self.runner.num_host_blocks,
            self.kv_events.sink if self.kv_events is not None else None,
        )
        self.scheduler = Scheduler(sched, self.kv_manager, self.max_model_len,
                                   config.lora.max_loras if self.loras is not None else 0)

        eos_ids = eos_token_ids(model, tokenizer)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self._extra_eos_ids = list(eos_ids[1:])
        self._eos_ids = list(eos_ids)
        self.runner.logits_processors.append(apply_logit_controls)  # first: grammar masks come after biases
        self._allowed_masks = AllowedMasks(self.vocab_size, self.device)
        self._grammar: GrammarState | None = None  # built on the first constrained request
        self._grammar_lock = threading.Lock()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending_outputs: list[EngineOutput] = []  # abort notices delivered by the next step()
        self.timelines = Timelines()
        self.stat_loggers: list[Callable[[SchedulerStats], None]] = []
        self.last_stats = self.scheduler.make_stats()
        vllm_names = CacheConfigInfo(block_size, config.cache.enable_prefix_caching)
        if not config.server.vllm_metric_names:
            vllm_names = None
        self.metrics = SluiceMetrics(self.served_model_name, vllm_names=vllm_names)
        self.stat_loggers.append(self.metrics.observe_step)
        self.metrics.observe_step(self.last_stats)  # gauges show the empty cache before the first step
        self.metrics.watch_memory(model_weight_bytes(model), self.runner.kv, self.kv_manager)  # read when scraped

    # --- requests ------------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt; ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t!r} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        trace_headers: Mapping[str, str] | None = None,
        flow: str | None = None,
        tenant: str | None = None,
    ) -> int:
        """Queue a request; returns its prompt length. ValueError for prompts that can never run.

        `trace_headers` (W3C traceparent/tracestate, may be empty) marks it traced: its span events are recorded.
        `flow` names the API call it belongs to (its fan-out shares fair shares), `tenant` the client it is
        charged to (None: its flow).
        """
        params.validate()  # once per request: the only call (the API's values arrive bounded by its models)
        if params.lora_request is not None and self.loras is None:
            raise ValueError("this server serves no LoRA adapters (start it with --enable-lora)")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if params.allowed_token_ids is not None:  # its mask, once: steps then cost one masked_fill_ (ValueError)
            mask = self._allowed_masks.get(params.allowed_token_ids)
            params = dataclasses.replace(params, disallowed_token_mask=mask)
        if params.bad_words and not params.bad_words_token_ids:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_word_ids(params.bad_words))
        if self._extra_eos_ids and not params.ignore_eos:
            params = dataclasses.replace(
                params, stop_token_ids=[*params.stop_token_ids, *self._extra_eos_ids]
            )
        request = Request(request_id, token_ids, params, self.eos_token_id, priority, arrival_time, flow, tenant)
        if params.structured_output is not None:
            self.compile_grammar(params.structured_output)  # before anything is queued: it may refuse it
        # First: it owns the duplicate-id and context-length checks (RequestRejected, a ValueError).
        self.scheduler.add_request(request)
        if params.structured_output is not None:
            self.grammar.add(request_id, params.structured_output)
        # An id aborted and added again: the old request's abort notice must not end the new one.
        self._pending_outputs = [o for o in self._pending_outputs if o.request_id != request_id]
        if params.pooling is None:  # an embedding request has no text to detokenize
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        self.metrics.track(request)
        self.timelines.start(request, trace_headers)
        return len(token_ids)

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, alone and after a space (how it appears mid-sentence)."""
        seqs = []
        for word in words:
            for variant in dict.fromkeys((word, word if word.startswith(" ") else " " + word)):
                ids = list(self.tokenizer.encode(variant, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def abort_request(self, request_id: str) -> None:
        """Cancel a request now (its blocks are freed at once); a final 'abort' output follows on next step()."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        self._pending_outputs.append(EngineOutput.ended_from(request, FinishReason.ABORT))

    def has_unfinished_requests(self) -> bool:
        """True while anything waits, runs, is swapped, or has an undelivered output."""
        return self.scheduler.num_unfinished > 0 or bool(self._pending_outputs)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.scheduler.running)

    @property
    def num_swapped(self) -> int:
        """Requests whose KV sits in host memory."""
        return len(self.scheduler.swapped)

    def kv_stats(self) -> dict:
        """Free/total device and host blocks and usage, for health and tests."""
        kv = self.kv_manager
        return {
            "free_blocks": kv.num_free_blocks,
            "total_blocks": kv.num_blocks,
            "usage": kv.usage,
            "free_host_blocks": kv.swap_space.num_free_blocks,
            "total_host_blocks": kv.swap_space.num_blocks,
        }

    # --- the step ------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """One iteration: schedule, forward, sample, update, detokenize. Never raises for a model failure."""
        start = time.perf_counter()
        outputs, self._pending_outputs = self._pending_outputs, []
        for request in self.scheduler.expire_waiting(time.monotonic()):
            outputs.append(self._ended_output(
                request, FinishReason.ABORT, ErrorCode.QUEUE_TIMEOUT,
                f"the request waited more than {self.config.scheduler.max_queue_wait:g} s in the queue "
                "(--max-queue-wait); the server is at capacity",
            ))
        sched_out = self.scheduler.schedule()
        scheduled_at, failed = time.monotonic(), False
        if not sched_out.is_empty or sched_out.finished_ids:
            try:
                runner_out = self.runner.execute(sched_out)
            except Exception as exc:  # one bad step fails its own requests, not the engine
                failed = True
                logger.exception("engine step failed; failing %d requests", len(sched_out.scheduled))
                for request in self.scheduler.fail_step(sched_out):
                    outputs.append(self._ended_output(
                        request, FinishReason.ERROR, ErrorCode.STEP_FAILED,
                        f"engine step failed: {type(exc).__name__}"))
            else:
                outputs += self._end_rows_without_token(runner_out)
                for ro in self.scheduler.update_from_output(sched_out, runner_out):
                    if ro.pooled is not None:  # an embedding request: its vector, no text
                        outputs.append(EngineOutput.pooled(ro))
                        continue
                    if self._grammar is not None and ro.new_token_ids:
                        error = self._advance_grammar(ro)
                        if error is not None:
                            outputs.append(error)
                            continue
                    outputs.append(self._detokenize_or_fail(ro))
        if self.kv_events is not None:  # the step's KV cache events: one batch onto the publisher's queue
            self.kv_events.end_step()
        stats = self.last_stats = self.scheduler.make_stats()
        stats.num_batched_tokens = sched_out.num_batched_tokens
        stats.num_scheduled_requests = len(sched_out.scheduled)
        stats.step_duration_s = time.perf_counter() - start
        self._observe_step_time(sched_out, stats, failed)
        for stat_logger in self.stat_loggers:
            stat_logger(stats)
        now = time.monotonic()
        self.timelines.on_step(sched_out, scheduled_at, now)
        for out in outputs:
            self.metrics.observe_output(out.request_id, len(out.token_ids), out.finished, out.finish_reason, now)
            self.timelines.on_output(out, now)
        return outputs

    def _observe_step_time(self, sched_out: SchedulerOutput, stats: SchedulerStats, failed: bool) -> None:
        """Feed the step's wall time to the scheduler's cost model (the latency budget), and mark whether it kept
        its time-between-tokens target; the step trace (log level debug) shows what the scheduler decided."""
        decision = sched_out.decision
        kept = None if failed else self.scheduler.observe_step(sched_out, stats.step_duration_s)
        stats.itl_target_s = decision.itl_target_s
        if kept is not None:
            stats.itl_steps_kept, stats.itl_steps_missed = int(kept), int(not kept)
        if sched_out.scheduled and logger.isEnabledFor(logging.DEBUG):
            logger.debug("step: %d rows, %d tokens in %.1f ms; %s", len(sched_out.scheduled),
                         sched_out.num_batched_tokens, stats.step_duration_s * 1e3, decision.trace())

    def _forget(self, request_id: str) -> None:
        """Drop the per-request state of a request that ended."""
        self._detokenizers.pop(request_id, None)
        if self._grammar is not None:
            self._grammar.remove(request_id)

    def _ended_output(self, ro, reason: FinishReason, code: ErrorCode, message: str) -> EngineOutput:
        """The final output of a request the engine ended (ro: a Request or RequestOutput)."""
        self._forget(ro.request_id)
        return EngineOutput.ended_from(ro, reason, code, message)

    def _detokenize_or_fail(self, ro) -> EngineOutput:
        """Detokenize; a tokenizer failure ends that one request with an error instead of the engine loop."""
        try:
            return self._detokenize(ro)
        except Exception as exc:
            logger.exception("detokenizing request %s failed", ro.request_id)
            if not ro.finished:
                self.scheduler.finish_requests([ro.request_id], RequestStatus.FINISHED_ABORTED)
            return self._ended_output(ro, FinishReason.ERROR, ErrorCode.DETOKENIZE_FAILED,
                                      f"detokenizing failed: {type(exc).__name__}")

    def _detokenize(self, ro) -> EngineOutput:
        detok = self._detokenizers[ro.request_id]
        num_tokens = len(ro.new_token_ids)
        text = (detok.update(ro.new_token_ids, finished=ro.finished) if num_tokens == 1
                else _update_until_stop(detok, ro))
        finished, reason, stop_reason = ro.finished, ro.finish_reason, ro.stop_reason
        num_dropped = num_tokens - len(ro.new_token_ids)  # a stop string inside a run of verified drafts ends it
        if detok.stop_hit is not None and (num_dropped or not finished):
            if num_dropped:
                self.scheduler.cut_at_stop_string(ro.request_id, ro.num_output_tokens, num_dropped)
            elif not finished:
                self.scheduler.finish_requests([ro.request_id], RequestStatus.FINISHED_STOPPED)
            finished, reason, stop_reason = True, FinishReason.STOP, detok.stop_hit
        if finished:
            self._forget(ro.request_id)
        return EngineOutput.tokens(ro.request_id, text, ro.new_token_ids, ro.logprobs, reason if finished else None,
                                   ro.num_prompt_tokens, ro.num_output_tokens, ro.num_cached_tokens, stop_reason)

    # --- offline entry point -------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [f"gen-{next(_gen_ids)}" for _ in prompts]
        results: dict[str, Completion] = {}
        for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            n = self.add_request(rid, prompt, per_prompt[i], priorities[i] if priorities else 0)
            results[rid] = Completion(rid, list(self.scheduler.requests[rid].prompt_token_ids[:n]))
        while self.has_unfinished_requests():
            for out in self.step():
                done = results.get(out.request_id)
                if done is None:
                    continue
                done.token_ids.extend(out.token_ids)
                done.text += out.text
                done.logprobs.extend(out.logprobs)
                if out.finished:
                    done.finish_reason = out.finish_reason
        return [results[rid] for rid in ids]


_gen_ids = itertools.count()


def _update_until_stop(detok: IncrementalDetokenizer, ro) -> str:
    """Detokenize a run of tokens (verified drafts) one at a time, as one-token steps would, and cut the run
    after the token that completes a stop string: no token past a stop is reported."""
    parts, tokens = [], ro.new_token_ids
    for i, token in enumerate(tokens):
        parts.append(detok.update([token], finished=ro.finished and i == len(tokens) - 1))
        if detok.stop_hit is not None:
            ro.num_output_tokens -= len(tokens) - i - 1
            ro.new_token_ids = tokens[: i + 1]
            break
    return "".join(parts)


def _default_served_name(model: str) -> str:
    if model in ("", "default"):
        return "SmolLM2-135M-Instruct"
    return model.rstrip("/").split("/")[-1].removesuffix(".gguf")


def freeze_startup_objects() -> None:
    """Exclude everything alive now (model, tokenizer, ~370k objects) from future GC scans.

    Each step allocates per-request objects, which triggers collections; without this, the older generations
    they reach scan every module and tokenizer object too. Scheduler + KV manager cost per request with the
    engine loaded: 12.5 / 16.4 µs at 64 / 1024 running requests, 8.1 / 11.1 µs frozen. Call it once the
    engine is built (as vLLM does); frozen objects are still freed by reference counting.
    """
    gc.collect()
    gc.freeze()
