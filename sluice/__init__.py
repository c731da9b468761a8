"""Sluice: an OpenAI-compatible streaming LLM server with continuous batching and a paged KV cache.

The repository keeps one folder per layer at its root; pyproject.toml's package-dir maps them into this package:
`kvcache/` is `sluice.kvcache`, `scheduling/` `sluice.scheduling`, `service/` `sluice.service` and `metrics/`
`sluice.metrics`. Dependencies point one way: `sluice.service.api` → `sluice.service.engine` →
`sluice.scheduling` → `sluice.kvcache` (tests/test_layout.py checks). This folder holds only what belongs to
every layer.
"""
