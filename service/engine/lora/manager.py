"""The adapters a server holds: the registry of loaded ones (by name, bounded in number) and the device slots.

`LoRARegistry` is shared by the HTTP handlers (load, unload, name lookup: from any thread, under a lock; reading
files runs in the caller's thread, which the API keeps off the event loop) and the engine. `LoRASlots` belongs to
the engine thread: before each step it puts the step's adapters into the `--max-loras` slots of the wrapped
linears, least recently used out first. The scheduler never admits more distinct adapters into a step than there
are slots, so a step's adapters always fit.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict

import torch

from sluice.scheduling.sampling_params import LoRARequest
from sluice.service.engine.lora.adapter import Geometry, LoRAError, read_adapter
from sluice.service.engine.lora.layers import LoRABatch, LoRALinear, load_slot, lora_batch_of, wrap_model


class LoRANotFound(KeyError):
    """No adapter of that name is loaded (the API answers 404)."""


class LoRARegistry:
    """Loaded adapters by name; at most `max_adapters` of them."""

    def __init__(self, geometry: Geometry, max_rank: int, max_adapters: int, dtype: torch.dtype) -> None:
        self.geometry, self.max_rank, self.max_adapters, self.dtype = geometry, max_rank, max_adapters, dtype
        self._loaded: dict[str, tuple[LoRARequest, str]] = {}  # name -> (request, path)
        self._lock = threading.Lock()

    def load(self, name: str, path: str) -> LoRARequest:
        """Read, check and register the adapter at `path` under `name` (blocking: file reads); LoRAError."""
        if not name or len(name) > 256 or not name.isprintable():
            raise LoRAError("lora_name must be 1 to 256 printable characters", "lora_name")
        with self._lock:  # cheap checks first, so a refused load reads nothing
            self._check_room(name)
        weights = read_adapter(path, self.geometry, self.max_rank, self.dtype)
        with self._lock:
            self._check_room(name)
            # A random id: the first block's hash holds it, so no request can name another's cached prefix.
            request = LoRARequest(name, secrets.randbits(62), weights)
            self._loaded[name] = (request, str(path))
        return request

    def _check_room(self, name: str) -> None:
        if name in self._loaded:
            raise LoRAError(f"an adapter named {name!r} is already loaded", "lora_name")
        if len(self._loaded) >= self.max_adapters:
            raise LoRAError(f"{self.max_adapters} adapters are loaded (--max-cpu-loras); unload one first",
                            "lora_name")

    def unload(self, name: str) -> None:
        """Forget an adapter: new requests cannot name it; requests running with it finish with it."""
        with self._lock:
            if self._loaded.pop(name, None) is None:
                raise LoRANotFound(name)

    def get(self, name: str) -> LoRARequest | None:
        """The loaded adapter of that name, or None."""
        with self._lock:
            found = self._loaded.get(name)
        return None if found is None else found[0]

    def names(self) -> list[tuple[str, str]]:
        """(name, path) of every loaded adapter, in load order."""
        with self._lock:
            return [(name, path) for name, (_, path) in self._loaded.items()]


class LoRASlots:
    """The wrapped model's adapter slots: which adapter each holds, least recently used first."""

    def __init__(self, wrapped: list[dict[str, LoRALinear]], num_slots: int, device: torch.device) -> None:
        self.wrapped, self.num_slots, self.device = wrapped, num_slots, device
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, least recently used first

    def batch(self, requests: list[LoRARequest | None], rows: list[int]) -> LoRABatch | None:
        """The step's LoRABatch (None without adapter rows), its adapters put into slots first."""
        if all(r is None for r in requests):
            return None
        step = {r.uid: r for r in requests if r is not None}
        if len(step) > self.num_slots:
            raise RuntimeError(f"a step holds {len(step)} adapters but there are {self.num_slots} slots")
        for uid in step:
            if uid in self._slot_of:
                self._slot_of.move_to_end(uid)
        for uid, request in step.items():
            if uid not in self._slot_of:
                self._slot_of[uid] = slot = self._free_slot(step)
                load_slot(self.wrapped, slot, request.adapter)
        slots = [-1 if r is None else self._slot_of[r.uid] for r in requests]
        return lora_batch_of(slots, rows, self.device)

    def _free_slot(self, keep: dict[int, LoRARequest]) -> int:
        """An unused slot, else the least recently used one not needed by this step."""
        used = set(self._slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            return free[0]
        victim = next(uid for uid in self._slot_of if uid not in keep)
        return self._slot_of.pop(victim)


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


def enable_lora(model, config, device: torch.device, dtype: torch.dtype) -> tuple[LoRARegistry, LoRASlots]:
    """Wrap an owned model's linears for `config.max_loras` adapter slots and load `config.lora_modules`."""
    from sluice.service.engine.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError("LoRA adapters need Sluice's own model path (a Llama-family model, without "
                         "--no-owned-model)")
    registry = LoRARegistry(Geometry.of(model.config), config.max_lora_rank, config.max_adapters, dtype)
    slots = LoRASlots(wrap_model(model, config.max_loras, config.max_lora_rank, dtype, device), config.max_loras,
                      device)
    for spec in config.lora_modules:
        name, path = parse_lora_module(spec)
        try:
            registry.load(name, path)
        except LoRAError as e:
            raise ValueError(f"--lora-modules {name}: {e}") from None
    return registry, slots
