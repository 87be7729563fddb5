"""Tenants: who a request is for, with that tenant's share, limits and cache salt.

A tenant is one bot of a platform (or one customer): its requests share prefix-cache blocks
with each other and never with another tenant's, the scheduler gives each tenant service in
proportion to its `weight` (fair_share.py), and its limits bound what one tenant can take.
The registry is owned by one engine (two engines never share tenants) and grows at run time.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

from streamengine.errors import EngineOverloadedError, LimitExceededError

DEFAULT_TENANT = "default"
"""The tenant of requests that name none."""
RATE_WINDOW_S = 60.0


class TenantRateLimitError(EngineOverloadedError):
    """The tenant used its `tokens_per_minute`; `retry_after` says when enough has aged out."""

    def __init__(self, tenant: str, limit: int, retry_after: float) -> None:
        super().__init__(
            f"tenant {tenant!r} used its {limit} tokens per minute; retry in {retry_after:.1f} s",
            retry_after=retry_after,
        )
        self.tenant = tenant
        self.limit = "tokens_per_minute"


@dataclass(frozen=True, slots=True)
class TenantConfig:
    name: str
    weight: float = 1.0  # share of service relative to other backlogged tenants
    max_running: int | None = None  # sequences of this tenant running at once
    max_kv_fraction: float | None = None  # of the KV pool this tenant's running sequences may hold
    tokens_per_minute: int | None = None  # prompt + generated tokens over the last minute
    cache_salt: str | None = field(default=None, repr=False)  # None: derived from the name; kept out of logs
    max_n: int | None = None  # samples one request may ask for (n); None: the engine's MAX_N
    max_best_of: int | None = None  # beams one request may ask for (beam_width); None: MAX_BEAM_WIDTH
    lora: str | None = None  # the LoRA adapter its requests run under unless they name one

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("TenantConfig.name must be a non-empty string")
        # A per-user salt is the tenant's salt, NUL, then the user's (pinning.Pins.segments): with
        # a NUL in a tenant's salt, tenant "a\0user:alice" had the salt of tenant a's user alice
        # and hit her private blocks. Without one the tenant part ends at the first NUL.
        if "\x00" in self.name:
            raise ValueError(f"TenantConfig.name must not contain NUL characters, got {self.name!r}")
        # Types too: a config can be added at run time (add_tenant). A cache_salt that was not a
        # string got through to the block hashes, where it failed the engine step (restarting
        # the engine, failing every tenant's requests) instead of the add_tenant call; a number
        # given as a string failed here with a bare TypeError naming no field.
        _check(self, "weight", _is_number(self.weight) and 0 < self.weight < float("inf"),
               "must be a number > 0 and finite")
        _check(self, "max_running", self.max_running is None or (_is_int(self.max_running) and self.max_running >= 1),
               "must be an integer >= 1 or None")
        _check(self, "max_kv_fraction",
               self.max_kv_fraction is None or (_is_number(self.max_kv_fraction) and 0 < self.max_kv_fraction <= 1),
               "must be a number in (0, 1] or None")
        for name in ("tokens_per_minute", "max_n", "max_best_of"):
            value = getattr(self, name)
            _check(self, name, value is None or (_is_int(value) and value >= 1), "must be an integer >= 1 or None")
        _check(self, "lora", self.lora is None or (isinstance(self.lora, str) and bool(self.lora)),
               "must be a non-empty string (an adapter's name) or None")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):  # the value is secret: not shown
            raise ValueError(f"TenantConfig.cache_salt must be a string or None (tenant {self.name!r}), "
                             f"got {type(self.cache_salt).__name__}")
        if self.cache_salt is not None and "\x00" in self.cache_salt:
            raise ValueError(f"TenantConfig.cache_salt must not contain NUL characters (tenant {self.name!r})")

    @property
    def salt(self) -> str:
        """The prefix-cache salt of this tenant's private blocks."""
        return self.cache_salt if self.cache_salt is not None else f"tenant:{self.name}"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(config: TenantConfig, name: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"TenantConfig.{name} {message} (tenant {config.name!r}), got {getattr(config, name)!r}")


@dataclass(slots=True)
class TokenWindow:
    """Tokens used over the last RATE_WINDOW_S seconds, in arrival order."""

    events: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def add(self, now: float, tokens: int) -> None:
        if tokens:
            self.events.append((now, tokens))
            self.total += tokens

    def used(self, now: float) -> int:
        while self.events and self.events[0][0] <= now - RATE_WINDOW_S:
            self.total -= self.events.popleft()[1]
        return self.total

    def retry_after(self, now: float, limit: int) -> float:
        """Seconds until usage falls below `limit` as old events age out."""
        excess = self.used(now) - limit
        for stamp, tokens in self.events:
            excess -= tokens
            if excess < 0:
                return max(0.0, stamp + RATE_WINDOW_S - now)
        return 0.0


class Tenants:
    """The engine's tenants by name; an unknown name is registered with default settings."""

    def __init__(self, configs: tuple[TenantConfig, ...] | list[TenantConfig] = ()) -> None:
        self._configs: dict[str, TenantConfig] = {}
        self._usage: dict[str, TokenWindow] = {}
        self.num_rejected: dict[str, int] = {}  # requests refused by the rate limit
        for config in configs:
            self.add(config)

    def add(self, config: TenantConfig) -> None:
        """Registers a tenant or replaces its settings (requests in flight keep running)."""
        if not isinstance(config, TenantConfig):
            raise TypeError(f"expected TenantConfig, got {type(config).__name__}")
        self._configs[config.name] = config
        self._usage.setdefault(config.name, TokenWindow())

    def get(self, name: str) -> TenantConfig:
        """`name`'s settings; a name seen for the first time is registered with those of the
        default tenant, if one was configured (its own salt, though): the server's --api-key
        keys are each a tenant of their own, and a `default` entry sets their share and limits,
        each key's apart."""
        config = self._configs.get(name)
        if config is None:
            template = self._configs.get(DEFAULT_TENANT)
            config = TenantConfig(name) if template is None else dataclasses.replace(template, name=name, cache_salt=None)
            self.add(config)
        return config

    def names(self) -> list[str]:
        return list(self._configs)

    def __contains__(self, name: str) -> bool:
        return name in self._configs

    def check_rate(self, name: str, now: float | None = None) -> None:
        """Raises TenantRateLimitError when the tenant's last minute used its allowance."""
        limit = self.get(name).tokens_per_minute
        if limit is None:
            return
        now = time.monotonic() if now is None else now
        window = self._usage[name]
        if window.used(now) >= limit:
            self.num_rejected[name] = self.num_rejected.get(name, 0) + 1
            raise TenantRateLimitError(name, limit, max(0.1, window.retry_after(now, limit)))

    def check_width(self, name: str, n: int, beam_width: int) -> None:
        """Raises LimitExceededError, naming the limit, when a request of `n` samples (or
        `beam_width` beams) asks for more than the tenant's max_n or max_best_of, or needs more
        sequences at once than its max_running: such a request would hold every running slot
        its tenant may have (or more), beside whatever else it runs."""
        config = self.get(name)
        for limit, value, what in (("max_n", n, "n"), ("max_best_of", beam_width, "best_of (beam_width)")):
            cap = getattr(config, limit)
            if cap is not None and value > cap:
                raise LimitExceededError(limit, f"{what}={value} is past tenant {name!r}'s {limit} ({cap})")
        width = max(n, beam_width)  # the sequences it runs at once: its samples, or its beams
        if config.max_running is not None and width > config.max_running:
            raise LimitExceededError("max_running", f"the request runs {width} sequences at once (n or beam_width); "
                                                    f"tenant {name!r} may run at most {config.max_running} (max_running)")

    def record(self, name: str, tokens: int, now: float | None = None) -> None:
        """Counts tokens (prompt tokens at intake, generated ones as they come) against the rate."""
        if self.get(name).tokens_per_minute is not None:
            self._usage[name].add(time.monotonic() if now is None else now, tokens)
