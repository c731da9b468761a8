"""The HTTP API: the aiohttp app and its middlewares, request parsing and validation, the OpenAPI document.

Uses the engine (`sluice.service.engine`) and the rooms below it (the executor's LoRA registry and pooling, the
grammars' errors in `sluice.service.structured`); nothing below imports it."""
