"""The HTTP middlewares, outermost first: the Host check, the Origin check (CORS preflight and
headers), error shaping, authentication (keys, tenants, admin routes) and admission (drain,
body size and read timeout)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from streamengine.server import openai
from streamengine.server.security import is_same_origin
from streamengine.server.state import (
    CLIENT,
    TENANT_KEY,
    ServerState,
    client_key,
    get_state,
)

log = logging.getLogger("streamengine.server.app")  # the server's log, as before the split

DRAIN_RETRY_AFTER_S = 5
"""Retry-After sent with the 503 of requests refused during a drain."""


_PUBLIC_PATHS = frozenset({"/", "/health", "/ready", "/favicon.ico", "/v1/stream"})
_PUBLIC_PREFIXES = ("/static/",)
# /v1/stream is "public" to the HTTP middleware only: the WebSocket checks the key itself,
# because browsers cannot put an Authorization header on a WebSocket handshake.
_VIEW = "shows every tenant's load and cache"
_LORA = "changes the LoRA adapters every tenant is served"
_ADMIN_PATHS = {"/metrics": _VIEW, "/v1/kv_state": _VIEW, "/v1/tenants": _VIEW,
                "/v1/load_lora_adapter": _LORA, "/v1/unload_lora_adapter": _LORA}
"""Views of the whole server (every tenant's load and cache) and changes to what it serves,
each with why: admin keys only, once keys exist."""
_PROBE_PATHS = frozenset({"/health", "/ready"})
# Orchestrators probe by pod IP (`Host: 10.x.y.z:8000`), a name no --allowed-host lists; these
# routes are public and reveal only the engine's state, so the Host check leaves them alone.
_CORS_METHODS = "GET, POST, OPTIONS"
_CORS_HEADERS = ("Authorization", "Content-Type")
_CORS_MAX_AGE_S = 600

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def hosts(request: web.Request, handler: Handler) -> web.StreamResponse:
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
async def origins(request: web.Request, handler: Handler) -> web.StreamResponse:
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


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
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
async def admission(request: web.Request, handler: Handler) -> web.StreamResponse:
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
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
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
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
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
    what = _ADMIN_PATHS[path]
    if state.keys.has_admin:
        why = f"{path} {what}: it needs an admin key (--admin-key)"
    else:
        why = (f"{path} {what}, so with API keys it is for admin keys only, and this server "
               "has none: start it with --admin-key (or STREAMENGINE_ADMIN_KEY) to use it")
    return openai.error_response(403, why, type_="permission_error", code="admin_required")


def _is_page(path: str) -> bool:
    return path == "/" or path.startswith(_PUBLIC_PREFIXES)


def _is_api(path: str) -> bool:
    return not _is_page(path) and path != "/v1/stream"
