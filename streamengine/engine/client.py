"""EngineClient: what the server and the Ray ingress ask of an engine.

`AsyncEngine` (one process) and `ray.cluster_engine.ClusterEngine` (replicas behind Ray Serve)
both provide it, so the aiohttp app serves either unchanged; tests/test_layering.py checks that
both define every member.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from streamengine.sample.outputs import RequestOutput
    from streamengine.sample.sampling_params import SamplingParams
    from streamengine.tenancy.pinning import PinnedPrefix
    from streamengine.tenancy.tenants import TenantConfig


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Any: ...  # a transformers tokenizer

    @property
    def model_name(self) -> str: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def tenants(self) -> list[TenantConfig]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        cache_salt: str | None = None, tenant: str | None = None, lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs (see AsyncEngine.generate)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> dict: ...

    def stats(self) -> dict[str, Any]: ...

    def kv_state(self) -> dict: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...

    def add_tenant(self, config: TenantConfig) -> None: ...

    def pinned(self) -> list[PinnedPrefix]: ...

    async def pin_prefix(self, prompt: str | list[int], tenant: str | None = None, shared: bool = False) -> PinnedPrefix: ...

    async def unpin(self, pin_id: str) -> None: ...

    def lora_adapters(self) -> list[dict[str, Any]]: ...

    async def add_lora(self, name: str, path: str) -> None: ...

    async def remove_lora(self, name: str) -> None: ...
