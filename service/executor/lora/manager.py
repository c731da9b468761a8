"""The adapters a server holds: the registry of loaded ones (by name, bounded in number) and the device slots.

`LoRARegistry` is shared by the HTTP handlers (load, unload, name lookup: from any thread, under a lock; reading
files runs in the caller's thread, which the API keeps off the event loop) and the engine. `LoRASlots` belongs to
the engine thread: before each step it puts the step's adapters into the `--max-loras` slots of the wrapped
linears, least recently used out first. The scheduler never admits more distinct adapters into a step than there
are slots, so a step's adapters always fit.

Two kinds of adapter: the operator's (`--lora-modules`, loaded at start, from anywhere, never unloaded) and the
clients' (`load_runtime`, only with `--allow-runtime-lora`: from inside `--lora-dir`, at most
`--max-runtime-loras` of them, each directory once). The operator's always fit: the clients' count apart.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.scheduling.sampling_params import LoRARequest
from sluice.service.config import lora_name_problem, parse_lora_module
from sluice.service.executor.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, Geometry, LoRAError, read_adapter
from sluice.service.executor.lora.layers import LoRABatch, LoRALinear, load_slot, lora_batch_of, wrap_model

__all__ = ["LoRANotFound", "LoRARegistry", "LoRASlots", "enable_lora", "parse_lora_module"]
logger = logging.getLogger(__name__)


class LoRANotFound(KeyError):
    """No adapter of that name is loaded (the API answers 404)."""


@dataclass(frozen=True, slots=True)
class _Loaded:
    request: LoRARequest
    path: Path  # resolved: where its files were read (never shown to a client)
    runtime: bool  # loaded by a client (removable), not given at start


class LoRARegistry:
    """Loaded adapters by name: the operator's, and at most `max_runtime` loaded by clients from inside
    `runtime_root` (None: clients may load none); at most `max_adapters` in all."""

    def __init__(self, geometry: Geometry, max_rank: int, max_adapters: int, dtype: torch.dtype,
                 runtime_root: str | Path | None = None, max_runtime: int = 0) -> None:
        self.geometry, self.max_rank, self.max_adapters, self.dtype = geometry, max_rank, max_adapters, dtype
        self.runtime_root = None if runtime_root is None else Path(runtime_root).resolve()
        self.max_runtime = max_runtime
        self._loaded: dict[str, _Loaded] = {}
        self._lock = threading.Lock()

    @property
    def runtime(self) -> bool:
        """Whether clients may load and unload adapters."""
        return self.runtime_root is not None

    def load(self, name: str, path: str | Path) -> LoRARequest:
        """Read, check and register the operator's adapter at `path` under `name` (blocking: file reads): not
        confined, not counted against the clients' cap, never unloaded through the API; LoRAError."""
        return self._add(name, Path(path).resolve(), runtime=False)

    def load_runtime(self, name: str, path: str) -> LoRARequest:
        """A client's load: `path` (relative ones from `runtime_root`) must resolve inside `runtime_root`, name a
        directory no adapter was read from, and leave the clients' count within `max_runtime`; LoRAError."""
        if self.runtime_root is None:
            raise LoRAError("runtime LoRA loading is off on this server", "lora_name", status=404,
                            code="runtime_lora_disabled")
        return self._add(name, self._confine(path), runtime=True)

    def _confine(self, path: str) -> Path:
        """`path` resolved (symlinks and '..' followed) inside the root, its two files too; LoRAError naming
        lora_path otherwise (the resolved path is never quoted)."""
        root = self.runtime_root
        try:
            resolved = (root / path).resolve()  # an absolute `path` replaces the root
            inside = resolved.is_relative_to(root) and all(
                (resolved / f).resolve().is_relative_to(root) for f in (CONFIG_FILE, WEIGHTS_FILE))
        except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
            inside = False
        if not inside:
            raise LoRAError("lora_path must name a directory inside the server's adapter directory (--lora-dir); "
                            "a relative lora_path is taken from there", code="lora_path_not_allowed",
                            detail=f"lora_path {path!r} is outside {str(root)!r}")
        return resolved

    def _add(self, name: str, path: Path, runtime: bool) -> LoRARequest:
        if problem := lora_name_problem(name):
            raise LoRAError(problem, "lora_name", code="invalid_lora_name")
        with self._lock:  # cheap checks first, so a refused load reads nothing
            self._check_room(name, path, runtime)
        weights = read_adapter(path, self.geometry, self.max_rank, self.dtype)
        with self._lock:
            self._check_room(name, path, runtime)
            # A random id: the first block's hash holds it, so no request can name another's cached prefix.
            request = LoRARequest(name, secrets.randbits(62), weights)
            self._loaded[name] = _Loaded(request, path, runtime)
        return request

    def _check_room(self, name: str, path: Path, runtime: bool) -> None:
        if name in self._loaded:
            raise LoRAError(f"an adapter named {name!r} is already loaded", "lora_name", code="lora_name_taken")
        if runtime:
            if any(e.path == path for e in self._loaded.values()):
                raise LoRAError("the adapter at lora_path is already loaded under another name", "lora_path",
                                code="lora_already_loaded")
            count = sum(e.runtime for e in self._loaded.values())
            if count >= self.max_runtime:
                raise LoRAError(f"{count} adapters loaded at run time already (--max-runtime-loras "
                                f"{self.max_runtime}); unload one first", "lora_name", code="too_many_runtime_loras")
        if len(self._loaded) >= self.max_adapters:
            raise LoRAError(f"{self.max_adapters} adapters are loaded (--max-cpu-loras); unload one first",
                            "lora_name", code="too_many_loras")

    def unload(self, name: str) -> None:
        """Forget an adapter a client loaded: new requests cannot name it; requests running with it finish with
        it. LoRANotFound for a name not loaded, LoRAError (403) for one of the operator's."""
        with self._lock:
            entry = self._loaded.get(name)
            if entry is None:
                raise LoRANotFound(name)
            if not entry.runtime:
                raise LoRAError(f"the adapter {name!r} was given at start-up (--lora-modules) and cannot be unloaded",
                                "lora_name", status=403, code="lora_not_removable")
            del self._loaded[name]

    def get(self, name: str) -> LoRARequest | None:
        """The loaded adapter of that name, or None."""
        with self._lock:
            found = self._loaded.get(name)
        return None if found is None else found.request

    def names(self) -> list[str]:
        """The name of every loaded adapter, in load order."""
        with self._lock:
            return list(self._loaded)


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


def enable_lora(model, config, device: torch.device, dtype: torch.dtype,
                served_model_name: str = "") -> tuple[LoRARegistry, LoRASlots]:
    """Wrap an owned model's linears for `config.max_loras` adapter slots and load `config.lora_modules`
    (none may take `served_model_name`)."""
    from sluice.service.executor.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError("LoRA adapters need Sluice's own model path (a Llama-family model, without "
                         "--no-owned-model)")
    runtime_root = None
    if config.runtime_loading:
        if not config.lora_dir:
            raise ValueError("--allow-runtime-lora needs --lora-dir DIR, the one directory clients may load from")
        runtime_root = config.lora_dir
    registry = LoRARegistry(Geometry.of(model.config), config.max_lora_rank, config.max_adapters, dtype,
                            runtime_root, config.max_runtime_loras)
    slots = LoRASlots(wrap_model(model, config.max_loras, config.max_lora_rank, dtype, device), config.max_loras,
                      device)
    for spec in config.lora_modules:
        name, path = parse_lora_module(spec)
        problem = lora_name_problem(name, served_model_name)
        if problem is not None:
            raise ValueError(f"--lora-modules {name}: {problem}")
        try:
            registry.load(name, path)
        except LoRAError as e:  # the operator's own adapter: the whole story, paths and file contents too
            raise ValueError(f"--lora-modules {name}: {e}" + (f" ({e.detail})" if e.detail else "")) from None
    if registry.runtime:
        logger.info("runtime LoRA loading on: from %s, at most %d adapters", registry.runtime_root,
                    registry.max_runtime)
    return registry, slots
