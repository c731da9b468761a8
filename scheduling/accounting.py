"""Accounting for the service a step gives: each client's counter (fair shares) and the step's shape and time
(the latency budget's cost model)."""

from __future__ import annotations

from sluice.scheduling.output import SchedulerOutput
from sluice.scheduling.request import Request
from sluice.scheduling.step_budget import StepDecision


class ServiceAccounting:
    """Mixed into Scheduler: it owns `counters`, `latency` and `_stats`."""

    def _account_chunk(self, request: Request, start: int, n: int, decision: StepDecision, flows: set[str]) -> None:
        """Add a scheduled prompt chunk to the step's shape, and charge its client for tokens computed the first
        time (recomputation after a preemption is the server's choice, not the client's)."""
        decision.shape.add_chunk(start, n)
        decision.prefill_tokens += n
        flows.add(request.flow_id)
        self._charge(request, start + n - request.num_charged_tokens)

    def _charge(self, request: Request, prompt_tokens: int) -> None:
        """Charge a request's client (VTC) for prompt tokens computed the first time; count its tenant's tokens."""
        if prompt_tokens <= 0:
            return
        self.counters.charge(request.client_id, prompt_tokens)
        request.num_charged_tokens += prompt_tokens
        if request.tenant is not None:
            served = self._stats.tenant_tokens
            served[request.tenant] = served.get(request.tenant, 0) + prompt_tokens

    def _charge_output(self, request: Request, num_tokens: int) -> None:
        """Charge a request's client for the tokens it just generated (the hot path of every decode)."""
        self.counters.charge_output(request.client_id, num_tokens)
        request.num_charged_tokens = request.num_tokens  # their positions, computed as inputs next, are covered
        if request.tenant is not None:
            served = self._stats.tenant_tokens
            served[request.tenant] = served.get(request.tenant, 0) + num_tokens

    def observe_step(self, out: SchedulerOutput, seconds: float) -> bool | None:
        """Feed a measured step to the cost model; whether it kept its time-between-tokens target (None: it had
        none). Steps that copied blocks are left out: their time is not the forward's."""
        if not out.scheduled or out.swap_in or out.swap_out:
            return None
        return self.latency.observe(out.decision, seconds)
