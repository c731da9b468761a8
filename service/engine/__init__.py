"""The engine core: `LLMEngine` (the synchronous step loop: scheduler, model runner, detokenizer, stop checks;
`engine.py`), grammar-constrained requests on it (`constrained.py`), incremental detokenizing (`detokenizer.py`),
its outputs (`outputs.py`), KV cache events (`kv_events.py`) and `AsyncEngine`, the asyncio shell the API awaits
(`async_engine.py`).

Uses `sluice.service.executor`, `sluice.service.structured`, `sluice.service.attention`, `sluice.scheduling`,
`sluice.kvcache` and `sluice.metrics`; never the API, the benchmarks or the CLI."""
