"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}, behind the API key like every route but the probes; and the
adapters' cards in /v1/models (`root`: the adapter's path, `parent`: the base model)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from sluice.service.api.errors import RequestError
from sluice.service.api.middlewares import STATE
from sluice.service.api.preprocess import load_body
from sluice.service.engine.async_engine import ModelInfo
from sluice.service.engine.lora.adapter import LoRAError
from sluice.service.engine.lora.manager import LoRANotFound


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Read, check and register an adapter; the files are read in a worker thread, never on the event loop."""
    registry, body = await _registry_and_body(request)
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    try:
        await asyncio.get_running_loop().run_in_executor(None, registry.load, name, path)
    except LoRAError as e:
        raise RequestError(str(e), e.param, code="invalid_lora_adapter") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Forget an adapter (requests already running with it finish with it); 404 for a name not loaded."""
    registry, body = await _registry_and_body(request)
    name = _field(body, "lora_name")
    try:
        registry.unload(name)
    except LoRANotFound:
        raise RequestError(f"the LoRA adapter '{name}' is not loaded", "lora_name", status=404,
                           code="model_not_found") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def adapter_cards(model: ModelInfo, created: int) -> list[dict]:
    """The /v1/models entries of the loaded adapters."""
    if model.loras is None:
        return []
    return [{"id": name, "object": "model", "created": created, "owned_by": "sluice",
             "max_model_len": model.max_model_len, "root": path, "parent": model.served_model_name}
            for name, path in model.loras.names()]


async def _registry_and_body(request: web.Request):
    state = request.app[STATE]
    raw = await request.read()  # over client_max_size: 413
    if state.engine is None:
        raise RequestError("the model is still loading", status=503, type="server_error", code="loading")
    registry = state.engine.model.loras
    if registry is None:
        raise RequestError("this server serves no LoRA adapters (start it with --enable-lora)", "lora_name",
                           code="lora_disabled")
    return registry, load_body(raw)


def _field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{name}' must be a non-empty string", name)
    if len(value) > 4096:
        raise RequestError(f"'{name}' is longer than 4096 characters", name)
    return value
