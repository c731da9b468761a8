"""The model executor: loading a model and preparing its weights (`model_loader.py`, `weight_prep.py`), Sluice's own
models and the layers they are built of (`models/`, `layers/`, `lora/`), the KV cache's size (`kv_sizing.py`), and
the model runner that runs a step's forward (`model_runner.py`, `forward_context.py`, `decode_buffers.py`,
`cuda_graphs.py`) and turns its logits into tokens (`logits_controls.py`, `sampler.py`, `spec_verify.py`) or
pooled vectors (`pooling.py`).

Uses `sluice.service.attention`, `sluice.service.config`, `sluice.scheduling`, `sluice.kvcache` and the root; never
the engine, the API, the benchmarks or the CLI."""
