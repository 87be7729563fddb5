"""streamengine: an asyncio-native, embeddable LLM serving engine built on PagedAttention.

The public names are imported lazily, so the pure-Python parts (block manager, scheduler)
load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from streamengine.checkout import drop_checkout_root

drop_checkout_root()  # before anything imports transformers: see checkout.py

__all__ = [
    "AllBlocksCleared",
    "AsyncEngine",
    "BlockRemoved",
    "BlockStored",
    "Choice",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineOverloadedError",
    "EventBatch",
    "Grammar",
    "GrammarError",
    "JsonObject",
    "JsonSchema",
    "KVEventSubscription",
    "LimitExceededError",
    "Regex",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
    "prompt_block_hashes",
]
__version__ = "0.1.0"

_WHERE = {
    "AsyncEngine": "streamengine.engine.async_engine",
    "EngineDeadError": "streamengine.errors",
    "EngineError": "streamengine.errors",
    "EngineOverloadedError": "streamengine.errors",
    "GrammarError": "streamengine.errors",
    "LimitExceededError": "streamengine.errors",
    "RequestFailedError": "streamengine.errors",
    "EngineConfig": "streamengine.config",
    "CompletionOutput": "streamengine.sample.outputs",
    "RequestMetrics": "streamengine.sample.outputs",
    "RequestOutput": "streamengine.sample.outputs",
    "SamplingParams": "streamengine.sample.sampling_params",
    "Choice": "streamengine.structured.params",
    "Grammar": "streamengine.structured.params",
    "JsonObject": "streamengine.structured.params",
    "JsonSchema": "streamengine.structured.params",
    "Regex": "streamengine.structured.params",
    "StructuredOutput": "streamengine.structured.params",
    "AllBlocksCleared": "streamengine.kv.events",
    "BlockRemoved": "streamengine.kv.events",
    "BlockStored": "streamengine.kv.events",
    "EventBatch": "streamengine.kv.events",
    "KVEventSubscription": "streamengine.kv.events",
    "prompt_block_hashes": "streamengine.kv.block_hash",
}

if TYPE_CHECKING:
    from streamengine.config import EngineConfig
    from streamengine.engine.async_engine import AsyncEngine
    from streamengine.errors import (
        EngineDeadError,
        EngineError,
        EngineOverloadedError,
        GrammarError,
        LimitExceededError,
        RequestFailedError,
    )
    from streamengine.kv.block_hash import prompt_block_hashes
    from streamengine.kv.events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventBatch,
        KVEventSubscription,
    )
    from streamengine.sample.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from streamengine.sample.sampling_params import SamplingParams
    from streamengine.structured.params import (
        Choice,
        Grammar,
        JsonObject,
        JsonSchema,
        Regex,
        StructuredOutput,
    )


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'streamengine' has no attribute {name!r}")
