"""Sluice: an OpenAI-compatible streaming LLM server with continuous batching and a paged KV cache.

The repository keeps one folder per layer at its root; pyproject.toml's package-dir maps them into this package:
`kvcache/` is `sluice.kvcache`, `scheduling/` `sluice.scheduling`, `service/` `sluice.service` and `metrics/`
`sluice.metrics`. Dependencies point one way: `sluice.service.api` → `sluice.service.engine` →
`sluice.service.executor` → `sluice.service.structured` → `sluice.service.attention` → `sluice.scheduling` →
`sluice.kvcache` (tests/test_layout.py's ROOMS, with the config and metrics). This folder holds only what belongs
to every layer.
"""
