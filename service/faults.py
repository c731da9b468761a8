"""Fault injection for tests: SLUICE_FAULT_INJECT makes chosen engine steps raise, through LLMEngine.fault_hook.

Specs, comma-separated: `token:<id>` fails every step that prefills a request whose prompt holds token <id>;
`step:<n>` fails the n-th step that runs (once). Unset (the default) installs nothing.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("sluice.faults")
ENV = "SLUICE_FAULT_INJECT"


class InjectedFault(RuntimeError):
    """Raised by an injected fault; the engine fails the step's requests and carries on."""


class FaultHook:
    """A fault_hook callable built from a spec string."""

    def __init__(self, spec: str):
        self.tokens: set[int] = set()
        self.steps: set[int] = set()
        self.count = 0
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, value = part.partition(":")
            if kind == "token":
                self.tokens.add(int(value))
            elif kind == "step":
                self.steps.add(int(value))
            else:
                raise ValueError(f"{ENV}: unknown fault {part!r} (use token:<id> or step:<n>)")

    def __call__(self, sched_out) -> None:
        self.count += 1
        if self.count in self.steps:
            raise InjectedFault(f"injected fault at step {self.count}")
        for s in sched_out.scheduled:
            # Only prefill chunks: a decode's single token is the model's choice, not the client's marker.
            if s.num_output_tokens == 0 and self.tokens.intersection(s.token_ids):
                raise InjectedFault(f"injected fault for request {s.request_id}")


def install_from_env(engine) -> None:
    """Set engine.fault_hook when SLUICE_FAULT_INJECT is set (tests only; logged loudly)."""
    spec = os.environ.get(ENV, "").strip()
    if spec:
        engine.fault_hook = FaultHook(spec)
        logger.warning("fault injection enabled (%s=%s): for tests only", ENV, spec)
