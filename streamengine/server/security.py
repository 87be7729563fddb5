"""API keys (one tenant each), per-tenant prefix-cache salts, and the WebSocket Origin check."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str  # "tenant-<8 hex>": safe to log, reveals nothing usable about the key
    cache_salt: str | None
    # May read the global views (/metrics, /v1/kv_state, WebSocket kv_state): with no keys
    # configured everyone may; with keys, only the holder of an admin key.
    is_admin: bool = False


ANONYMOUS = Tenant("anonymous", None, is_admin=True)


class KeyRing:
    """The accepted API keys. Each key is a tenant with its own prefix-cache salt, so one
    tenant's prompts can never produce prefix-cache hits (a timing side channel) for another."""

    def __init__(self, keys: str | Sequence[str] | None) -> None:
        if isinstance(keys, str):
            keys = [keys]
        keys = list(keys or [])
        for key in keys:
            if not isinstance(key, str) or not key or key != key.strip():
                raise ValueError("API keys must be non-empty strings without surrounding spaces")
        self._keys = [(key.encode(), _tenant_for(key)) for key in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def lookup(self, key: str | None) -> Tenant | None:
        """The tenant of `key`; ANONYMOUS when no keys are configured; None when refused."""
        if not self._keys:
            return ANONYMOUS
        if not key:
            return None
        candidate = key.encode()
        found = None
        for secret, tenant in self._keys:
            # compare against every key in constant time, so timing reveals nothing
            if hmac.compare_digest(candidate, secret):
                found = tenant
        return found

    def from_request(self, request: web.BaseRequest) -> Tenant | None:
        return self.lookup(bearer_token(request.headers.get("Authorization")))


def _tenant_for(key: str) -> Tenant:
    digest = hashlib.sha256(b"streamengine-tenant\0" + key.encode()).hexdigest()
    return Tenant(name=f"tenant-{digest[:8]}", cache_salt=digest)


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class OriginPolicy:
    """Which browser origins may open the WebSocket.

    No Origin header: not a browser (browsers always send one on WebSocket handshakes), so
    allowed; API-key auth still applies. Otherwise the origin must be listed, or `*` listed,
    or (the default) be this very server: its host:port equals the Host header.
    """

    def __init__(self, allowed: Iterable[str]) -> None:
        allowed = list(allowed)
        self._any = "*" in allowed
        self._allowed = {normalize_origin(o) for o in allowed if o != "*"}

    def allows(self, origin: str | None, host: str | None) -> bool:
        if origin is None:
            return True
        if self._any:
            return True
        normalized = normalize_origin(origin)
        if normalized in self._allowed:
            return True
        return host is not None and _host_port(normalized) == _default_port(host.lower(), normalized)


def normalize_origin(origin: str) -> str:
    """`HTTP://Example.com:80/` -> `http://example.com` (scheme://host[:port], default ports dropped)."""
    parts = urlsplit(origin.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"  # IPv6 literal
    try:
        port = parts.port
    except ValueError:
        return origin.strip().lower()
    if port is None or (scheme, port) in (("http", 80), ("https", 443)):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def _host_port(normalized_origin: str) -> str:
    return normalized_origin.partition("://")[2]


def _default_port(host: str, normalized_origin: str) -> str:
    # The Host header omits default ports just like the normalized origin does.
    scheme = normalized_origin.partition("://")[0]
    for suffix in ((":80",) if scheme == "http" else (":443",) if scheme == "https" else ()):
        if host.endswith(suffix):
            return host[: -len(suffix)]
    return host
