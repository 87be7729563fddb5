"""The aiohttp app factory: routes, auth and error middlewares, engine lifespan, shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import WSCloseCode, web
from prometheus_client import CONTENT_TYPE_LATEST

from streamengine.server import openai, protocol
from streamengine.server.metrics import ServerMetrics
from streamengine.server.security import KeyRing, OriginPolicy
from streamengine.server.state import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_PENDING_BYTES,
    STATE_KEY,
    TENANT_KEY,
    ServerState,
    get_state,
)
from streamengine.server.websocket import stream_handler

log = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parents[2] / "web"
"""The chat page (plain files, no build step), at the repository root next to the package."""

_PUBLIC_PATHS = frozenset({"/", "/health", "/favicon.ico", "/v1/stream"})
_PUBLIC_PREFIXES = ("/static/",)
# /v1/stream is "public" to the HTTP middleware only: the WebSocket checks the key itself,
# because browsers cannot put an Authorization header on a WebSocket handshake.

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    engine: Any,
    *,
    api_key: str | Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    max_prompt_tokens: int | None = None,
    model_name: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    request_timeout: float | None = None,
    web_dir: Path | str | None = None,
) -> web.Application:
    """The server for `engine` (an `AsyncEngine`), started and stopped with the app.

    `api_key`: one key or several (each its own tenant with its own prefix-cache salt);
    None = no auth. `allowed_origins`: extra browser origins allowed to open the WebSocket
    (`*` = any); the server's own origin is always allowed. `max_prompt_tokens`: prompts
    longer than this are refused with a structured error. `model_name`: the id reported by
    /v1/models and required (when given) in OpenAI requests; default `engine.model_name`.
    """
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1 or None, got {max_prompt_tokens}")
    if max_message_bytes < 1 or max_body_bytes < 1:
        raise ValueError("max_message_bytes and max_body_bytes must be >= 1")
    state = ServerState(
        engine=engine,
        model_name=model_name or engine.model_name,
        keys=KeyRing(api_key),
        origins=OriginPolicy(allowed_origins),
        max_prompt_tokens=max_prompt_tokens,
        metrics=ServerMetrics(engine.stats),
        max_message_bytes=max_message_bytes,
        max_pending_bytes=max_pending_bytes,
        max_connections=max_connections,
        heartbeat_s=heartbeat_s,
        request_timeout=request_timeout,
    )
    app = web.Application(middlewares=[_errors, _auth], client_max_size=max_body_bytes)
    app[STATE_KEY] = state
    app.cleanup_ctx.append(_engine_lifespan)
    app.on_shutdown.append(_on_shutdown)
    _add_routes(app, Path(web_dir) if web_dir is not None else WEB_DIR)
    return app


def _add_routes(app: web.Application, web_dir: Path) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/stream", stream_handler)
    app.router.add_get("/v1/kv_state", kv_state)
    openai.add_routes(app)
    if (web_dir / "index.html").is_file():
        index = web_dir / "index.html"

        async def page(_: web.Request) -> web.FileResponse:
            return web.FileResponse(index, headers={"Cache-Control": "no-cache"})

        app.router.add_get("/", page)
        app.router.add_static("/static/", web_dir)


# ---- lifespan -------------------------------------------------------------------------------


async def _engine_lifespan(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    engine = state.engine
    # An engine the caller already started stays theirs to stop.
    owned = not engine.is_running
    if owned:
        await engine.start()
    try:
        yield
    finally:
        state.close()
        if owned:
            await engine.stop()


async def _on_shutdown(app: web.Application) -> None:
    """Runs before aiohttp waits for handlers: end every stream so that wait is short."""
    state = app[STATE_KEY]
    state.shutting_down = True
    for request_id in list(state.http_requests):
        await state.engine.abort(request_id)
    closing = [c.close(WSCloseCode.GOING_AWAY, "server shutting down") for c in list(state.connections)]
    await asyncio.gather(*closing, return_exceptions=True)


# ---- middlewares ----------------------------------------------------------------------------


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every API error in OpenAI's shape; the static page keeps aiohttp's plain errors."""
    try:
        return await handler(request)
    except openai.OpenAIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400 or _is_page(request.path):
            raise
        return openai.http_exception_response(exc)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return openai.error_response(500, "internal server error", type_="server_error")


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = get_state(request)
    if request.path in _PUBLIC_PATHS or request.path.startswith(_PUBLIC_PREFIXES):
        return await handler(request)
    tenant = state.keys.from_request(request)
    if tenant is None:
        return openai.error_response(
            401, "missing or invalid API key: send `Authorization: Bearer <key>`",
            type_="authentication_error", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    request[TENANT_KEY] = tenant
    return await handler(request)


def _is_page(path: str) -> bool:
    return path == "/" or path.startswith(_PUBLIC_PREFIXES)


# ---- small routes ---------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    state = get_state(request)
    running = state.engine.is_running and not state.shutting_down
    body = {"status": "ok" if running else "unavailable", "auth_required": state.keys.enabled}
    return web.json_response(body, status=200 if running else 503)


async def metrics(request: web.Request) -> web.Response:
    body = get_state(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def kv_state(request: web.Request) -> web.Response:
    state = get_state(request)
    message = protocol.kv_state_message(state.engine.kv_state())
    return web.Response(body=msgspec.json.encode(message), content_type="application/json")
