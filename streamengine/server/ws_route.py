"""The WebSocket route (`/v1/stream`): the handshake's checks (origin, drain, the key offered
in the handshake, room under `max_connections` or `max_unauthenticated`), then one
websocket.Connection serving the socket until it closes."""

from __future__ import annotations

from aiohttp import web

from streamengine.server import protocol as p
from streamengine.server.security import Tenant, bearer_token
from streamengine.server.state import ServerState, get_state
from streamengine.server.streaming import limit_kernel_unsent
from streamengine.server.websocket import Connection

HARD_LIMIT_FACTOR = 4
"""aiohttp closes the socket (1009) above this multiple of `max_message_bytes`, so no frame can
balloon memory."""


async def stream_handler(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    if not state.origins.allows(request.headers.get("Origin"), request.headers.get("Host")):
        raise web.HTTPForbidden(text="WebSocket origin not allowed (see --allowed-origin)\n")
    if state.shutting_down:
        raise web.HTTPServiceUnavailable(text="server shutting down\n")
    tenant, offered_key = _handshake_tenant(state, request)
    if offered_key and tenant is None:
        raise web.HTTPUnauthorized(text="invalid API key\n")
    _check_room(state, authenticated=tenant is not None)
    ws = web.WebSocketResponse(
        protocols=(p.PROTOCOL_NAME,),
        max_msg_size=state.config.max_message_bytes * HARD_LIMIT_FACTOR,
        heartbeat=state.config.heartbeat_s or None,
    )
    conn = Connection(state, ws, tenant, request.transport, request.remote)
    # before the handshake's await, so concurrent ones count too
    state.connections.add(conn)
    if tenant is None:
        state.unauthenticated.add(conn)
    try:
        await ws.prepare(request)
        limit_kernel_unsent(request.transport)
        await conn.serve()
    finally:
        state.connections.discard(conn)
        state.unauthenticated.discard(conn)
    return ws


def _check_room(state: ServerState, *, authenticated: bool) -> None:
    """503 past the limit of the handshake's kind: sockets that proved a key count against
    `max_connections`, the others against `max_unauthenticated` until they authenticate."""
    waiting = len(state.unauthenticated)
    if authenticated and len(state.connections) - waiting >= state.config.max_connections:
        limit = f"at most {state.config.max_connections} WebSocket connections"
    elif not authenticated and waiting >= state.config.max_unauthenticated:
        limit = f"at most {state.config.max_unauthenticated} WebSocket connections waiting to authenticate"
    else:
        return
    raise web.HTTPServiceUnavailable(text=limit + "\n", headers={"Retry-After": "1"})


def _handshake_tenant(state: ServerState, request: web.Request) -> tuple[Tenant | None, bool]:
    """The tenant proven by the handshake itself, and whether a key was offered there."""
    if not state.keys.enabled:
        return state.keys.lookup(None), False
    key = _key_from_handshake(request)
    if key is None:
        return None, False
    return state.keys.lookup(key), True


def _key_from_handshake(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization")
    if auth:
        return bearer_token(auth) or ""
    for proto in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        proto = proto.strip()
        if proto.startswith(p.BEARER_PROTOCOL_PREFIX):
            return proto[len(p.BEARER_PROTOCOL_PREFIX) :]
    return None
