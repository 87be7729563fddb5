"""The streamengine server: WebSocket streaming, OpenAI-compatible HTTP, metrics, chat page."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine, Sequence
from typing import Any

from aiohttp import web

from streamengine.config import EngineConfig
from streamengine.server.app import create_app, drain
from streamengine.server.security import check_exposure, hosts_for_bind
from streamengine.server.state import (
    DEFAULT_AUTH_TIMEOUT_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_UNAUTHENTICATED,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    DEFAULT_TOOL_PARSER,
    DEFAULT_WRITE_TIMEOUT_S,
)
from streamengine.server.tenancy import file_pins
from streamengine.server.tenants_file import TenantsFile, TenantsFileError

__all__ = ["app_options", "create_app", "drain", "run_server"]

_CLEANUP_TIMEOUT_S = 10.0
"""After the drain, how long aiohttp waits for handlers that are still running."""


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    max_prompt_tokens: int | None = None,
    *,
    admin_keys: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
    allow_unauthenticated: bool = False,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    request_timeout: float | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    tenants: TenantsFile | None = None,
    tool_parser: str = DEFAULT_TOOL_PARSER,
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
    auth_timeout: float = DEFAULT_AUTH_TIMEOUT_S,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_S,
) -> None:
    """Loads the model, serves until SIGINT/SIGTERM, drains, then shuts down.

    Binds 127.0.0.1 unless told otherwise, and refuses (ValueError, before loading anything)
    a non-loopback address without a key unless `allow_unauthenticated`. The Host names
    answered are the loopback ones, `host` itself when it is a specific address, and
    `allowed_hosts`; on a wildcard address with no `allowed_hosts`, any. Runs on uvloop when
    it is installed. `tenants` (a parsed `--tenants` file): keys that run requests as their
    tenant, registered with the engine and their prompts pinned before serving. `tool_parser`
    reads tool calls out of outputs with tool_choice "auto" (tool_calls.TOOL_PARSERS). The
    connection bounds and timeouts are create_app's (see docs/operations.md).
    """
    has_keys = bool(api_key) or bool(admin_keys) or bool(tenants is not None and tenants.keys)
    check_exposure(host, has_keys=has_keys, allow_unauthenticated=allow_unauthenticated)
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
    if tenants is not None:
        check_tenant_pins(config, tenants)
    from streamengine.engine.async_engine import AsyncEngine

    print(f"streamengine: loading {config.model or 'the default model (SmolLM2-135M-Instruct)'} ...", flush=True)
    engine = AsyncEngine(config)
    app = create_app(engine, model_name=engine.model_name, **app_options(
        host, api_key=api_key, admin_keys=admin_keys, allowed_origins=allowed_origins,
        allowed_hosts=allowed_hosts, max_prompt_tokens=max_prompt_tokens, stall_timeout=stall_timeout,
        request_timeout=request_timeout, max_connections=max_connections, tenants=tenants,
        tool_parser=tool_parser, max_unauthenticated=max_unauthenticated, auth_timeout=auth_timeout,
        idle_timeout=idle_timeout, body_timeout=body_timeout, write_timeout=write_timeout,
    ))
    _run(_serve(app, host, port, engine.model_name, shutdown_timeout))


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


def app_options(
    host: str, *, api_key: str | Sequence[str] | None, admin_keys: Sequence[str],
    allowed_origins: Sequence[str], allowed_hosts: Sequence[str], max_prompt_tokens: int | None,
    stall_timeout: float, request_timeout: float | None, max_connections: int,
    tenants: TenantsFile | None, tool_parser: str, max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
    auth_timeout: float = DEFAULT_AUTH_TIMEOUT_S, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S, write_timeout: float = DEFAULT_WRITE_TIMEOUT_S,
) -> dict[str, Any]:
    """`create_app`'s keyword arguments for a server bound to `host` (the Host names it
    answers follow from the bind address): shared by this server and the Ray ingress."""
    return {
        "api_key": api_key, "admin_keys": list(admin_keys), "allowed_origins": list(allowed_origins),
        "allowed_hosts": hosts_for_bind(host, list(allowed_hosts)), "max_prompt_tokens": max_prompt_tokens,
        "stall_timeout": stall_timeout, "request_timeout": request_timeout,
        "max_connections": max_connections, "tenants": tenants, "tool_parser": tool_parser,
        "max_unauthenticated": max_unauthenticated, "auth_timeout": auth_timeout, "idle_timeout": idle_timeout,
        "body_timeout": body_timeout, "write_timeout": write_timeout,
    }


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
