"""Structured decoding: grammars compiled from a request's constraint (`grammar_compile.py`, in worker processes
`grammar_worker.py` forked from `zygote.py`), checked for their bounds (`grammar_checks.py`), and the per-request
matchers that fill a step's token bitmask (`grammar.py`). The engine's mixin over it is
`service/engine/constrained.py`.

Uses `sluice.service.config`, `sluice.scheduling` and the root; never the executor, the engine or the API."""
