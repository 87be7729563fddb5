"""ServerConfig: every option of the server, built once (from the CLI, the environment and the
tenants file, or by an embedding program) and passed whole to `run_server`, `create_app` and
the Ray ingress. Bounds and what a client sees when one is hit: docs/operations.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from streamengine.server.security import hosts_for_bind
from streamengine.server.tenants_file import TenantsFile

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
"""WebSocket messages above this get a `message_too_large` error (the socket stays open)."""
DEFAULT_MAX_BODY_BYTES = 4 << 20
"""HTTP request bodies above this are answered 413."""
DEFAULT_MAX_PENDING_BYTES = 8 << 20
"""Unsent bytes one WebSocket may hold (merged deltas included) before it is closed with 1008."""
DEFAULT_MAX_CONNECTIONS = 1024
"""Authenticated WebSockets the server holds at once; more are answered 503."""
DEFAULT_MAX_UNAUTHENTICATED = 64
"""WebSockets still to authenticate (no key in their handshake) held at once, apart from
`max_connections`: idle keyless sockets can never take an authenticated client's place."""
DEFAULT_AUTH_TIMEOUT_S = 10.0
"""A WebSocket that has not authenticated this long after its handshake is closed (4001)."""
DEFAULT_IDLE_TIMEOUT_S = 30.0
"""An HTTP connection that has not sent a complete request head this long after it opened, or
after its previous response, is closed: idle keep-alive and slowly sent headers alike."""
DEFAULT_BODY_TIMEOUT_S = 30.0
"""An OpenAI POST whose body has not fully arrived this long after its head is answered 408."""
DEFAULT_WRITE_TIMEOUT_S = 15.0
"""A streamed (SSE) response whose client takes no bytes for this long is dropped and its
request aborted, so the engine computes nothing for a reader that stalled."""
DEFAULT_HEARTBEAT_S = 30.0
"""WebSocket ping interval; a peer that answers no ping within half of it is dropped."""
DEFAULT_STALL_TIMEOUT_S = 120.0
"""/ready turns 503 when the engine has work but has made no progress for this long."""
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
"""How long a drain lets requests in flight finish before it aborts them."""
DEFAULT_TOOL_PARSER = "hermes"
"""The format tools are rendered in for templates that cannot render them (tool_prompt.py)."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """`api_key`: one key or several (each its own tenant with its own prefix-cache salt); None
    = no auth. `admin_keys`: keys that also read /metrics, /v1/kv_state and /v1/tenants and
    load and unload LoRA adapters (with keys configured, nobody else may). `allowed_origins`:
    browser origins allowed besides the server's own (`*` = any). `host`, `allowed_hosts`: the
    Host names answered are the loopback ones, `host` when it is a specific address, and
    `allowed_hosts` (`*` = any; on a wildcard address with none given, any).
    `allow_unauthenticated`: serve a non-loopback address without a key. `model_name`: the
    base model's id in /v1/models, which OpenAI requests name unless they name a LoRA adapter
    (default: the engine's). `tenants`: a parsed tenants file, whose keys run requests as
    their tenant and whose prompts are pinned when the engine starts. `tool_parser`: how tool
    calls are read out of outputs with tool_choice "auto". `stall_timeout`: /ready is 503 once
    the engine has work but no progress this long. `shutdown_timeout`: how long a drain lets
    requests finish. The other bounds and timeouts: docs/operations.md."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | Sequence[str] | None = None
    admin_keys: Sequence[str] = ()
    allowed_origins: Sequence[str] = ()
    allowed_hosts: Sequence[str] = ()
    allow_unauthenticated: bool = False
    model_name: str | None = None
    max_prompt_tokens: int | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    request_timeout: float | None = None  # seconds from arrival to the last token
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    auth_timeout: float = DEFAULT_AUTH_TIMEOUT_S
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_S
    web_dir: Path | str | None = None  # the chat page's folder (default: the packaged one)
    tenants: TenantsFile | None = None
    tool_parser: str = DEFAULT_TOOL_PARSER

    @property
    def has_keys(self) -> bool:
        return bool(self.api_key) or bool(self.admin_keys) or bool(self.tenants is not None and self.tenants.keys)

    def answered_hosts(self) -> list[str]:
        """The Host names answered besides the loopback ones (security.hosts_for_bind)."""
        return hosts_for_bind(self.host, list(self.allowed_hosts))
