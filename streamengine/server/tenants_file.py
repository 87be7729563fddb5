"""The tenants file (`--tenants FILE`, TOML): each tenant's key, share, limits and system prompt.

    shared_prefix = "<|im_start|>system\\nYou are a bot of Example Inc."  # optional
    [[tenants]]
    name = "bot-a"
    api_key = "sk-a..."            # or api_key_sha256 = "<64 hex digits>" (the key stays out of the file)
    weight = 2.0                   # and max_running, max_kv_fraction, tokens_per_minute, max_n, max_best_of
    lora = "bot-a"                 # a LoRA adapter its requests run under (loaded with --lora-modules)
    system_prompt = "You are bot A."

`system_prompt` is pinned for that tenant when the server starts, rendered as the chat
template renders a system message, so chat requests that open with it hit its blocks.
`shared_prefix` is prompt text (template markup included) pinned unsalted: every tenant's
prompts that start with it share its blocks. A tenant needs a key unless it is `default`: the
tenant of every request on a server without keys, and the settings each `--api-key` key's own
tenant starts with.

A tenant's cache salt is derived here from its key (or the key's SHA-256), so it is as secret
as the key and is never sent to a client. Every problem is a TenantsFileError that names the
entry and the field, raised before the model loads.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from streamengine.tenancy.tenants import DEFAULT_TENANT, TenantConfig

_SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
_LIMITS: dict[str, tuple[type, ...]] = {
    "weight": (int, float), "max_running": (int,), "max_kv_fraction": (int, float), "tokens_per_minute": (int,),
    "max_n": (int,), "max_best_of": (int,),
}
_TEXTS = ("name", "api_key", "api_key_sha256", "system_prompt", "lora")
_TENANT_FIELDS = frozenset((*_TEXTS, *_LIMITS))
_TOP_FIELDS = frozenset(("tenants", "shared_prefix"))
MAX_FILE_BYTES = 16 << 20
"""A tenants file larger than this is refused: room for far more than 20,000 tenants with
their system prompts, and a bound on what reading a wrong path (a device) can take."""


class TenantsFileError(ValueError):
    """The tenants file cannot be used; the message names the entry and the field."""


@dataclass(frozen=True, slots=True)
class TenantKey:
    """One tenant's API key, kept as its SHA-256 so the server never holds it in clear."""

    tenant: str
    digest: bytes  # sha256 of the key's UTF-8 bytes
    salt: str  # the tenant's cache salt: also the secret its per-user salts are hashed with


@dataclass(frozen=True, slots=True)
class TenantsFile:
    path: str
    tenants: tuple[TenantConfig, ...]
    keys: tuple[TenantKey, ...]
    system_prompts: MappingProxyType[str, str]  # tenant name -> its system prompt
    shared_prefix: str | None = None


def load_tenants_file(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> TenantsFile:
    """Parses and checks the file at `path` (TenantsFileError on any problem, a file larger
    than `max_bytes` or nested too deeply for the parser among them)."""
    where = f"tenants file {str(path)!r}"
    raw = _read_bounded(path, max_bytes, where)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"{where}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays and inline tables
        raise TenantsFileError(f"{where}: not valid TOML: arrays or tables nested too deeply") from None
    return parse_tenants(data, str(path))


def _read_bounded(path: str | Path, max_bytes: int, where: str) -> bytes:
    """The file's bytes; reads at most one byte past `max_bytes`, so a device or a pipe that
    never ends (/dev/zero) is refused instead of filling memory."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise TenantsFileError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise TenantsFileError(f"{where}: larger than {max_bytes} bytes, the most a tenants file may hold")
    return raw


def parse_tenants(data: dict[str, Any], path: str = "<tenants>") -> TenantsFile:
    where = f"tenants file {path!r}"
    unknown = sorted(set(data) - _TOP_FIELDS)
    if unknown:
        raise TenantsFileError(f"{where}: unknown top-level field {unknown[0]!r} (expected [[tenants]] tables "
                               "and an optional shared_prefix)")
    entries = data.get("tenants", [])
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise TenantsFileError(f"{where}: expected one or more [[tenants]] tables")
    shared = data.get("shared_prefix")
    if shared is not None and (not isinstance(shared, str) or not shared):
        raise TenantsFileError(f"{where}: shared_prefix must be a non-empty string")
    parsed = [_entry(entry, f"{where}: tenants[{i}]") for i, entry in enumerate(entries)]
    _check_unique(parsed, where)
    return TenantsFile(
        path=path,
        tenants=tuple(config for config, _, _ in parsed),
        keys=tuple(key for _, key, _ in parsed if key is not None),
        system_prompts=MappingProxyType({c.name: prompt for c, _, prompt in parsed if prompt is not None}),
        shared_prefix=shared,
    )


def _entry(entry: dict[str, Any], where: str) -> tuple[TenantConfig, TenantKey | None, str | None]:
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise TenantsFileError(f"{where}: name must be a non-empty string without surrounding spaces")
    where = f"{where} ({name!r})"
    unknown = sorted(set(entry) - _TENANT_FIELDS)
    if unknown:
        raise TenantsFileError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_TENANT_FIELDS))})")
    for field_name in _TEXTS:
        value = entry.get(field_name)
        if value is not None and (not isinstance(value, str) or not value):
            raise TenantsFileError(f"{where}: {field_name} must be a non-empty string")
    digest = _key_digest(entry, name, where)
    salt = hashlib.sha256(b"streamengine-tenant-salt\0" + digest).hexdigest() if digest else None
    config = _config(entry, name, salt, where)
    key = TenantKey(name, digest, config.salt) if digest else None
    return config, key, entry.get("system_prompt")


def _key_digest(entry: dict[str, Any], name: str, where: str) -> bytes | None:
    key, hashed = entry.get("api_key"), entry.get("api_key_sha256")
    if key is not None and hashed is not None:
        raise TenantsFileError(f"{where}: give api_key or api_key_sha256, not both")
    if hashed is not None:
        if not _SHA256_HEX.match(hashed):
            raise TenantsFileError(f"{where}: api_key_sha256 must be 64 hex digits (sha256sum of the key)")
        return bytes.fromhex(hashed)
    if key is not None:
        if key != key.strip():
            raise TenantsFileError(f"{where}: api_key must not have surrounding spaces")
        return hashlib.sha256(key.encode()).digest()
    if name != DEFAULT_TENANT:
        raise TenantsFileError(f"{where}: needs api_key or api_key_sha256 (only {DEFAULT_TENANT!r}, the settings "
                               "of --api-key keys' tenants, may have none)")
    return None


def _config(entry: dict[str, Any], name: str, salt: str | None, where: str) -> TenantConfig:
    limits = {}
    for field_name, kinds in _LIMITS.items():
        value = entry.get(field_name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kinds):
            kind = "an integer" if kinds == (int,) else "a number"
            raise TenantsFileError(f"{where}: {field_name} must be {kind}, got {value!r}")
        limits[field_name] = value
    try:
        return TenantConfig(name, cache_salt=salt, lora=entry.get("lora"), **limits)
    except ValueError as exc:
        raise TenantsFileError(f"{where}: {exc}") from None


def _check_unique(parsed: list[tuple[TenantConfig, TenantKey | None, str | None]], where: str) -> None:
    names: set[str] = set()
    digests: dict[bytes, str] = {}
    for i, (config, key, _) in enumerate(parsed):
        if config.name in names:
            raise TenantsFileError(f"{where}: tenants[{i}] ({config.name!r}): name: a second tenant of that name")
        names.add(config.name)
        if key is not None and key.digest in digests:
            raise TenantsFileError(f"{where}: tenants[{i}] ({config.name!r}): api_key: the same key as tenant "
                                   f"{digests[key.digest]!r}")
        if key is not None:
            digests[key.digest] = config.name
