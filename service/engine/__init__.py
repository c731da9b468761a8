"""The engine: model loading and prepacking, the model runner, paged-attention backend and sampler, the
detokenizer, `LLMEngine` (the synchronous core) and `AsyncEngine`.

Uses `sluice.scheduling`, `sluice.kvcache` and `sluice.metrics`; never the API, the benchmarks or the CLI."""
