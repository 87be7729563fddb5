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
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import WSCloseCode, web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST

from streamengine.server import openai, protocol
from streamengine.server.config import ServerConfig
from streamengine.server.metrics import ServerMetrics
from streamengine.server.security import HostPolicy, KeyRing, OriginPolicy, is_same_origin
from streamengine.server.state import (
    CLIENT,
    DRAIN_RETRY_AFTER_S,
    STATE_KEY,
    TENANT_KEY,
    ServerState,
    client_key,
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

_PUBLIC_PATHS = frozenset({"/", "/health", "/ready", "/favicon.ico", "/v1/stream"})
_PUBLIC_PREFIXES = ("/static/",)
# /v1/stream is "public" to the HTTP middleware only: the WebSocket checks the key itself,
# because browsers cannot put an Authorization header on a WebSocket handshake.
_ADMIN_PATHS = frozenset({"/metrics", "/v1/kv_state", "/v1/tenants"})
"""Views of the whole server (every tenant's load and cache): admin keys only, once keys exist."""
_PROBE_PATHS = frozenset({"/health", "/ready"})
# Orchestrators probe by pod IP (`Host: 10.x.y.z:8000`), a name no --allowed-host lists; these
# routes are public and reveal only the engine's state, so the Host check leaves them alone.
_CORS_METHODS = "GET, POST, OPTIONS"
_CORS_HEADERS = ("Authorization", "Content-Type")
_CORS_MAX_AGE_S = 600
_ABORT_GRACE_S = 5.0
"""After aborting, how long a drain waits for handlers to send their last bytes."""
CLIENT_WATCH_S = 0.2
"""How often the server looks for HTTP clients that left while their request was in flight."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
        middlewares=[_hosts, _origins, _errors, _auth, _admission], client_max_size=max_body_bytes,
        # aiohttp closes a connection whose handler waits for a request head past its keep-alive
        # timeout, counted from the connection's opening and from each response: the bound on
        # idle connections and on heads sent a byte at a time (slowloris) alike.
        handler_args={"keepalive_timeout": idle_timeout},
    )
    app[STATE_KEY] = state
    app.cleanup_ctx.append(_engine_lifespan)
    app.on_shutdown.append(_on_shutdown)
    app.on_response_prepare.append(_cors_headers)
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


# ---- middlewares ----------------------------------------------------------------------------


@web.middleware
async def _hosts(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answers only the names this server has (see HostPolicy): the DNS-rebinding guard."""
    host = request.headers.get("Host")
    if request.path in _PROBE_PATHS or get_state(request).hosts.allows(host):
        return await handler(request)
    return openai.error_response(
        421, f"this server does not answer to the host name {host!r}; "
        "start it with --allowed-host NAME to add a name it may be reached by",
        type_="invalid_request_error", code="host_not_allowed",
    )


@web.middleware
async def _origins(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Browsers send Origin on cross-site requests: refuse other sites (a plain `text/plain`
    POST needs no preflight, so without this any page could run completions here), and
    answer CORS preflights for the allowed ones. Not for the page, nor the WebSocket,
    whose handler applies the same policy itself."""
    origin = request.headers.get("Origin")
    if origin is None or not _is_api(request.path):
        return await handler(request)
    if not get_state(request).origins.allows(origin, request.headers.get("Host")):
        return openai.error_response(
            403, f"requests from the browser origin {origin!r} are not allowed; "
            "start the server with --allowed-origin ORIGIN to allow it",
            type_="permission_error", code="origin_not_allowed",
        )
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        return _preflight(request)
    return await handler(request)


def _preflight(request: web.Request) -> web.Response:
    # The origin is trusted by now, so any header it asks for may be sent (OpenAI's browser
    # client adds its own `x-stainless-*` headers).
    asked = request.headers.get("Access-Control-Request-Headers", "")
    headers = list(_CORS_HEADERS) + [h.strip() for h in asked.split(",") if h.strip().isascii() and h.strip()]
    return web.Response(status=204, headers={
        "Access-Control-Allow-Methods": _CORS_METHODS,
        "Access-Control-Allow-Headers": ", ".join(dict.fromkeys(headers)),
        "Access-Control-Max-Age": str(_CORS_MAX_AGE_S),
    })


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Lets an allowed cross-origin page read the response (same-origin ones need nothing)."""
    origin = request.headers.get("Origin")
    if origin is None or not _is_api(request.path):
        return
    state = get_state(request)
    host = request.headers.get("Host")
    if is_same_origin(origin, host) or not state.origins.allows(origin, host):
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = "Retry-After"
    vary = response.headers.get("Vary")
    response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"


@web.middleware
async def _admission(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuses new work while draining; reads the body within the body timeout, and only then
    counts the request as work in flight that a drain waits for: a body sent slowly, or never
    finished, holds no drain up."""
    if request.method != "POST" or not request.path.startswith("/v1/"):
        return await handler(request)
    state = get_state(request)
    if state.shutting_down:
        return _draining()
    try:
        await read_body(request, state.config.body_timeout)  # kept by aiohttp: the handler's read() returns it
    except openai.OpenAIError as exc:
        return await _refuse_body(request, exc)
    if state.shutting_down:  # the drain began while the body came in
        return _draining()
    state.http_in_flight += 1
    try:
        return await handler(request)
    finally:
        state.http_in_flight -= 1


async def _refuse_body(request: web.Request, error: openai.OpenAIError) -> web.Response:
    """Sends `error` and closes the connection: what is left of a body that cannot be used is
    not worth waiting for (aiohttp would otherwise read on for its lingering time, and log a
    body that failed to decode as an unhandled error)."""
    response = error.response()
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()  # the bytes written are flushed before the socket closes
    return response


def _draining() -> web.Response:
    return openai.error_response(
        503, "server shutting down: not accepting new requests", type_="server_error",
        code="shutting_down", headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
    )


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The whole body, within `timeout` seconds (408 past it, and the connection is closed);
    a body its Content-Encoding cannot decode is the client's error (400), not the server's."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise openai.OpenAIError(408, f"the request body did not arrive within {timeout:g} s",
                                 code="body_timeout") from None
    except RequestPayloadError as exc:  # a body marked gzip or deflate that is not
        why = getattr(exc.__cause__, "message", None) or "it is not what its headers say"
        raise openai.OpenAIError(400, f"cannot read the request body: {why}", code="invalid_body") from None


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
    CLIENT.set(client_key(tenant, request.remote))  # this request's task only
    if request.path in _ADMIN_PATHS and not tenant.is_admin:
        return _admin_required(state, request.path)
    return await handler(request)


def _admin_required(state: ServerState, path: str) -> web.Response:
    if state.keys.has_admin:
        why = f"{path} shows every tenant's load and cache: it needs an admin key (--admin-key)"
    else:
        why = (f"{path} shows every tenant's load and cache, so with API keys it is for admin "
               "keys only, and this server has none: start it with --admin-key "
               "(or STREAMENGINE_ADMIN_KEY) to read it")
    return openai.error_response(403, why, type_="permission_error", code="admin_required")


def _is_page(path: str) -> bool:
    return path == "/" or path.startswith(_PUBLIC_PREFIXES)


def _is_api(path: str) -> bool:
    return not _is_page(path) and path != "/v1/stream"


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
