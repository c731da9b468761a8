"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True, frozen=True)
class ReasoningSpan:
    """A reasoning model's thinking at the start of its output: a constraint applies only once it has ended."""

    end: tuple[int, ...]  # the token ids that end the thinking (`</think>`)
    # Set: the thinking is optional, and happens only when the first output token is this one (`<think>`); any
    # other first token starts the constraint at once. None: the output starts inside the thinking.
    start: int | None = None


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A constraint every output token must keep: the text so far stays a prefix of something it accepts.

    `spec` is the constraint's text: a JSON schema (kind 'json'), a regex, a JSON list of strings ('choice'),
    or an EBNF grammar; empty for 'json_object'. `param` names the API parameter it came from, for errors.
    """

    kind: str
    spec: str = ""
    param: str = "response_format"
    after_reasoning: ReasoningSpan | None = None  # None: the constraint holds from the first output token

    @property
    def key(self) -> tuple[str, str]:
        """What compiled grammars are cached by."""
        return (self.kind, self.spec)


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """The LoRA adapter a request runs with (vLLM's LoRARequest): its name, an id unique to this load of it, and
    its weights (opaque here: service/executor/lora owns them)."""

    name: str
    uid: int
    adapter: object = field(repr=False, compare=False)

    @property
    def hash_key(self) -> bytes:
        """What enters the first block's hash: a reloaded adapter of the same name never reuses the old KV."""
        return f"\0lora:{self.uid}:{self.name}".encode("utf-8", "surrogatepass")
class Pooling(enum.Enum):
    """Which final hidden states of the prompt make its embedding."""

    LAST = "last"  # the last token's (decoder embedding models: Qwen3-Embedding, e5-mistral)
    MEAN = "mean"  # the mean over every prompt token (sentence-transformers' pooling_mode_mean_tokens)
    CLS = "cls"  # the first token's


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """An embedding request: nothing is generated, the request ends with its prompt's pooled final hidden state."""

    mode: Pooling = Pooling.LAST
    normalize: bool = True  # L2-normalize the vector (after truncating it to `dimensions`)
    dimensions: int | None = None  # Matryoshka: keep only the first this many components

    @property
    def needs_every_token(self) -> bool:
        """Mean and first-token pooling read hidden states a prefix-cache hit would skip computing."""
        return self.mode is not Pooling.LAST


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; validated by `validate()`, once, when the engine admits it."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; N >= 0: sampled token plus top-N alternatives
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None  # grammar-constrained decoding (service/structured/grammar.py)
    # Logit controls (service/executor/logits_controls.py); each is neutral at its default.
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often the token was generated
    repetition_penalty: float = 1.0  # transformers/vLLM: over prompt and output, logit / p if > 0 else logit * p
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to the logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # allowed_token_ids as a [vocab] bool device tensor, True where a token is NOT allowed: built once by the engine
    # at admission (service/executor/logits_controls.py: AllowedMasks) and shared by the requests of one list.
    disallowed_token_mask: object | None = field(default=None, repr=False, compare=False)
    bad_words: list[str] = field(default_factory=list)  # never generate these (as text)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # their tokenizations (the engine fills)
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # Not a sampling choice but a request option carried with them (vLLM's `cache_salt`): requests share cached
    # prefix blocks only when their salts are equal, so one tenant's prompts never warm another's cache.
    cache_salt: str | None = None
    # Likewise a request option: the LoRA adapter its `model` named (None: the base model). Enters the hash too.
    lora_request: LoRARequest | None = None
    pooling: PoolingParams | None = None  # set: an embedding request (prompt only, no sampling)

    @property
    def has_logit_controls(self) -> bool:
        """True when a logit control is away from its neutral value (the processor then touches this row)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def needs_token_history(self) -> bool:
        """Penalties and bad words look at the tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        # Below 1e-5 (vLLM's epsilon) logits / temperature overflows float32: treat it as argmax.
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError with a user-facing message, starting with the field's name, when a field is out of range.

        The one check for in-process callers, run once per request by Engine.add_request. The HTTP API's values
        come bounded by its protocol models (service/api/protocol_models.py), which declare the same ranges for
        clients (and /openapi.json), and min_tokens <= max_tokens by protocol.resolve_params, which settles
        max_tokens: for them this check refuses nothing.
        """
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0 or self.temperature != self.temperature:
            raise ValueError("temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if self.structured_output is not None and self.structured_output.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_output kind must be one of {', '.join(STRUCTURED_KINDS)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError("repetition_penalty must be in (0, 100]")
        if self.logit_bias and any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError("seed must fit in 64 bits")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.pooling is not None and self.pooling.dimensions is not None and self.pooling.dimensions < 1:
            raise ValueError("dimensions must be at least 1")
