"""A model-free LLMEngine stand-in for AsyncEngine and HTTP tests: one "x" per running request per step."""

from __future__ import annotations

import threading
import time

import torch

from sluice.scheduling.outcomes import FinishReason
from sluice.service.engine.outputs import EngineOutput


class FakeEngine:
    """One token ("x") per running request per step; records which threads call it."""

    served_model_name = "fake"
    max_model_len = 64
    loras = None  # serves no LoRA adapters
    embedding = None  # and no /v1/embeddings
    device = torch.device("cpu")

    def __init__(self, step_delay: float = 0.0, fail_at_step: int | None = None, tokenizer=None):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer) if tokenizer is not None else 1000
        self.error_at_token: int | None = None  # a "model failure": that token ends the request with "error"
        self.add_error: Exception | None = None  # raised by add_request (an engine bug)
        self.requests: dict[str, list[int]] = {}  # id -> [produced, max_tokens, prompt_len]
        self.pending: list[EngineOutput] = []
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.step_delay, self.fail_at_step, self.steps = step_delay, fail_at_step, 0

    def add_request(self, rid, prompt, params, priority=0, arrival_time=None, trace_headers=None, flow=None,
                    tenant=None):
        self.threads.add(threading.get_ident())
        if self.add_error is not None:
            raise self.add_error
        if not prompt:
            raise ValueError("the prompt is empty")
        self.requests[rid] = [0, params.max_tokens, len(prompt)]
        return len(prompt)

    def abort_request(self, rid):
        self.threads.add(threading.get_ident())
        if self.requests.pop(rid, None) is not None:
            self.aborted.append(rid)
            self.pending.append(EngineOutput.ended(rid, FinishReason.ABORT))

    def has_unfinished_requests(self):
        return bool(self.requests or self.pending)

    def step(self):
        self.threads.add(threading.get_ident())
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("boom")
        time.sleep(self.step_delay)
        outs, self.pending = self.pending, []
        for rid, st in list(self.requests.items()):
            st[0] += 1
            if st[0] == self.error_at_token:
                outs.append(EngineOutput.ended(rid, FinishReason.ERROR, message="RuntimeError: CUDA",
                                               num_prompt_tokens=st[2], num_output_tokens=st[0]))
                del self.requests[rid]
                continue
            done = st[0] >= st[1]
            outs.append(EngineOutput.tokens(rid, "x", [7], [], FinishReason.LENGTH if done else None, st[2], st[0], 0))
            if done:
                del self.requests[rid]
        return outs

    num_waiting = num_running = num_swapped = property(lambda self: len(self.requests))

    def kv_stats(self):
        return {"free_blocks": 10 - len(self.requests), "total_blocks": 10}
