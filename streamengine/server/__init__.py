"""The streamengine server: WebSocket streaming, OpenAI-compatible HTTP, metrics, chat page."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

from streamengine.config import EngineConfig
from streamengine.server.app import create_app

__all__ = ["create_app", "run_server"]


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    max_prompt_tokens: int | None = None,
) -> None:
    """Loads the model, serves until SIGINT/SIGTERM, then shuts down gracefully.

    Binds 127.0.0.1 unless told otherwise; runs on uvloop when it is installed.
    """
    from streamengine.engine import AsyncEngine

    print(f"streamengine: loading {config.model or 'the default model (SmolLM2-135M-Instruct)'} ...", flush=True)
    engine = AsyncEngine(config)
    app = create_app(
        engine, api_key=api_key, allowed_origins=list(allowed_origins),
        max_prompt_tokens=max_prompt_tokens, model_name=engine.model_name,
    )
    _run(_serve(app, host, port, engine.model_name))


async def _serve(app, host: str, port: int, model_name: str) -> None:
    from aiohttp import web

    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=10.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        print(f"streamengine: serving {model_name} at {_url(host, port)}  (Ctrl+C to stop)", flush=True)
        await _until_signalled()
        print("streamengine: shutting down ...", flush=True)
    finally:
        await runner.cleanup()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # Windows
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("localhost" if host == "::" else host)
    if ":" in shown:
        shown = f"[{shown}]"
    suffix = " (listening on all interfaces)" if host in ("0.0.0.0", "::", "") else ""
    return f"http://{shown}:{port}/{suffix}"


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None and sys.platform != "win32":
        uvloop.run(coro)
    else:
        asyncio.run(coro)
