"""What the scheduler hands the model runner, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.scheduling.outcomes import FinishReason
from sluice.scheduling.sampling_params import SamplingParams
from sluice.scheduling.step_budget import StepDecision


@dataclass(slots=True)
class ScheduledRequest:
    """One request's slice of a step: compute `token_ids` at positions `start_pos`, `start_pos + 1`, …"""

    request_id: str
    token_ids: list[int]  # the new tokens to run this step (a prefill chunk, or 1 for a decode)
    start_pos: int  # num_computed_tokens before this step: position of token_ids[0]
    block_ids: list[int]  # the request's whole block table, covering start_pos + len(token_ids) tokens
    sample: bool  # this chunk reaches the last known token: sample the next token from its logits
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated before this step (seeds per-token generators deterministically)
    output_token_ids: list[int] = field(default_factory=list)  # generated so far (penalties, min_tokens)
    eos_token_id: int | None = None
    min_tokens_pending: bool = False  # min_tokens not yet reached: EOS / stop_token_ids must not be sampled
    # The request's tokens so far (a reference, not a copy), only for rows whose penalties or bad words need
    # them; the first num_prompt_tokens are the prompt.
    token_history: list[int] | None = None
    num_prompt_tokens: int = 0
    # Speculation: the tail of token_ids that are drafts to verify (token_ids = [last known token, *drafts]); the
    # runner samples at each of those 1 + d positions and returns the accepted run in `spec_sampled`.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed for this request in this step (drafts included)."""
        return len(self.token_ids)


class CopyOrderError(RuntimeError):
    """A step's block copies would corrupt KV if run in the runner's order (all swap-ins, then all swap-outs)."""


@dataclass(slots=True)
class SchedulerOutput:
    """One engine step: the batch to run, plus block copies to perform before the forward.

    The copy-order contract. The runner performs every swap-in (host -> device) of the step first, then every
    swap-out (device -> host), then the forward. The scheduler decides copies in its own order, and the two
    orders give the same result only when no swap-out decided earlier in the step conflicts with a swap-in
    decided after it:

    - a request resumed by a swap-in may be preempted again by a swap-out later in the same step; its swap-out
      reads the device blocks the swap-in just filled, which is right only because swap-ins run first;
    - a device block freed by a swap-out must never be handed to a swap-in of the same step (the swap-in would
      overwrite it before the swap-out reads it), and a host slot written by a swap-out must not be read by a
      swap-in of the same step (it would be read before it is written).

    `check_copy_order()` enforces both with a real exception; the scheduler and the runner call it.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    # (host_block, device_block) copies to do first, then (device_block, host_block) copies, then the forward.
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swapped_in_ids: list[str] = field(default_factory=list)  # resumed this step, in decision order
    swapped_out_ids: list[str] = field(default_factory=list)  # preempted to host memory this step
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step: drop per-request state
    # (is_swap_in, pairs) in the order the scheduler decided them; what check_copy_order() replays.
    copy_log: list[tuple[bool, list[tuple[int, int]]]] = field(default_factory=list)
    decision: StepDecision = field(default_factory=StepDecision)  # how its prompt work was chosen (the trace)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to compute and nothing to copy."""
        return not (self.scheduled or self.swap_in or self.swap_out)

    def add_swap_in(self, request_id: str, pairs: list[tuple[int, int]]) -> None:
        """Record a resumed request's (host_block, device_block) copies."""
        self.swap_in.extend(pairs)
        self.swapped_in_ids.append(request_id)
        self.copy_log.append((True, pairs))

    def add_swap_out(self, request_id: str, pairs: list[tuple[int, int]]) -> None:
        """Record a swapped-out request's (device_block, host_block) copies."""
        self.swap_out.extend(pairs)
        self.swapped_out_ids.append(request_id)
        self.copy_log.append((False, pairs))

    def check_copy_order(self) -> None:
        """Raise CopyOrderError unless running all swap-ins before all swap-outs keeps every block's data."""
        if len(self.copy_log) < 2:  # one request's own copies never overlap
            return
        freed_by_out: set[int] = set()  # device blocks a swap-out reads (and freed)
        written_by_out: set[int] = set()  # host slots a swap-out writes
        filled_by_in: set[int] = set()  # device blocks a swap-in writes
        read_by_in: set[int] = set()  # host slots a swap-in reads
        for is_in, pairs in self.copy_log:
            for src, dst in pairs:
                if is_in:
                    if dst in freed_by_out:
                        raise CopyOrderError(f"device block {dst} freed by a swap-out is handed to a swap-in of "
                                             "the same step: the swap-in would overwrite it before it is read")
                    if src in written_by_out:
                        raise CopyOrderError(f"host slot {src} written by a swap-out is read by a swap-in of the "
                                             "same step: the swap-in would read it before it is written")
                    if dst in filled_by_in or src in read_by_in:
                        raise CopyOrderError(f"swap-in copy {src}->{dst} overlaps another swap-in of the step")
                    filled_by_in.add(dst)
                    read_by_in.add(src)
                else:
                    if dst in written_by_out or dst in read_by_in:
                        raise CopyOrderError(f"host slot {dst} is the target of a swap-out while another copy "
                                             "of the same step uses it")
                    freed_by_out.add(src)
                    written_by_out.add(dst)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of a sampled token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens for the requests whose `sample` flag was set, vectors for embedding requests."""

    sampled: dict[str, int] = field(default_factory=dict)
    # Requests that verified drafts: the accepted drafts then one more token (1 to d + 1 tokens), in place of
    # an entry in `sampled`.
    spec_sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Embedding requests whose prompt ended this step: their pooled vector (a host float32 tensor).
    pooled: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    pooled: object | None = None  # an embedding request's vector, on its only output

    @classmethod
    def of(cls, request, tokens: list[int], logprobs: list, pooled=None) -> RequestOutput:
        """What a step produced for `request` (a scheduling.Request), with its state after the step."""
        return cls(request_id=request.request_id, new_token_ids=tokens, finished=request.is_finished,
                   finish_reason=request.status.finish_reason, stop_reason=request.stop_reason, logprobs=logprobs,
                   num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
                   num_cached_tokens=max(request.num_cached_tokens, 0), pooled=pooled)


@dataclass(slots=True)
class SchedulerStats:
    """State after one engine step, for gauges and counters (counters are this step's increments)."""

    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0  # 0..1, cached-but-free blocks count as free
    num_free_host_blocks: int = 0
    num_total_host_blocks: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed this step (prefill work)
    num_generation_tokens: int = 0  # tokens sampled this step
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # of which found cached
    num_batched_tokens: int = 0
    num_scheduled_requests: int = 0
    step_duration_s: float = 0.0
    # Speculative decoding this step: requests that verified drafts, draft tokens, accepted drafts, and accepted
    # drafts by position in the draft (index 0: the first draft token).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # LoRA adapters (names, sorted) of the running and the waiting requests; max_loras 0: LoRA is off.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    # The latency budget: this step's time-between-tokens target (0: nothing decoded) and whether the step kept
    # it (one of the two is 1 for a measured step that had a target).
    itl_target_s: float = 0.0
    itl_steps_kept: int = 0
    itl_steps_missed: int = 0
    tenant_tokens: dict[str, int] = field(default_factory=dict)  # tokens served this step, by tenant
