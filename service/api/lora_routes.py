"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}, behind the API key like every route but the probes; and the
adapters' cards in /v1/models (`root`: the adapter's name, never its path; `parent`: the base model).

The routes are the operator's choice: without --allow-runtime-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) both
answer 404 `runtime_lora_disabled`, as a vLLM server that never registered them would (404) but naming the rule.
With it, a load reads only from inside --lora-dir (400 `lora_path_not_allowed` otherwise), at most
--max-runtime-loras adapters (400 `too_many_runtime_loras`), each directory once (400 `lora_already_loaded`), under
a valid name that no adapter and not the base model holds (400 `invalid_lora_name`, `lora_name_taken`); the
operator's --lora-modules adapters cannot be unloaded (403 `lora_not_removable`). A refused load says what is wrong
in the server's words (400 `invalid_lora_adapter`), never quoting the files or a path; the log says more."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from sluice.service.api.errors import ApiErrorCode, RequestError, code_named
from sluice.service.api.middlewares import STATE
from sluice.service.api.preprocess import load_body
from sluice.service.config import lora_name_problem
from sluice.service.engine.async_engine import ModelInfo
from sluice.service.executor.lora.adapter import LoRAError
from sluice.service.executor.lora.manager import LoRANotFound

logger = logging.getLogger(__name__)
DISABLED = ("runtime LoRA loading is off on this server: the operator turns it on with --allow-runtime-lora and "
            "--lora-dir (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Read, check and register an adapter; the files are read in a worker thread, never on the event loop."""
    registry, model, body = await _registry_and_body(request)
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    if problem := lora_name_problem(name, model.served_model_name):
        raise RequestError(f"invalid lora_name: {problem}", "lora_name", ApiErrorCode.INVALID_LORA_NAME)
    try:
        await asyncio.get_running_loop().run_in_executor(None, registry.load_runtime, name, path)
    except LoRAError as e:
        # The client gets the server's words; the log gets the detail (file contents, paths), under the name.
        logger.warning("LoRA adapter %r not loaded from %r: %s%s", name, path, e, f" ({e.detail})" if e.detail else "")
        raise _refused(e) from None
    logger.info("LoRA adapter %r loaded at run time from %r", name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Forget a client's adapter (running requests finish with it); 404: not loaded, 403: the operator's."""
    registry, _, body = await _registry_and_body(request)
    name = _field(body, "lora_name")
    if lora_name_problem(name) is not None:  # no adapter has such a name: not quoted back
        raise RequestError("no LoRA adapter of that name is loaded", "lora_name", ApiErrorCode.MODEL_NOT_FOUND)
    try:
        registry.unload(name)
    except LoRANotFound:
        raise RequestError(f"the LoRA adapter '{name}' is not loaded", "lora_name",
                           ApiErrorCode.MODEL_NOT_FOUND) from None
    except LoRAError as e:
        raise _refused(e) from None
    logger.info("LoRA adapter %r unloaded", name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _refused(e: LoRAError) -> RequestError:
    """The engine's refusal as the client's error: its code, by name, decides the status (404, 403 or 400)."""
    return RequestError(str(e), e.param, code_named(e.code))


def adapter_cards(model: ModelInfo, created: int) -> list[dict]:
    """The /v1/models entries of the loaded adapters: names, never paths (`root` is the adapter's name)."""
    if model.loras is None:
        return []
    return [{"id": name, "object": "model", "created": created, "owned_by": "sluice",
             "max_model_len": model.max_model_len, "root": name, "parent": model.served_model_name}
            for name in model.loras.names()]


async def _registry_and_body(request: web.Request):
    state = request.app[STATE]
    raw = await request.read()  # over client_max_size: 413
    if state.engine is None:
        raise RequestError("the model is still loading", code=ApiErrorCode.LOADING)
    model = state.engine.model
    if model.loras is None or not model.loras.runtime:
        raise RequestError(DISABLED, code=ApiErrorCode.RUNTIME_LORA_DISABLED)
    return model.loras, model, load_body(raw)


def _field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{name}' must be a non-empty string", name)
    if len(value) > 4096:
        raise RequestError(f"'{name}' is longer than 4096 characters", name)
    return value
