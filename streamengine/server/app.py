"""The aiohttp app factory: routes; the Host, Origin/CORS, drain, auth and error middlewares;
liveness and readiness; engine lifespan; the graceful drain and the shutdown behind it.

Middlewares, outermost first: the Host check (DNS rebinding), the Origin check and CORS
preflights, errors in OpenAI's shape, the API key and admin check, then admission (refused
while draining; reads the body within the body timeout, then counts the request in flight).
CORS response headers are added just before any response is sent (`on_response_prepare`), so
streamed and error responses carry them too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import WSCloseCode, web
from prometheus_client import CONTENT_TYPE_LATEST

from streamengine.server import openai, protocol
from streamengine.server.config import ServerConfig
from streamengine.server.metrics import ServerMetrics
from streamengine.server.middlewares import admission, auth, cors_headers, errors, hosts, origins
from streamengine.server.security import HostPolicy, KeyRing, OriginPolicy
from streamengine.server.state import (
    STATE_KEY,
    ServerState,
    get_state,
)
from streamengine.server.tenancy import apply_tenants_file, tenants_route
from streamengine.server.ws_route import stream_handler
from streamengine.structured.tool_calls import get_tool_parser

if TYPE_CHECKING:
    from streamengine.engine.client import EngineClient

log = logging.getLogger(__name__)

WEB_DIR = Path(str(resources.files("streamengine.web").joinpath("index.html"))).parent
"""The chat page (plain files, no build step): web/ of the repository, installed as the package
data `streamengine.web` (see pyproject.toml), so an installed package serves it too."""

_ABORT_GRACE_S = 5.0
"""After aborting, how long a drain waits for handlers to send their last bytes."""
CLIENT_WATCH_S = 0.2
"""How often the server looks for HTTP clients that left while their request was in flight."""

def create_app(engine: EngineClient, config: ServerConfig | None = None) -> web.Application:
    """The server for `engine` as `config` sets it (default: ServerConfig()), started and
    stopped with the app (unless already running). Refuses (ValueError) a bound out of range
    or an unknown tool parser before serving anything."""
    c = config if config is not None else ServerConfig()
    _check_options(c.max_prompt_tokens, c.max_message_bytes, c.max_body_bytes, c.stall_timeout)
    _check_bounds(max_connections=c.max_connections, max_unauthenticated=c.max_unauthenticated,
                  auth_timeout=c.auth_timeout, idle_timeout=c.idle_timeout, body_timeout=c.body_timeout,
                  write_timeout=c.write_timeout)
    get_tool_parser(c.tool_parser)  # an unknown name fails here, not in the first request
    state = ServerState(
        engine=engine,
        config=c,
        model_name=c.model_name or engine.model_name,
        keys=KeyRing(c.api_key, c.admin_keys, c.tenants.keys if c.tenants is not None else ()),
        origins=OriginPolicy(c.allowed_origins),
        metrics=ServerMetrics(engine.stats),
        hosts=HostPolicy(c.answered_hosts()),
    )
    web_dir = Path(c.web_dir) if c.web_dir is not None else WEB_DIR
    return _build_app(state, c.max_body_bytes, web_dir, c.idle_timeout)


def _check_options(max_prompt_tokens: int | None, max_message_bytes: int, max_body_bytes: int,
                   stall_timeout: float) -> None:
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1 or None, got {max_prompt_tokens}")
    if max_message_bytes < 1 or max_body_bytes < 1:
        raise ValueError("max_message_bytes and max_body_bytes must be >= 1")
    if not stall_timeout > 0:
        raise ValueError(f"stall_timeout must be > 0 seconds, got {stall_timeout}")


def _check_bounds(*, max_connections: int, max_unauthenticated: int, **timeouts: float) -> None:
    if max_connections < 1 or max_unauthenticated < 0:
        raise ValueError("max_connections must be >= 1 and max_unauthenticated >= 0")
    for name, seconds in timeouts.items():
        if not seconds > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {seconds}")


def _build_app(state: ServerState, max_body_bytes: int, web_dir: Path, idle_timeout: float) -> web.Application:
    app = web.Application(
        middlewares=[hosts, origins, errors, auth, admission], client_max_size=max_body_bytes,
        # aiohttp closes a connection whose handler waits for a request head past its keep-alive
        # timeout, counted from the connection's opening and from each response: the bound on
        # idle connections and on heads sent a byte at a time (slowloris) alike.
        handler_args={"keepalive_timeout": idle_timeout},
    )
    app[STATE_KEY] = state
    app.cleanup_ctx.append(_engine_lifespan)
    app.on_shutdown.append(_on_shutdown)
    app.on_response_prepare.append(cors_headers)
    _add_routes(app, web_dir)
    return app


def _add_routes(app: web.Application, web_dir: Path) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/stream", stream_handler)
    app.router.add_get("/v1/kv_state", kv_state)
    app.router.add_get("/v1/tenants", tenants_route)
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
    watch = asyncio.create_task(watch_http_clients(state), name="http-client-watch")
    try:
        if state.config.tenants is not None:
            await apply_tenants_file(engine, state.config.tenants)
        yield
    finally:
        watch.cancel()
        await asyncio.wait({watch})
        state.close()
        if owned:
            await engine.stop()


async def watch_http_clients(state: ServerState) -> None:
    """Aborts the engine request of every HTTP client that has left. aiohttp does not cancel a
    handler whose client leaves (the server runs without handler_cancellation), and a handler
    writes nothing before its first output, which may be long in coming (queued behind a full
    batch, a long prefill): unwatched, a request whose client gave up (a timeout, a retry)
    stays queued and is then computed for no one. One task for all requests, not one each: a
    poll per request would wake the loop thousands of times a second under load. A request
    keeps being aborted each tick until its handler ends: one still compiling its grammar is
    not in the engine yet, and the abort of an unknown or ended request does nothing."""
    while True:
        await asyncio.sleep(CLIENT_WATCH_S)
        for request_id, client_gone in list(state.http_requests.items()):
            try:
                if client_gone():
                    await state.engine.abort(request_id)
            except Exception:  # one request's failure must not end the watch of all the others
                log.exception("aborting HTTP request %s whose client left", request_id)


async def _on_shutdown(app: web.Application) -> None:
    """Runs before aiohttp waits for handlers: end every stream so that wait is short.
    After a `drain` nothing is left to end; without one (tests, embedders) this is the drain
    with no grace period."""
    state = app[STATE_KEY]
    state.shutting_down = True
    await _abort_all(state)


async def drain(app: web.Application, timeout: float, *, hurry: asyncio.Event | None = None) -> None:
    """Stops admission, lets requests in flight finish for up to `timeout` seconds (less if
    `hurry` is set), then aborts the rest and closes every WebSocket with 1001.

    New OpenAI POSTs get 503 with Retry-After from the moment it starts, and /ready says
    "draining", so a load balancer sends new work elsewhere. Stopping the engine and the
    listener is left to the app's cleanup, which follows.
    """
    state = app[STATE_KEY]
    state.shutting_down = True
    if not await _wait_quiet(state, timeout, hurry):
        log.warning("drain: %s still in flight after %.1f s; aborting them", _in_flight(state), timeout)
    await _abort_all(state)
    await _abort_stragglers(state, _ABORT_GRACE_S)


def _in_flight(state: ServerState) -> str:
    ws = sum(len(conn.live) for conn in state.connections)
    return f"{state.http_in_flight} HTTP and {ws} WebSocket requests"


def _busy(state: ServerState) -> bool:
    return state.http_in_flight > 0 or any(conn.live for conn in state.connections)


async def _wait_quiet(state: ServerState, timeout: float, hurry: asyncio.Event | None) -> bool:
    """True once nothing is in flight; False at the deadline or when `hurry` is set."""
    deadline = asyncio.get_running_loop().time() + timeout
    # Polling, because requests end in three places (HTTP handlers, WebSocket tasks, aborts);
    # a 20 ms tick costs nothing next to a drain of seconds.
    while _busy(state):
        if asyncio.get_running_loop().time() >= deadline or (hurry is not None and hurry.is_set()):
            return False
        await asyncio.sleep(0.02)
    return True


async def _abort_all(state: ServerState) -> None:
    # An aborted HTTP request ends with finish_reason "abort"; a WebSocket gets a
    # `shutting_down` error for each of its requests, aborted and their blocks freed, then is
    # closed with 1001 "server shutting down".
    for request_id in list(state.http_requests):
        await state.engine.abort(request_id)
    cut = (protocol.SHUTTING_DOWN, "the server is shutting down: this request was aborted")
    closing = [c.close(WSCloseCode.GOING_AWAY, "server shutting down", request_error=cut)
               for c in list(state.connections)]
    await asyncio.gather(*closing, return_exceptions=True)


async def _abort_stragglers(state: ServerState, grace: float) -> None:
    """Waits up to `grace` for the aborted handlers to send their last bytes, aborting any
    HTTP request that reached the engine only after the cut. Every tick aborts every HTTP
    request still in flight, not only those that were not there at the cut: one that was
    there but still compiling its grammar was not in the engine yet, so its first abort
    found nothing (aborting an ended request is a no-op)."""
    deadline = asyncio.get_running_loop().time() + grace
    while _busy(state) and asyncio.get_running_loop().time() < deadline:
        for request_id in list(state.http_requests):
            await state.engine.abort(request_id)
        await asyncio.sleep(0.02)


# ---- small routes ---------------------------------------------------------------------------


def readiness(state: ServerState, health: dict[str, Any]) -> tuple[str, str | None]:
    """("ready", None), or why this server should get no new work now."""
    if state.shutting_down:
        return "draining", "server shutting down: finishing the requests in flight, admitting none"
    engine_state = health.get("state", "stopped")
    if engine_state != "ready":
        detail = health.get("reason")
        return engine_state, f"engine {engine_state}" + (f": {detail}" if detail else "")
    stalled_s = float(health.get("seconds_since_progress") or 0.0)
    num_requests = int(health.get("num_requests") or 0)
    if num_requests and stalled_s > state.config.stall_timeout:
        return "stalled", (f"engine holds {num_requests} requests but made no progress for "
                           f"{stalled_s:.0f} s (--stall-timeout {state.config.stall_timeout:g} s)")
    return "ready", None


async def health(request: web.Request) -> web.Response:
    """Liveness: answered by the event loop alone, so a busy engine does not fail it; 503 only
    when the engine stopped for good outside a drain (restarting the process is the cure)."""
    state = get_state(request)
    h = state.engine.health()
    dead = h.get("state") == "stopped" and not state.shutting_down
    body = {
        "status": "dead" if dead else "ok",
        "engine": h.get("state"),
        "reason": h.get("reason"),
        "draining": state.shutting_down,
        "auth_required": state.keys.enabled,  # the chat page asks for a key when true
    }
    return web.json_response(body, status=503 if dead else 200)


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 only when new requests would be served now."""
    state = get_state(request)
    h = state.engine.health()
    status, reason = readiness(state, h)
    body = {"status": status, "reason": reason, "engine": h.get("state")}
    return web.json_response(body, status=200 if status == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    body = get_state(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def kv_state(request: web.Request) -> web.Response:
    state = get_state(request)
    message = protocol.kv_state_message(state.engine.kv_state())
    return web.Response(body=msgspec.json.encode(message), content_type="application/json")
