"""The HTTP API: the aiohttp app and its middlewares, request parsing and validation, the OpenAPI document.

Uses the engine (`sluice.service.engine`); nothing below imports it."""
