"""The scheduler: decides each step which requests compute how many tokens, within budgets and KV memory."""

from __future__ import annotations

import bisect
import heapq
import time

from sluice.kvcache.manager import KVCacheManager, cdiv
from sluice.scheduling.accounting import ServiceAccounting
from sluice.scheduling.config import SchedulerConfig
from sluice.scheduling.cost_model import StepShape
from sluice.scheduling.decode_rows import constrained, crowded, plan_decode_rows
from sluice.scheduling.fairness import VirtualCounters
from sluice.scheduling.flow_queue import FlowQueue
from sluice.scheduling.outcomes import ErrorCode, RequestRejected
from sluice.scheduling.output import ScheduledRequest, SchedulerOutput, SchedulerStats
from sluice.scheduling.prefill_plan import PlanInputs, PrefillPlan, plan_prefill
from sluice.scheduling.request import Request, RequestStatus
from sluice.scheduling.request_queue import fcfs_key, priority_key
from sluice.scheduling.speculation import Speculation
from sluice.scheduling.step_budget import ESTABLISHED_TOKENS, LatencyBudget, StepDecision
from sluice.scheduling.step_results import StepResults


class Scheduler(StepResults, ServiceAccounting):
    """Three phases per step: resume swapped, continue running, admit waiting (vLLM's order).

    Before them, the step's prompt tokens are planned (prefill_plan.py): every decoding request gets its token,
    prompt work gets what the latency budget leaves (step_budget.py), flow by flow, least-served first
    (fairness.py). The running phase then follows the plan in running order, and `running` and `swapped` stay
    sorted best-first by the policy's key, so the preemption victim (lowest priority, latest arrival) is always the
    last element and never one already scheduled in this step.
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
        self.counters = VirtualCounters(config.fair_prompt_weight, config.fair_output_weight)
        self.waiting = FlowQueue(self.policy, self.counters)  # by flow: least-served first within a priority
        self.latency = LatencyBudget(config, self.block_size)
        self._sat_out: set[str] = set()  # clients none of whose decoding rows the last step ran (decode_rows.py)
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
        self.counters.open(request.client_id)
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
        self.counters.close(request.client_id)
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
        plan = self._plan_prefill(budget)
        budget, preempted = self._schedule_running(out, num_scheduled, drafts, budget, plan)
        if not preempted and plan.admit:
            budget = self._schedule_waiting(num_scheduled, budget, plan)
        if plan.admit:
            budget = self._schedule_unused(num_scheduled, budget, plan)

        decision, flows = plan.decision, set()
        decision.shape, decision.prefill_tokens = StepShape(), 0  # what was really scheduled, from here on
        for request in self.running:
            n = num_scheduled.get(request.request_id)
            if n is None:
                continue
            start, draft = request.num_computed_tokens, drafts.get(request.request_id, [])
            if request.num_output_tokens and start == request.num_tokens - 1:
                # its inputs were charged when they were generated
                decision.shape.add_decode(start, n, constrained=constrained(request))
            else:
                self._account_chunk(request, start, n, decision, flows)
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
        decision.flows_served, decision.decode_rows = len(flows), decision.shape.decode_rows
        if not decision.decode_rows:  # preemption took every decoding request: nobody waited on this step
            decision.itl_target_s = 0.0
        decision.predicted_s = self.latency.model.predict(decision.shape)
        out.decision = decision
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

    def _plan_prefill(self, token_budget: int) -> PrefillPlan:
        """Decode rows first (decode_rows.py); then the prompt tokens, by flow and within the latency budget
        (prefill_plan.py)."""
        decision = StepDecision(token_budget=token_budget)
        decoding = [r for r in self.running if _decoding(r)]
        only_decodes = not self.waiting and len(decoding) == len(self.running)
        if only_decodes and not crowded(decoding):  # every row goes in, no prompt work: nothing to plan
            decision.decode_rows = decision.base_rows = len(decoding)
            self._sat_out = set()
            self.counters.refresh_backlog(set())
            return PrefillPlan(decision=decision)
        guarding = any(r.num_output_tokens >= ESTABLISHED_TOKENS for r in decoding)
        held, self._sat_out = plan_decode_rows(decoding, self.counters, self.latency, decision,
                                               self.policy == "priority", self._sat_out, guarding)
        if only_decodes:
            self.counters.refresh_backlog(set())
            return PrefillPlan(decision=decision, held=held)
        partials, seats, decode_blocks = [], {}, 0
        clients = set()  # those with an established stream decoding this step: the ones the target guards
        for r in self.running:
            if not _decoding(r):
                partials.append(r)
            elif r.request_id not in held:
                decode_blocks += r.num_computed_tokens % self.block_size == 0  # its new token opens a block
                if r.num_output_tokens >= ESTABLISHED_TOKENS:
                    clients.add(r.client_id)
            seats[r.flow_id] = seats.get(r.flow_id, 0) + 1
        inputs = PlanInputs(
            token_room=token_budget - decision.decode_rows, seats_free=self.config.max_num_seqs - len(self.running),
            flow_seats=self.config.flow_seats, chunk_cap=self.config.long_prefill_token_threshold,
            admit=bool(self.waiting) and self._may_admit_waiting(), free_blocks=self.kv.num_free_blocks - decode_blocks,
            block_size=self.block_size, held_blocks=self.kv.num_held_blocks, prefix=self._prefix_blocks)
        if inputs.token_room <= 0 or decision.probe:
            return PrefillPlan(decision=decision, held=held)
        plan = plan_prefill(inputs, decision, partials, seats, self.waiting, self.counters, self.latency, clients)
        plan.held = held
        return plan

    def _prefix_blocks(self, request: Request) -> tuple[int, int]:
        """A waiting request's prefix-cache hit tokens, and how many of its hit blocks are free (they leave the
        free queue when it is admitted)."""
        computed = self._cached_prefix(request)
        return len(computed) * self.block_size, sum(1 for b in computed if b.ref_cnt == 0)

    def _schedule_running(
        self, out: SchedulerOutput, num_scheduled: dict[str, int], drafts: dict[str, list[int]], budget: int,
        plan: PrefillPlan,
    ) -> tuple[int, bool]:
        preempted = False
        pending = plan.decision.decode_rows + plan.running_tokens  # planned for running requests not yet visited
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            decoding = _decoding(request)  # its one token; else the prompt tokens the plan granted it
            if decoding:
                n = int(request.request_id not in plan.held)
            else:
                n = min(plan.running.get(request.request_id, 0), budget)
            if not n:  # a prefill whose flow got no prompt tokens this step, or a decoding row held back
                i += 1
                continue
            pending -= n
            # Drafts, for a decoding request, take only what no later request was planned to get.
            draft = self.spec.drafts(request, n, budget - pending, len(self.running) - i - 1) if decoding else []
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

    def _schedule_waiting(self, num_scheduled: dict[str, int], budget: int, plan: PrefillPlan) -> int:
        for request, granted in plan.admit:  # in the plan's order: least-served flows first
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._lora_fits(request):
                break  # its adapter needs a slot the running ones hold: it waits for one to finish
            computed = self._cached_prefix(request)
            num_hit = len(computed) * self.block_size
            # Blocks allocated earlier in this step may have become hits: the grant is a ceiling.
            n = min(self._num_new_tokens(request, num_hit, budget), granted)
            if self.kv.allocate_slots(request, n, computed) is None:
                break
            self.waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens += num_hit
            request.num_charged_tokens = max(request.num_charged_tokens, request.num_computed_tokens)  # hits are free
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self.key)
            num_scheduled[request.request_id] = n
            budget -= n
            plan.admitted += n
        return budget

    def _schedule_unused(self, num_scheduled: dict[str, int], budget: int, plan: PrefillPlan) -> int:
        """Prompt tokens planned for admissions that did not happen (no KV room, an adapter slot, a preemption)
        go to the running prefills left out, in running order: a waiting request that cannot get its blocks
        must not stall the running ones that hold them."""
        spare = sum(n for _, n in plan.admit) - plan.admitted
        for request in self.running:
            if spare <= 0 or budget <= 0:
                break
            if request.request_id in num_scheduled or _decoding(request):
                continue
            n = min(self._num_new_tokens(request, 0, budget), spare)
            if self.kv.allocate_slots(request, n) is not None:  # no preemption here: it was not planned
                num_scheduled[request.request_id] = n
                budget, spare = budget - n, spare - n
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


def _decoding(request: Request) -> bool:
    """Whether a running request's next step is a decode (its one newest token), not prompt work."""
    return bool(request.num_output_tokens) and request.num_tokens - request.num_computed_tokens == 1


def _lora_names(requests) -> tuple[str, ...]:
    """The distinct adapter names of `requests`, sorted."""
    return tuple(sorted({r.sampling_params.lora_request.name for r in requests if r.sampling_params.lora_request}))
