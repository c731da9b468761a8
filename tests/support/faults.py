"""Fault injection, for tests only: make chosen engine steps fail as a broken forward would.

Specs, comma-separated: `token:<id>` fails every step that prefills a request whose prompt holds token <id>;
`step:<n>` fails the n-th step that runs (once). `install(engine, spec)` wraps the engine's
`runner.execute`, so a fault raises exactly where a failing forward would; a server subprocess gets them through
tests/support/fault_serve.py (`Server(..., faults=spec)` in tests/support/server.py).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sluice.faults")


class InjectedFault(RuntimeError):
    """Raised by an injected fault; the engine fails the step's requests and carries on."""


class FaultHook:
    """Built from a spec string; install() calls it with each step's SchedulerOutput before the forward."""

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
                raise ValueError(f"fault spec: unknown fault {part!r} (use token:<id> or step:<n>)")

    def __call__(self, sched_out) -> None:
        self.count += 1
        if self.count in self.steps:
            raise InjectedFault(f"injected fault at step {self.count}")
        for s in sched_out.scheduled:
            # Only prefill chunks: a decode's single token is the model's choice, not the client's marker.
            if s.num_output_tokens == 0 and self.tokens.intersection(s.token_ids):
                raise InjectedFault(f"injected fault for request {s.request_id}")


def install(engine, spec: str) -> FaultHook:
    """Make `engine` (an LLMEngine) fail the steps `spec` names; logged loudly. Returns the hook."""
    hook = FaultHook(spec)
    execute = engine.runner.execute

    def faulty_execute(sched_out, *args, **kwargs):
        hook(sched_out)
        return execute(sched_out, *args, **kwargs)

    engine.runner.execute = faulty_execute
    logger.warning("fault injection enabled (%s): for tests only", spec)
    return hook
