"""Who may talk to the server: API keys (each with its own prefix-cache salt; admin keys also
read the global views; a tenants file's keys run as their tenant), the Host check against DNS
rebinding, the Origin check for browsers, and the refusal to serve a non-loopback address
without a key."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from streamengine.server.tenants_file import TenantKey


@dataclass(slots=True, frozen=True)
class Tenant:
    """Who sent a request: the engine tenant it runs as and the salt of its private blocks."""

    name: str  # the engine tenant's name: "key-<16 hex>" for an --api-key key (a hash: reveals nothing usable)
    cache_salt: str | None  # of requests that name no user; None: the engine tenant's own salt
    # May read the global views (/metrics, /v1/kv_state, /v1/tenants, WebSocket kv_state) and
    # load and unload LoRA adapters: with no keys configured everyone may; with keys, only the
    # holder of an admin key.
    is_admin: bool = False
    engine_tenant: str | None = None  # None: the engine's default tenant
    user_salt_key: str = ""  # keys the hash of per-user salts: secret, never sent to a client

    def salt_for(self, user: str | None) -> str | None:
        """The cache salt of a request made for `user` (OpenAI's `user` field): one user's
        blocks after the tenant's pinned prefixes are then never hits for another user, so
        `cached_tokens` cannot tell a user what the others asked. Hashed with a secret of the
        tenant, so no one can choose a user name that lands on another tenant's salt."""
        if not user:
            return self.cache_salt
        return hmac.new(self.user_salt_key.encode(), user.encode(), hashlib.sha256).hexdigest()


ANONYMOUS = Tenant("anonymous", None, is_admin=True, user_salt_key="anonymous")


class KeyRing:
    """The accepted API keys. Each --api-key key is an engine tenant of its own (named
    "key-<16 hex>", from a hash of the key): its own fair share, quotas and rate (a tenants
    file's `default` entry gives each such tenant its settings), and its own prefix-cache salt,
    so one key's prompts can never produce prefix-cache hits (a timing side channel) for
    another, nor one key's traffic take the others' share. An admin key ("admin-<16 hex>") is
    such a key too, one that may also read the global views. A tenants file's keys run as
    their tenant, with that tenant's salt."""

    def __init__(self, keys: str | Sequence[str] | None, admin_keys: str | Sequence[str] | None = None,
                 tenant_keys: Sequence[TenantKey] = ()) -> None:
        keys, admin = _key_list(keys), _key_list(admin_keys)
        # Keyed by the key's SHA-256: a lookup hashes the presented key once and finds its
        # tenant in one dict probe, however many keys there are. Timing reveals nothing: the
        # probe compares digests, which a client can neither choose nor learn.
        self._by_digest: dict[bytes, Tenant] = {}
        # a key listed as both is an admin key: the stronger grant is the one meant
        for key in keys:
            if key not in admin:
                self._by_digest[_digest(key)] = _tenant_for(key, is_admin=False)
        for key in admin:
            self._by_digest[_digest(key)] = _tenant_for(key, is_admin=True)
        for key in tenant_keys:
            if key.digest in self._by_digest:
                raise ValueError(f"tenant {key.tenant!r} has a key also given with --api-key or --admin-key")
            self._by_digest[key.digest] = Tenant(key.tenant, None, engine_tenant=key.tenant, user_salt_key=key.salt)
        self.has_admin = bool(admin)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def lookup(self, key: str | None) -> Tenant | None:
        """The tenant of `key`; ANONYMOUS when no keys are configured; None when refused."""
        if not self._by_digest:
            return ANONYMOUS
        if not key:
            return None
        return self._by_digest.get(_digest(key))

    def from_request(self, request: web.BaseRequest) -> Tenant | None:
        return self.lookup(bearer_token(request.headers.get("Authorization")))


def _key_list(keys: str | Sequence[str] | None) -> list[str]:
    keys = [keys] if isinstance(keys, str) else list(keys or [])
    for key in keys:
        if not isinstance(key, str) or not key or key != key.strip():
            raise ValueError("API keys must be non-empty strings without surrounding spaces")
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _tenant_for(key: str, *, is_admin: bool) -> Tenant:
    """An --api-key (or --admin-key) key's engine tenant. 64 bits of the name: 20,000 keys
    share a name with odds of about 1 in 10^11 (32 bits made that 1 in 20)."""
    digest = hashlib.sha256(b"streamengine-tenant\0" + key.encode()).hexdigest()
    name = f"{'admin' if is_admin else 'key'}-{digest[:16]}"
    return Tenant(name=name, cache_salt=digest, is_admin=is_admin, engine_tenant=name, user_salt_key=digest)


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class OriginPolicy:
    """Which browser origins may call the API and open the WebSocket.

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
        return normalize_origin(origin) in self._allowed or is_same_origin(origin, host)


def is_same_origin(origin: str, host: str | None) -> bool:
    """The page making the request was served by this very server (host:port equal)."""
    normalized = normalize_origin(origin)
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


# ---- Host: DNS rebinding ----------------------------------------------------------------------

LOOPBACK_HOSTS = ("localhost", "*.localhost", "127.0.0.1", "[::1]")
"""Always accepted: a browser only sends these for a page that is itself on this machine."""

_HOST_NAME = re.compile(r"^(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$|^\[[0-9a-f:.]+\]$")


class HostPolicy:
    """Which names the server answers to (the Host header, port ignored).

    Why: a page on attacker.example can re-point its own name at 127.0.0.1 (DNS rebinding);
    the browser then treats this server as same-origin with the attacker's page, but still
    sends `Host: attacker.example`. Answering only the names the server really has closes
    that door. Loopback names are always allowed; `*.example.com` matches subdomains; `*`
    matches any name. No Host header at all (HTTP/1.0 tools) is not a browser: allowed.
    """

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        names = [normalize_host(strip_port(n)) for n in allowed]
        self.any = "*" in names
        names = [n for n in names if n != "*"]
        for name in names:
            if not _HOST_NAME.match(name):
                raise ValueError(f"not a host name or address: {name!r} (--allowed-host)")
        names += LOOPBACK_HOSTS
        self._exact = frozenset(n for n in names if not n.startswith("*."))
        self._suffixes = tuple(n[1:] for n in names if n.startswith("*."))  # ".example.com"

    def allows(self, host_header: str | None) -> bool:
        if host_header is None or self.any:
            return True
        name = normalize_host(strip_port(host_header))
        return name in self._exact or name.endswith(self._suffixes)


def strip_port(host_header: str) -> str:
    """`example.com:8000` -> `example.com`; `[::1]:8000` -> `[::1]`."""
    host = host_header.strip()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def normalize_host(name: str) -> str:
    """Lower case, no trailing dot, IPv6 literals in brackets (as they appear in Host)."""
    name = name.strip().lower().rstrip(".")
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return name


def is_wildcard_address(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def hosts_for_bind(bind_host: str, extra: Sequence[str]) -> list[str]:
    """The names to accept besides the loopback ones, for a server bound to `bind_host`.

    A wildcard bind with no names given accepts any Host: the server's public names are not
    known, and such a server must have an API key anyway (`check_exposure`), which a rebound
    page does not have. A specific address is a name the server answers to.
    """
    if is_wildcard_address(bind_host):
        return list(extra) if extra else ["*"]
    own = normalize_host(bind_host)
    if own in LOOPBACK_HOSTS or is_loopback(bind_host):
        return list(extra)
    return [own, *extra]


# ---- binding ----------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(host: str, *, has_keys: bool, allow_unauthenticated: bool) -> None:
    """Refuses (ValueError) to serve a non-loopback address to everyone by accident."""
    if has_keys or allow_unauthenticated or is_loopback(host):
        return
    shown = host or "all interfaces"
    raise ValueError(
        f"refusing to serve on {shown} without an API key: anyone who can reach that address "
        "could run the model, read the metrics and the KV-cache state. Set --api-key "
        "(or STREAMENGINE_API_KEY, a comma-separated list), or pass --allow-unauthenticated "
        "if every client on that network is trusted."
    )
