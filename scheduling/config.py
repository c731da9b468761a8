"""Scheduler knobs: the single source of truth read by the CLI, the engine and the docs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sluice.knobs import knob

# Auto token budget. On an accelerator a step of 2048 tokens takes milliseconds. On CPU it takes seconds (about
# 4.5 s on 2 cores for SmolLM2-135M), and every running request's next token waits for it: 128 tokens per core
# keeps a step near half a second, and matmuls are already compute-bound at a few hundred rows.
GPU_BATCHED_TOKENS = 2048
CPU_BATCHED_TOKENS_PER_CORE = 128
CPU_BATCHED_TOKENS_MIN = 256
SPECULATIVE_METHODS = ("none", "ngram")
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 16
MAX_PROMPT_LOOKUP_WINDOW = 1 << 16


def auto_batched_tokens(device_type: str, cpus: int) -> int:
    """The step token budget `max_num_batched_tokens=0` stands for on this device."""
    if device_type != "cpu":
        return GPU_BATCHED_TOKENS
    return min(GPU_BATCHED_TOKENS, max(CPU_BATCHED_TOKENS_MIN, CPU_BATCHED_TOKENS_PER_CORE * cpus))


@dataclass(slots=True)
class SchedulerConfig:
    """Batch budgets, queue policy and preemption behaviour."""

    max_num_seqs: int = knob(64, "Most requests running in one engine step.")
    max_num_batched_tokens: int = knob(
        0,
        "Token budget of one engine step; longer prefills are split into chunks of at most this size "
        "(0: auto, 2048 on GPU, 128 per core within 256..2048 on CPU).",
    )
    max_model_len: int = knob(
        0, "Longest prompt + output a request may reach (0: the model's own context length)."
    )
    long_prefill_token_threshold: int = knob(
        0, "Cap on the prefill chunk one request may take per step (0: no cap beyond the step budget)."
    )
    scheduling_policy: str = knob(
        "fcfs",
        "Queue order: 'fcfs' (arrival order) or 'priority' (lower `priority` value first, FCFS among equals).",
        choices=("fcfs", "priority"),
    )
    max_queue_wait: float = knob(
        0.0,
        "Seconds a request may wait in the queue before it is first scheduled; past it, it is aborted with "
        "HTTP 429 'queue_timeout' (0: no limit). Bounds starvation of low priorities under the priority policy.",
    )
    preemption_mode: str = knob(
        "recompute",
        "What preemption does to a victim: 'recompute' (drop its KV, redo later) or 'swap' (copy KV to host memory).",
        choices=("recompute", "swap"),
    )
    max_itl_ms: float = knob(
        0.0,
        "Time-between-tokens target while requests decode, in ms: a step takes prompt tokens only up to what the "
        "engine's measured cost model says keeps it within this (at least one KV block's worth, so prompts always "
        "progress); with nothing decoding, prompts take the whole step budget. 0: auto, twice a step of the "
        "decoding rows alone, measured (a running stream keeps at least half its idle rate while a long prompt "
        "is prefilled); -1: off (prompts take every step's leftover budget). Only prompt work of clients served at "
        "least as much as the decoding ones is held to it: a burst queued before the streams began goes at full "
        "speed.",
    )
    tenant_header: str = knob(
        "",
        "HTTP header naming the tenant a request is charged to for fair shares (e.g. x-tenant; set it only behind "
        "a proxy that sets or strips it). Requests with the same value share one counter; without the header "
        "(or with this empty: off), each API call (its prompt list, n samples or embedding inputs) is a client "
        "of its own.",
    )
    fair_prompt_weight: float = knob(
        1.0, "Fair shares: service charged per prompt token computed (VTC's w_p)."
    )
    fair_output_weight: float = knob(
        2.0, "Fair shares: service charged per generated token (VTC's w_q; generating costs more per token)."
    )
    max_seqs_per_flow: int = knob(
        0,
        "Most sequences one API call's fan-out (prompt list, n, embedding inputs) may hold in the running batch "
        "(0: auto, max_num_seqs less an eighth, at least one seat left for others).",
    )
    speculative_method: str = knob(
        "none",
        "Speculative decoding: 'none', or 'ngram' (prompt lookup: each decoding request proposes the tokens that "
        "followed the latest earlier occurrence of its last few tokens in its own prompt and output, and one "
        "forward verifies them; greedy output is unchanged, sampled output keeps its distribution). Helps "
        "replies that copy their prompt (code edits, extraction, RAG); requests with structured outputs, "
        "logprobs, allowed_token_ids or bad_words decode without drafts.",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = knob(
        4, f"Most draft tokens verified per request and step with --speculative-method ngram "
        f"(1..{MAX_SPECULATIVE_TOKENS})."
    )
    prompt_lookup_max: int = knob(4, "Longest n-gram (the request's last tokens) matched to find drafts.")
    prompt_lookup_min: int = knob(2, "Shortest n-gram matched to find drafts (tried after the longer ones).")
    prompt_lookup_window: int = knob(
        4096, "Most recent tokens of a request searched for an n-gram match: bounds the proposer's work per "
        "step, however long the context."
    )

    def validate(self) -> None:
        """Raise ValueError on an inconsistent configuration."""
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 0:
            raise ValueError("max_num_batched_tokens must be >= 1, or 0 for auto")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}")
        if not self.max_queue_wait >= 0:
            raise ValueError("max_queue_wait must be >= 0 (0: no limit)")
        if not (self.max_itl_ms >= 0 or self.max_itl_ms == -1):
            raise ValueError("max_itl_ms must be >= 0 (0: auto) or -1 (off)")
        if not (self.fair_prompt_weight > 0 and self.fair_output_weight >= 0):
            raise ValueError("fair_prompt_weight must be > 0 and fair_output_weight >= 0")
        if self.max_seqs_per_flow < 0:
            raise ValueError("max_seqs_per_flow must be >= 0 (0: auto)")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption mode {self.preemption_mode!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.speculative_method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP:
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= "
                             f"{MAX_PROMPT_LOOKUP} (got {self.prompt_lookup_min} and {self.prompt_lookup_max})")
        if not self.prompt_lookup_max < self.prompt_lookup_window <= MAX_PROMPT_LOOKUP_WINDOW:
            raise ValueError(f"prompt_lookup_window must be in {self.prompt_lookup_max + 1}.."
                             f"{MAX_PROMPT_LOOKUP_WINDOW} (more than prompt_lookup_max)")

    @property
    def flow_seats(self) -> int:
        """max_seqs_per_flow with its auto value resolved."""
        if self.max_seqs_per_flow:
            return min(self.max_seqs_per_flow, self.max_num_seqs)
        return max(1, self.max_num_seqs - max(1, self.max_num_seqs // 8))

    def resolved(self, device_type: str, cpus: int) -> SchedulerConfig:
        """A copy with the auto (0) token budget replaced by this device's value."""
        if self.max_num_batched_tokens:
            return self
        return dataclasses.replace(self, max_num_batched_tokens=auto_batched_tokens(device_type, cpus))
