"""The server's side of tenancy: a tenants file's tenants registered and their prompts pinned
when the server starts, and `GET /v1/tenants`, each tenant's share, usage and pinned blocks
(admin keys only: it shows every tenant's load).

Nothing here sends a cache salt: the view lists names, weights, limits and figures only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from streamengine.engine.intake import encode_prompt
from streamengine.server.state import get_state
from streamengine.server.tenants_file import TenantsFile, TenantsFileError

if TYPE_CHECKING:
    from streamengine.engine.client import EngineClient

_USAGE_KEYS = (
    "num_running", "num_waiting", "num_requests", "prompt_tokens", "output_tokens",
    "prefix_cache_queries", "prefix_cache_hits", "num_blocks", "num_rejected",
)
_LIMIT_KEYS = ("max_running", "max_kv_fraction", "tokens_per_minute", "max_n", "max_best_of")
_PIN_KEYS = ("pin_id", "tenant", "shared", "num_tokens", "num_blocks")  # PinnedPrefix's fields


async def apply_tenants_file(engine: EngineClient, tenants: TenantsFile) -> None:
    """Registers the file's tenants with the running engine, then pins the shared prefix
    (unsalted) and each tenant's system prompt (in that tenant). TenantsFileError when a pin
    is refused (past `max_pinned_fraction`, or too long for the model)."""
    for config in tenants.tenants:
        engine.add_tenant(config)  # the CLI put them in EngineConfig too: this replaces them with themselves
    for ids, tenant, what in file_pins(engine.tokenizer, tenants):
        try:
            await engine.pin_prefix(ids, tenant=tenant, shared=tenant is None)
        except ValueError as exc:  # LimitExceededError("max_pinned_fraction") among them
            raise TenantsFileError(f"tenants file {tenants.path!r}: cannot pin {what}: {exc}") from None


def file_pins(tokenizer: Any, tenants: TenantsFile) -> list[tuple[list[int], str | None, str]]:
    """(token ids, tenant or None for the shared prefix, what it is) of every prefix the file
    pins. Tokenized as the server tokenizes chat prompts (ServerState.tokenize with `chat`:
    no special tokens added, the template wrote them), so the pinned blocks hold exactly
    the tokens chat requests start with; the shared prefix is template markup too."""
    texts: list[tuple[str, str | None, str]] = []
    if tenants.shared_prefix is not None:
        texts.append((tenants.shared_prefix, None, "shared_prefix"))
    for name, prompt in tenants.system_prompts.items():
        texts.append((system_prefix(tokenizer, prompt), name, f"the system_prompt of tenant {name!r}"))
    return [(encode_prompt(tokenizer, text, chat=True), tenant, what) for text, tenant, what in texts]


def system_prefix(tokenizer: Any, prompt: str) -> str:
    """`prompt` as the chat template renders a conversation's opening system message: the
    text every chat request of that bot starts with."""
    message = [{"role": "system", "content": prompt}]
    return tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=False)


def tenants_view(engine: EngineClient) -> dict[str, Any]:
    """Every tenant the engine knows (configured or seen) with its share, usage and pins."""
    figures: dict[str, dict[str, Any]] = engine.stats().get("tenants") or {}
    configs = {config.name: config for config in engine.tenants}
    pins = [{key: getattr(pin, key) for key in _PIN_KEYS} for pin in engine.pinned()]
    names = list(configs) + [name for name in figures if name not in configs]
    weights = {name: configs[name].weight if name in configs else float(figures[name].get("weight", 1.0))
               for name in names}
    total_weight = sum(weights.values()) or 1.0
    data = []
    for name in names:
        config, own = configs.get(name), figures.get(name, {})
        data.append({
            "name": name,
            "weight": weights[name],
            "share": weights[name] / total_weight,  # of the service while every tenant is backlogged
            "virtual_time": own.get("virtual_time", 0.0),
            "lora": config.lora if config else None,
            "limits": {key: getattr(config, key) if config else None for key in _LIMIT_KEYS},
            "usage": {key: own.get(key, 0) for key in _USAGE_KEYS},
            "num_pinned_blocks": own.get("num_pinned_blocks", 0),
            "pinned": [pin for pin in pins if pin["tenant"] == name and not pin["shared"]],
        })
    shared = [pin for pin in pins if pin["shared"]]
    return {"object": "list", "data": data, "shared_pinned": shared}


async def tenants_route(request: web.Request) -> web.Response:
    return web.json_response(tenants_view(get_state(request).engine))
