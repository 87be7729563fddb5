"""The streamengine server: WebSocket streaming, OpenAI-compatible HTTP, metrics, chat page."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from streamengine.config import EngineConfig
from streamengine.server.app import create_app, drain
from streamengine.server.config import ServerConfig
from streamengine.server.security import check_exposure
from streamengine.server.tenancy import file_pins
from streamengine.server.tenants_file import TenantsFile, TenantsFileError

__all__ = ["ServerConfig", "create_app", "drain", "run_server"]

_CLEANUP_TIMEOUT_S = 10.0
"""After the drain, how long aiohttp waits for handlers that are still running."""


def run_server(config: EngineConfig, server: ServerConfig | None = None) -> None:
    """Loads the model, serves until SIGINT/SIGTERM, drains, then shuts down.

    Binds `server.host` (127.0.0.1 by default) and refuses (ValueError, before loading
    anything) a non-loopback address without a key unless `server.allow_unauthenticated`,
    and a tenants file whose pinned prompts are shorter than a block. Runs on uvloop when it
    is installed; the tenants file's tenants are registered and their prompts pinned before
    serving.
    """
    server = server if server is not None else ServerConfig()
    check_exposure(server.host, has_keys=server.has_keys, allow_unauthenticated=server.allow_unauthenticated)
    if server.shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {server.shutdown_timeout}")
    if server.tenants is not None:
        check_tenant_pins(config, server.tenants)
    from streamengine.engine.async_engine import AsyncEngine

    print(f"streamengine: loading {config.model or 'the default model (SmolLM2-135M-Instruct)'} ...", flush=True)
    engine = AsyncEngine(config)
    app = create_app(engine, server)
    _run(_serve(app, server.host, server.port, server.model_name or engine.model_name, server.shutdown_timeout))


def check_tenant_pins(config: EngineConfig, tenants: TenantsFile) -> None:
    """Refuses (TenantsFileError) a tenants file whose system prompt or shared prefix is
    shorter than one KV block, which cannot be pinned: checked with the model's tokenizer
    alone, before the weights load, so the server does not stop after a long load."""
    pins = [pin for pin in (tenants.shared_prefix, *tenants.system_prompts.values()) if pin is not None]
    if not pins:
        return
    from streamengine.models.loader import load_tokenizer

    tokenizer, _ = load_tokenizer(config.model, config.cache_dir)
    for ids, _, what in file_pins(tokenizer, tenants):
        if len(ids) < config.block_size:
            raise TenantsFileError(
                f"tenants file {tenants.path!r}: {what} is {len(ids)} tokens as the chat template renders "
                f"it, shorter than one KV block ({config.block_size} tokens): a pinned prefix needs at "
                "least one full block; lengthen it or leave it out")


async def _serve(app: web.Application, host: str, port: int, model_name: str, shutdown_timeout: float) -> None:
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=_CLEANUP_TIMEOUT_S)
    await runner.setup()
    try:
        stop, hurry = _signal_events()
        site = web.TCPSite(runner, host, port)
        await site.start()
        print(f"streamengine: serving {model_name} at {_url(host, port)}  (Ctrl+C to stop)", flush=True)
        await stop.wait()
        print(f"streamengine: draining: requests in flight get up to {shutdown_timeout:g} s "
              "(signal again to stop now) ...", flush=True)
        await drain(app, shutdown_timeout, hurry=hurry)
        print("streamengine: shutting down ...", flush=True)
    finally:
        await runner.cleanup()


def _signal_events() -> tuple[asyncio.Event, asyncio.Event]:
    """(first SIGINT/SIGTERM, second one): the second cuts the drain short."""
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # Windows
            loop.add_signal_handler(sig, on_signal)
    return stop, hurry


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("localhost" if host == "::" else host)
    if ":" in shown:
        shown = f"[{shown}]"
    suffix = " (listening on all interfaces)" if host in ("0.0.0.0", "::", "") else ""
    return f"http://{shown}:{port}/{suffix}"


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """Runs `coro` on uvloop when it is installed, else on asyncio's loop.

    The import is settled before anything runs: an ImportError raised by the program
    itself must propagate, not start the (already awaited) coroutine a second time.
    """
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)
