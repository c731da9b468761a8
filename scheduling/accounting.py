"""Accounting for the service a step gives: each client's counter (fair shares) and the step's shape and time
(the latency budget's cost model)."""

from __future__ import annotations

from sluice.scheduling.output import SchedulerOutput
from sluice.scheduling.request import Request
from sluice.scheduling.step_budget import StepDecision


class ServiceAccounting:
    """Mixed into Scheduler: it owns `counters`, `latency` and `_stats`."""

    def _account(self, request: Request, start: int, n: int, num_drafts: int, decision: StepDecision,
                 flows: set[str]) -> None:
        """Add a scheduled row to the step's shape, and charge its client for tokens computed the first time."""
        if request.num_output_tokens and start == request.num_tokens - 1:
            decision.shape.add_decode(start, n)
        else:
            decision.shape.add_chunk(start, n)
            decision.prefill_tokens += n
            flows.add(request.flow_id)
        self._charge(request, start + n - num_drafts - request.num_charged_tokens, 0)

    def _charge(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        """Charge a request's client (VTC) and count its tenant's served tokens; recomputed tokens are free."""
        prompt_tokens = max(prompt_tokens, 0)
        if not (prompt_tokens or output_tokens):
            return
        self.counters.charge(request.client_id, prompt_tokens, output_tokens)
        request.num_charged_tokens += prompt_tokens
        if output_tokens:  # the new tokens' own positions are computed as inputs next: covered by this charge
            request.num_charged_tokens = request.num_tokens
        if request.tenant is not None:
            served = self._stats.tenant_tokens
            served[request.tenant] = served.get(request.tenant, 0) + prompt_tokens + output_tokens

    def observe_step(self, out: SchedulerOutput, seconds: float) -> bool | None:
        """Feed a measured step to the cost model; whether it kept its time-between-tokens target (None: it had
        none). Steps that copied blocks are left out: their time is not the forward's."""
        if not out.scheduled or out.swap_in or out.swap_out:
            return None
        return self.latency.observe(out.decision, seconds)
