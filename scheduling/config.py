"""Scheduler knobs: the single source of truth read by the CLI, the engine and the docs."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.config import knob


@dataclass(slots=True)
class SchedulerConfig:
    """Batch budgets, queue policy and preemption behaviour."""

    max_num_seqs: int = knob(64, "Most requests running in one engine step.")
    max_num_batched_tokens: int = knob(
        2048, "Token budget of one engine step; longer prefills are split into chunks of at most this size."
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
    preemption_mode: str = knob(
        "recompute",
        "What preemption does to a victim: 'recompute' (drop its KV, redo later) or 'swap' (copy KV to host memory).",
        choices=("recompute", "swap"),
    )

    def validate(self) -> None:
        """Raise ValueError on an inconsistent configuration."""
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption mode {self.preemption_mode!r}")
