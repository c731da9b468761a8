"""KV cache events: what the prefix cache gained and lost, in the shape of vLLM's KV events.

The block pool and the manager append an event when a full block becomes findable by its hash (BlockStored), when
a findable block is evicted or its contents are dropped (BlockRemoved), and when the whole prefix cache is
forgotten (AllBlocksCleared). They append to a `KVEventSink`, a bounded list the engine drains after each step;
service/engine/kv_events.py encodes the batches with msgpack and publishes them over ZMQ. Nothing here knows of
either: `wire()` gives each event as the plain list that msgpack encodes, field for field as vLLM's msgspec structs
(`array_like=True`, tagged) put it on the wire: the tag first, then the fields in declaration order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from sluice.kvcache.hashing import BlockHash

# The `medium` of every event: the tier the blocks live in. vLLM names its device pool "GPU" (and "CPU" for blocks
# an offloading connector copied to host memory); Sluice's device pool is the only tier findable by hash, so it is
# "GPU" on every device, a CPU-only replica included: routers weigh tiers by these names (llm-d's scorer lowercases
# them to pick its per-tier weight) and "CPU" would read as an offloaded copy. Host swap slots are not findable by
# hash (a swapped request resumes from its own copy), so they send no events.
MEDIUM_DEVICE = "GPU"


def external_hash(block_hash: BlockHash) -> int:
    """A block's 64-bit id on the wire: the last 8 bytes of its SHA-256 chain hash, big-endian, unsigned (vLLM's
    integer form of a digest: the digest as an integer, low 64 bits)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(slots=True)
class BlockStored:
    """Full blocks that became findable, in chain order: block i's parent is block i-1, the first's is
    `parent_block_hash` (None: the first block of a prompt). `token_ids` are the tokens of all of them."""

    TAG: ClassVar[str] = "BlockStored"
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block, what its hash covers beyond the tokens (vLLM's order: the adapter's name, then the cache salt, on
    # the first block of a prompt only), None for a block with nothing; None for the whole list when no block has.
    extra_keys: list[tuple[Any, ...] | None] | None = None

    def wire(self) -> list:
        """The event as msgpack encodes it; the trailing default (extra_keys None) is left out, as vLLM's
        msgspec encoder does with omit_defaults."""
        out = [self.TAG, self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size, self.lora_id,
               self.medium, self.lora_name]
        if self.extra_keys is not None:
            out.append([list(k) if k is not None else None for k in self.extra_keys])
        return out


@dataclass(slots=True)
class BlockRemoved:
    """Blocks no longer findable by their hash (evicted for reuse, or their contents dropped)."""

    TAG: ClassVar[str] = "BlockRemoved"
    block_hashes: list[int]
    medium: str | None

    def wire(self) -> list:
        """The event as msgpack encodes it."""
        return [self.TAG, self.block_hashes, self.medium]


@dataclass(slots=True)
class AllBlocksCleared:
    """Every cached prefix was forgotten."""

    TAG: ClassVar[str] = "AllBlocksCleared"

    def wire(self) -> list:
        """The event as msgpack encodes it."""
        return [self.TAG]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventSink:
    """Append-only, bounded: the engine thread appends during a step and takes the lot after it (`drain`).

    Past `max_events` undrained events the newest are dropped and counted, never blocking the step; a consumer then
    misses them, which the publisher shows as a gap in the batch sequence.
    """

    __slots__ = ("events", "max_events", "num_dropped")

    def __init__(self, max_events: int = 100_000) -> None:
        if max_events < 1:
            raise ValueError("max_events must be >= 1")
        self.events: list[KVCacheEvent] = []
        self.max_events = max_events
        self.num_dropped = 0

    def append(self, event: KVCacheEvent) -> None:
        """Record one event (or count it dropped when full)."""
        if len(self.events) < self.max_events:
            self.events.append(event)
        else:
            self.num_dropped += 1

    def drain(self) -> list[KVCacheEvent]:
        """Every event appended since the last drain, oldest first."""
        events, self.events = self.events, []
        return events


def request_event_keys(request: object) -> tuple[int | None, str | None, str | None]:
    """(lora_id, lora_name, cache_salt) of a request: what its first block's hash takes beyond the tokens.

    Read from `request.sampling_params` as scheduling's SamplingParams holds them (`lora_request.uid` and `.name`,
    `cache_salt`); a request without them has none.
    """
    params = getattr(request, "sampling_params", None)
    lora = getattr(params, "lora_request", None)
    salt = getattr(params, "cache_salt", None) or None
    if lora is None:
        return None, None, salt
    return lora.uid, lora.name, salt


def block_extra_keys(first_block: int, num_blocks: int, lora_name: str | None,
                     cache_salt: str | None) -> list[tuple[Any, ...] | None] | None:
    """Per block of a BlockStored run starting at block `first_block` of its request: the adapter's name on every
    block (vLLM's layout), the cache salt on block 0; None when there is neither."""
    if lora_name is None and cache_salt is None:
        return None
    keys: list[tuple[Any, ...] | None] = []
    for i in range(first_block, first_block + num_blocks):
        key = (*((lora_name,) if lora_name is not None else ()), *((cache_salt,) if i == 0 and cache_salt else ()))
        keys.append(key or None)
    return keys
