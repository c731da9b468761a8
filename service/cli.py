"""The `sluice` command: `sluice serve [flags]`, flags generated from the config dataclasses."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys

from sluice.service.config import SluiceConfig, add_config_flags, config_from_args

logger = logging.getLogger("sluice")


def build_parser() -> argparse.ArgumentParser:
    """`sluice` and its subcommands (others, such as `sluice bench`, add their subparsers here)."""
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: an OpenAI-compatible streaming LLM server.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser("serve", help="Start the HTTP server.", description=(
        "Serve the OpenAI-compatible API. Every flag can also be set with the environment variable shown."))
    add_config_flags(serve)
    serve.set_defaults(func=_serve_command)
    # `sluice bench ...`, `sluice soak`: development tools, present in a source checkout and not in the product
    # wheel; they add their subparsers (each sets `func(args) -> exit code`).
    if importlib.util.find_spec("sluice.service.bench") is not None:
        from sluice.service.bench import add_bench_subcommands
        from sluice.service.bench.soak import add_soak_subcommand

        add_bench_subcommands(commands)
        add_soak_subcommand(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sluice` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return args.func(args)


def _serve_command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        config.validate()
        if config.server.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"unknown log level {config.server.log_level!r}")
    except ValueError as e:
        print(f"sluice serve: error: {e}", file=sys.stderr)
        return 2
    setup_logging(config.server.log_level)
    _start_compile_zygote()
    try:
        import uvloop
    except ImportError:  # Windows: plain asyncio
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))


def _start_compile_zygote() -> None:
    """Fork the grammar compile zygote now, with torch imported and before the event loop, the engine or a
    tokenizer starts any thread; skipped where xgrammar is not installed (no compile will ever run)."""
    if importlib.util.find_spec("xgrammar") is None:
        return
    import sluice.service.engine.async_engine  # noqa: F401  torch and the engine's modules, shared with the fork
    from sluice.service.structured.grammar_compile import start_zygote

    start_zygote()


class _RequestIdFilter(logging.Filter):
    """Stamps every record with the request id of the handler that logged it ('-' outside requests)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from sluice.service.api.middlewares import request_id_var

        record.request_id = request_id_var.get()
        return True


def setup_logging(level: str) -> None:
    """One stderr handler; records carry the request id."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


async def serve(config: SluiceConfig) -> int:
    """Bind first (so /health answers while loading), load the model, serve until SIGTERM, then drain."""
    from aiohttp import web

    from sluice.service.api.api_server import create_app
    from sluice.service.api.middlewares import STATE
    from sluice.service.api.preprocess import max_token_bytes
    from sluice.service.engine.async_engine import AsyncEngine
    from sluice.service.engine.engine import freeze_startup_objects

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    srv = config.server
    app = create_app(config)
    state = app[STATE]
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its requests.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0,
                           access_log_format='%a "%r" %s %b %Tfs')
    await runner.setup()
    try:
        await web.TCPSite(runner, srv.host, srv.port).start()
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", srv.host, srv.port, e)
        await runner.cleanup()
        return 1
    url = f"http://{srv.host}:{srv.port}"
    logger.info("listening on %s; loading model %s", url, config.model.model)

    load = asyncio.ensure_future(AsyncEngine.load(config))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([load, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not load.done():  # SIGTERM while loading: nothing in flight, and the loader thread cannot be stopped
        logger.info("stopped while loading")
        logging.shutdown()
        os._exit(0)
    if load.exception() is not None:
        logger.error("failed to load the model: %s", load.exception(), exc_info=load.exception())
        await runner.cleanup()
        return 1
    engine = load.result()
    await state.preprocessor.run(max_token_bytes, engine.model.tokenizer)  # the prompt bound, before any request
    freeze_startup_objects()
    engine.start()
    state.engine = engine
    e = engine.engine
    logger.info(
        "Sluice ready: model %s on %s (%s), %d KV blocks x %d tokens (%.1f MiB KV cache), max_model_len %d, "
        "step budget %d tokens / %d seqs, serving %s", e.served_model_name, e.device,
        str(e.dtype).removeprefix("torch."), e.num_kv_blocks, config.cache.block_size, e.kv_cache_bytes / 2**20,
        e.max_model_len, e.config.scheduler.max_num_batched_tokens, e.config.scheduler.max_num_seqs, url)

    await stopped
    logger.info("shutting down: draining for up to %.0fs", srv.shutdown_timeout)
    state.draining = True
    await engine.drain(srv.shutdown_timeout)
    await runner.cleanup()
    state.preprocessor.shutdown()
    await engine.shutdown()
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
