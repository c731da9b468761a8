"""A request as the scheduler sees it: tokens, progress and status."""

from __future__ import annotations

import enum
import itertools
import time

from sluice.kvcache.hashing import BlockHash, hash_block_tokens
from sluice.scheduling.ngram import TokenBytes
from sluice.scheduling.outcomes import FinishReason
from sluice.scheduling.sampling_params import SamplingParams

_arrival_seq = itertools.count()


class RequestStatus(enum.IntEnum):
    """WAITING → RUNNING → (PREEMPTED | SWAPPED) → … → FINISHED_*; PREEMPTED requests wait again."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # recompute: KV dropped, back in the waiting queue
    SWAPPED = 3  # KV copied to host memory, in the swapped list
    FINISHED_STOPPED = 10  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 11  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 12  # client went away or asked to cancel
    FINISHED_ERROR = 13  # the engine step that held it failed

    @property
    def finished(self) -> bool:
        """True for every terminal status."""
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        """OpenAI's finish_reason for a terminal status (None while unfinished)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


def _first_block_key(params: SamplingParams) -> bytes:
    """The cache salt and the LoRA adapter, as the first block's extra hash key."""
    salt = params.cache_salt.encode("utf-8", "surrogatepass") if params.cache_salt else b""
    return salt + params.lora_request.hash_key if params.lora_request is not None else salt


class Request:
    """One sequence being generated. `num_computed_tokens` is the single measure of progress."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "all_token_ids",
        "token_bytes",
        "num_prompt_tokens",
        "sampling_params",
        "eos_token_id",
        "priority",
        "arrival_time",
        "arrival_seq",
        "status",
        "num_computed_tokens",
        "block_hashes",
        "num_preemptions",
        "stop_reason",
        "first_scheduled_time",
        "first_token_time",
        "num_cached_tokens",
        "flow_id",
        "client_id",
        "tenant",
        "num_charged_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        flow_id: str | None = None,
        tenant: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.token_bytes: TokenBytes | None = None  # packed copy for n-gram lookups, built on the first one
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_seq = next(_arrival_seq)  # breaks arrival-time ties deterministically
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first admission (-1: not yet admitted)
        # Fair shares (fairness.py): the flow is the API call that admitted it (its fan-out shares one), the client
        # whose counter it is charged to is its tenant where the operator names tenants, else its flow.
        self.flow_id = flow_id or request_id
        self.tenant = tenant
        self.client_id = f"tenant:{tenant}" if tenant else f"flow:{self.flow_id}"
        self.num_charged_tokens = 0  # tokens whose computation its client was charged for (recompute is free)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal status."""
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token."""
        self.all_token_ids.append(token_id)
        if self.token_bytes is not None:
            self.token_bytes.append(token_id)

    def update_block_hashes(self, block_size: int) -> None:
        """Extend the hash chain over every newly full block of known tokens."""
        hashes = self.block_hashes
        while (len(hashes) + 1) * block_size <= len(self.all_token_ids):
            start = len(hashes) * block_size
            parent = hashes[-1] if hashes else None
            # The salt and the adapter enter the first block only: the chain carries them into every later hash.
            extra = b"" if hashes else _first_block_key(self.sampling_params)
            hashes.append(hash_block_tokens(parent, self.all_token_ids[start : start + block_size], extra))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, priority={self.priority})"
        )
