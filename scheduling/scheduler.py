"""The scheduler: decides each step which requests compute how many tokens, within budgets and KV memory."""

from __future__ import annotations

import bisect
import heapq
import time

from sluice.kvcache.manager import KVCacheManager, cdiv
from sluice.scheduling.config import SchedulerConfig
from sluice.scheduling.outcomes import ErrorCode, RequestRejected
from sluice.scheduling.output import (
    ModelRunnerOutput,
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from sluice.scheduling.request import Request, RequestStatus
from sluice.scheduling.request_queue import create_request_queue, fcfs_key, priority_key
from sluice.scheduling.speculation import Speculation


class Scheduler:
    """Three phases per step: resume swapped, continue running, admit waiting (vLLM's order).

    `running` and `swapped` stay sorted best-first by the policy's key, so the preemption victim (lowest
    priority, latest arrival) is always the last element and never one already scheduled in this step.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 max_loras: int = 0) -> None:
        config.validate()
        assert config.max_num_batched_tokens > 0, "resolve the auto token budget first (SchedulerConfig.resolved)"
        self.config = config
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        # A sequence longer than the whole cache could never be scheduled, not even alone.
        self.max_model_len = min(max_model_len, kv_cache_manager.num_blocks * self.block_size)
        self.max_loras = max_loras  # distinct LoRA adapters one step may hold (the runner's slots)
        self.policy = config.scheduling_policy
        self.key = priority_key if self.policy == "priority" else fcfs_key
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # ended since the last schedule(): the runner drops their state
        self._stats = SchedulerStats()
        self._prefix_counts_reported = (0, 0)
        # The step between schedule() and update_from_output()/fail_step(), and the scheduled requests that were
        # ended while it ran: if it fails, the blocks it was filling for them must lose their prefix hashes too.
        self._in_flight: dict[str, ScheduledRequest] = {}
        self._ended_in_flight: list[ScheduledRequest] = []
        # (deadline, seq, request) for requests not yet scheduled once, when max_queue_wait is set.
        self._queue_deadlines: list[tuple[float, int, Request]] = []
        self.spec = Speculation(config, kv_cache_manager, self.max_model_len)

    # --- requests in and out -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError for a duplicate id or one that could never fit in the KV cache."""
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use",
                                  ErrorCode.DUPLICATE_REQUEST_ID)
        # An embedding request generates nothing: its prompt alone must fit.
        pooling = request.sampling_params.pooling is not None
        needed = request.num_tokens + (0 if pooling else request.sampling_params.max_tokens)
        if needed > self.max_model_len:
            capacity = self.kv.num_blocks * self.block_size
            what = (f"the KV cache holds {capacity} tokens" if self.max_model_len == capacity
                    else f"max_model_len is {self.max_model_len}")
            raise RequestRejected(f"the request needs up to {needed} tokens ({request.num_tokens} in the prompt, "
                                  f"max_tokens {request.sampling_params.max_tokens}) but {what}",
                                  ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        request.update_block_hashes(self.block_size)
        self.requests[request.request_id] = request
        self.waiting.push(request)
        if self.config.max_queue_wait > 0:
            deadline = request.arrival_time + self.config.max_queue_wait
            heapq.heappush(self._queue_deadlines, (deadline, request.arrival_seq, request))

    def expire_waiting(self, now: float) -> list[Request]:
        """Abort requests that waited past max_queue_wait without being scheduled once; returns them."""
        expired = []
        while self._queue_deadlines and self._queue_deadlines[0][0] <= now:
            request = heapq.heappop(self._queue_deadlines)[2]
            # Already admitted, finished, or preempted after running: a queue wait no longer applies.
            if request.first_scheduled_time is None and self.requests.get(request.request_id) is request:
                self.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
                expired.append(request)
        return expired

    def cut_at_stop_string(self, request_id: str, num_output_tokens: int, num_dropped: int) -> None:
        """A stop string found inside a run of verified drafts ends the request after `num_output_tokens`: the
        `num_dropped` tokens past it leave the request and this step's count of generated tokens."""
        self._stats.num_generation_tokens -= num_dropped
        if (request := self.requests.get(request_id)) is not None:  # else it ended this step anyway
            del request.all_token_ids[request.num_prompt_tokens + num_output_tokens :]
            self.finish_requests([request_id], RequestStatus.FINISHED_STOPPED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests wherever they are (abort, stop string) and free their blocks now."""
        assert status.finished
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            in_flight = self._in_flight.pop(rid, None)
            if in_flight is not None:
                self._ended_in_flight.append(in_flight)

    def _release(self, request: Request, uncache_from_block: int | None = None) -> None:
        self.kv.free(request, uncache_from_block)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    @property
    def num_unfinished(self) -> int:
        """Requests waiting, running or swapped."""
        return len(self.requests)

    # --- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch; allocates KV slots and records swap copies."""
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        self._stats = SchedulerStats()
        num_scheduled: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}
        budget = self.config.max_num_batched_tokens

        if self.policy == "priority":
            self._preempt_for_waiting_priority(out)
        self._resume_swapped(out)
        budget, preempted = self._schedule_running(out, num_scheduled, drafts, budget)
        if not preempted and self._may_admit_waiting():
            budget = self._schedule_waiting(num_scheduled, budget)

        for request in self.running:
            n = num_scheduled.get(request.request_id)
            if n is None:
                continue
            start, draft = request.num_computed_tokens, drafts.get(request.request_id, [])
            out.scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids[start : start + n - len(draft)] + draft,
                    start_pos=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    sample=start + n - len(draft) == request.num_tokens and request.sampling_params.pooling is None,
                    sampling_params=request.sampling_params,
                    num_output_tokens=request.num_output_tokens,
                    eos_token_id=request.eos_token_id,
                    min_tokens_pending=request.num_output_tokens < request.sampling_params.min_tokens,
                    token_history=request.all_token_ids if request.sampling_params.needs_token_history else None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    draft_token_ids=draft,
                )
            )
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled)
        assert len(out.scheduled) <= self.config.max_num_seqs
        out.check_copy_order()
        self._in_flight = {s.request_id: s for s in out.scheduled}
        self._ended_in_flight = []
        return out

    def _num_new_tokens(self, request: Request, num_hit_tokens: int, budget: int) -> int:
        n = request.num_tokens - request.num_computed_tokens - num_hit_tokens
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def _resume_swapped(self, out: SchedulerOutput) -> None:
        if out.swap_out:
            # A swap-out already decided this step (priority preemption) freed device blocks that its copy has
            # yet to read; a swap-in could be handed them and would overwrite them first (SchedulerOutput's
            # copy-order contract). Resuming waits one step.
            return
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            if self._waiting_outranks(request) or not self._lora_fits(request):
                break
            remaining = request.num_tokens - request.num_computed_tokens
            if not self.kv.can_swap_in(request, remaining):
                break
            self.swapped.pop(0)
            out.add_swap_in(request.request_id, self.kv.swap_in(request))
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self.key)

    def _schedule_running(
        self, out: SchedulerOutput, num_scheduled: dict[str, int], drafts: dict[str, list[int]], budget: int
    ) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_new_tokens(request, 0, budget)
            assert n > 0, f"{request} has nothing to compute"
            draft = self.spec.drafts(request, n, budget, len(self.running) - i - 1)
            if draft:  # they fit: drafts() keeps a block for each request after this one, and within budget
                allocated = self.kv.allocate_slots(request, n + len(draft))
                assert allocated is not None
                drafts[request.request_id] = draft
                n += len(draft)
            while not draft and self.kv.allocate_slots(request, n) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            else:
                num_scheduled[request.request_id] = n
                budget -= n
                i += 1
        return budget, preempted

    def _may_admit_waiting(self) -> bool:
        # Swapped requests resume before anything new is admitted (unless a waiting one strictly outranks them).
        return not self.swapped or (
            self.policy == "priority"
            and bool(self.waiting)
            and self.waiting.peek().priority < self.swapped[0].priority
        )

    def _waiting_outranks(self, request: Request) -> bool:
        return (
            self.policy == "priority"
            and bool(self.waiting)
            and self.waiting.peek().priority < request.priority
        )

    def _schedule_waiting(self, num_scheduled: dict[str, int], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self._lora_fits(request):
                break  # its adapter needs a slot the running ones hold: it waits for one to finish
            computed = self._cached_prefix(request)
            num_hit = len(computed) * self.block_size
            n = self._num_new_tokens(request, num_hit, budget)
            if self.kv.allocate_slots(request, n, computed) is None:
                break
            self.waiting.pop()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens += num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self.key)
            num_scheduled[request.request_id] = n
            budget -= n
        return budget

    def _lora_fits(self, request: Request) -> bool:
        """Whether running `request` keeps the distinct adapters of the running batch within max_loras."""
        lora = request.sampling_params.lora_request
        if lora is None:
            return True
        held = {r.sampling_params.lora_request.uid for r in self.running if r.sampling_params.lora_request}
        return lora.uid in held or len(held) < self.max_loras

    def _preempt_for_waiting_priority(self, out: SchedulerOutput) -> None:
        """Priority policy: a waiting request of strictly higher priority evicts lower-priority running ones."""
        while self.waiting and self.running:
            head, victim = self.waiting.peek(), self.running[-1]
            if head.priority >= victim.priority:
                return
            seats_full = len(self.running) >= self.config.max_num_seqs
            if not seats_full and self._fits(head):
                return
            self._preempt(victim, out)

    def _cached_prefix(self, request: Request) -> list:
        """The prefix-cache hits of a request not yet computed (none for pooling that needs every token)."""
        pooling = request.sampling_params.pooling
        if request.num_computed_tokens or (pooling is not None and pooling.needs_every_token):
            return []
        return self.kv.get_computed_blocks(request)

    def _fits(self, request: Request) -> bool:
        computed = self._cached_prefix(request)
        num_hit = len(computed) * self.block_size
        n = self._num_new_tokens(request, num_hit, self.config.max_num_batched_tokens)
        needed = cdiv(request.num_computed_tokens + num_hit + n, self.block_size) - len(computed)
        needed += sum(1 for b in computed if b.ref_cnt == 0)
        return needed <= self.kv.num_free_blocks

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        out.preempted_ids.append(victim.request_id)
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(victim):
            out.add_swap_out(victim.request_id, self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, victim, key=self.key)
            self._stats.num_preemptions_swap += 1
        else:  # recompute, or swap space exhausted: fall back to recompute
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            self.waiting.push_front(victim)
            self._stats.num_preemptions_recompute += 1

    # --- results -------------------------------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Advance progress, append sampled tokens, finish requests that stopped, free their blocks."""
        self.kv.commit_swaps()  # the step ran: its copies are done
        self._in_flight, self._ended_in_flight = {}, []
        outputs: list[RequestOutput] = []
        any_finished = False
        for sched in out.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # ended while the step ran (a WAITING one is a new request reusing the id)
            request.num_computed_tokens += sched.num_tokens
            if request.num_output_tokens == 0:
                self._stats.num_prompt_tokens += sched.num_tokens
            tokens = runner_output.spec_sampled.get(sched.request_id)
            if tokens is not None:  # verified drafts: progress covers the accepted ones only
                request.num_computed_tokens -= self.spec.num_rejected(sched, tokens, self._stats)
            elif (token := runner_output.sampled.get(sched.request_id)) is not None:
                tokens = [token]
            else:
                pooled = runner_output.pooled.get(sched.request_id) if runner_output.pooled else None
                if pooled is not None:  # an embedding request's last prompt chunk: it is done
                    request.status = RequestStatus.FINISHED_STOPPED
                    any_finished = True
                    self._release(request)
                    outputs.append(RequestOutput.of(request, [], [], pooled))
                continue  # else a prefill chunk that did not reach the end of the prompt
            tokens, status = self._append_until_stop(request, tokens)
            logprobs = runner_output.logprobs.get(sched.request_id)
            if status is not None:
                request.status = status
                any_finished = True
                self._release(request)
            elif sched.draft_token_ids:  # blocks holding only rejected drafts go back
                self.kv.trim(request, request.num_tokens)
            outputs.append(RequestOutput.of(request, tokens, [logprobs] if logprobs else []))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _append_until_stop(self, request: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens up to and including the first that ends the request (as one-token steps would)."""
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            self._stats.num_generation_tokens += 1
            status = self._check_stop(request, token)
            if status is not None:
                tokens = tokens[: i + 1]
                break
        request.update_block_hashes(self.block_size)
        return tokens, status

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def fail_step(self, out: SchedulerOutput) -> list[RequestOutput]:
        """The step's copies or forward raised: fail what it computed, put back what it only moved.

        - scheduled requests end with an error; the blocks this step was to fill lose their prefix hashes;
        - requests resumed by a swap-in but not scheduled go back to `swapped`, onto the host slots that still
          hold their KV (those slots are released only after a step's copies succeed);
        - requests swapped out this step drop their unfinished host copy and wait to be recomputed.
        """
        outputs = []
        swapped_in = set(out.swapped_in_ids)
        # Every block a swap-in was to fill, whoever holds it now: its contents are unknown. The forward's own
        # blocks are handled per request below, from each one's start position on.
        self.kv.uncache_block_ids([dev for _, dev in out.swap_in])
        for sched in out.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # ended while the step ran (a WAITING one is a new request reusing the id)
            request.status = RequestStatus.FINISHED_ERROR
            self.running.remove(request)
            self._release(request, uncache_from_block=sched.start_pos // self.block_size)
            outputs.append(RequestOutput.of(request, [], []))
        for rid in out.swapped_in_ids:
            request = self.requests.get(rid)
            if request is None or rid not in self.kv.swapping_in:
                continue  # failed above, or ended while the step ran
            self.kv.undo_swap_in(request)
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                request.status = RequestStatus.SWAPPED
                bisect.insort(self.swapped, request, key=self.key)
        for rid in out.swapped_out_ids:
            request = self.requests.get(rid)
            if request is None or rid in swapped_in or request.status != RequestStatus.SWAPPED:
                continue  # ended, or already back on its older host copy
            self.swapped.remove(request)
            self.kv.drop_host_blocks(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.waiting.push_front(request)
        for sched in self._ended_in_flight:  # ended while the step ran: their blocks are free, not yet reused
            self.kv.uncache_block_ids(sched.block_ids[sched.start_pos // self.block_size :])
        self._in_flight, self._ended_in_flight = {}, []
        self.kv.commit_swaps()  # what is left pending belongs to requests that ended: nothing reads it now
        return outputs

    # --- observability -------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        """Gauges after the step plus this step's counter increments."""
        s = self._stats
        s.num_waiting, s.num_running, s.num_swapped = len(self.waiting), len(self.running), len(self.swapped)
        s.num_free_blocks, s.num_total_blocks = self.kv.num_free_blocks, self.kv.num_blocks
        s.kv_cache_usage = self.kv.usage
        host = self.kv.swap_space
        s.num_free_host_blocks, s.num_total_host_blocks = host.num_free_blocks, host.num_blocks
        queries, hits = self.kv.prefix_cache_queries, self.kv.prefix_cache_hits
        s.prefix_cache_queries = queries - self._prefix_counts_reported[0]
        s.prefix_cache_hits = hits - self._prefix_counts_reported[1]
        if self.max_loras:
            s.max_loras = self.max_loras
            s.running_lora_adapters = _lora_names(self.running)
            s.waiting_lora_adapters = _lora_names([*self.waiting, *self.swapped])
        self._prefix_counts_reported = (queries, hits)
        return s


def _lora_names(requests) -> tuple[str, ...]:
    """The distinct adapter names of `requests`, sorted."""
    return tuple(sorted({r.sampling_params.lora_request.name for r in requests if r.sampling_params.lora_request}))
