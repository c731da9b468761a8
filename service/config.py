"""The one configuration object: every knob of the model, cache, scheduler and server."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.kvcache.config import CacheConfig, knob
from sluice.scheduling.config import SchedulerConfig


@dataclass(slots=True)
class ModelConfig:
    """Which model to load, where and in what precision."""

    model: str = knob(
        "default", "Model: a HF directory, a .gguf file, a hub id, or 'default' (SmolLM2-135M-Instruct)."
    )
    served_model_name: str = knob(
        "", "Model name the API reports and accepts (default: derived from --model)."
    )
    device: str = knob("auto", "Device: 'auto' (CUDA when available, else CPU), 'cpu', 'cuda', 'cuda:N'.")
    dtype: str = knob(
        "auto", "Weights and KV dtype: 'auto' (bf16 on CUDA, fp32 on CPU), 'float32', 'bfloat16', 'float16'."
    )
    cache_dir: str = knob(
        "", "Where the default model is unpacked and cached (default: $SLUICE_CACHE_DIR or ~/.cache/sluice)."
    )
    prepack_weights: bool = knob(
        True,
        "CPU fp32: keep Linear weights prepacked for oneDNN (1.2-2.5x faster matmuls at engine batch sizes).",
        flag="--no-prepack-weights",
    )


@dataclass(slots=True)
class ServerConfig:
    """The HTTP server and its admission limits."""

    host: str = knob("127.0.0.1", "Address to listen on.")
    port: int = knob(8000, "Port to listen on.")
    api_key: str = knob("", "Require 'Authorization: Bearer <key>' on the API (empty: no auth).")
    max_queued_requests: int = knob(256, "Requests allowed to wait before new ones get 429.")
    shutdown_timeout: float = knob(30.0, "Seconds in-flight requests may take to finish after SIGTERM.")
    max_request_body_bytes: int = knob(1 << 20, "Largest accepted request body in bytes (larger: 413).")
    max_stream_buffer: int = knob(
        4096, "Outputs buffered per request for a client that stops reading its stream; past this it is aborted."
    )
    stream_write_timeout: float = knob(
        30.0, "Seconds one SSE write may wait on a client that stopped reading; then its connection is dropped."
    )
    stream_send_buffer: int = knob(
        262144, "Kernel send buffer in bytes per SSE stream: bounds what a client that stops reading holds (0: OS)."
    )
    log_level: str = knob("info", "Log level: debug, info, warning, error.")


@dataclass(slots=True)
class SluiceConfig:
    """Everything Sluice can be told; the CLI builds one, the engine and server read it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def validate(self) -> None:
        """Raise ValueError on an inconsistent configuration."""
        self.cache.validate()
        self.scheduler.validate()
