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
    "AsyncEngine": "streamengine.engine",
    "EngineDeadError": "streamengine.errors",
    "EngineError": "streamengine.errors",
    "EngineOverloadedError": "streamengine.errors",
    "GrammarError": "streamengine.errors",
    "LimitExceededError": "streamengine.errors",
    "RequestFailedError": "streamengine.errors",
    "EngineConfig": "streamengine.config",
    "CompletionOutput": "streamengine.outputs",
    "RequestMetrics": "streamengine.outputs",
    "RequestOutput": "streamengine.outputs",
    "SamplingParams": "streamengine.sampling_params",
    "Choice": "streamengine.structured_params",
    "Grammar": "streamengine.structured_params",
    "JsonObject": "streamengine.structured_params",
    "JsonSchema": "streamengine.structured_params",
    "Regex": "streamengine.structured_params",
    "StructuredOutput": "streamengine.structured_params",
    "AllBlocksCleared": "streamengine.kv_events",
    "BlockRemoved": "streamengine.kv_events",
    "BlockStored": "streamengine.kv_events",
    "EventBatch": "streamengine.kv_events",
    "KVEventSubscription": "streamengine.kv_events",
    "prompt_block_hashes": "streamengine.block_manager",
}

if TYPE_CHECKING:
    from streamengine.block_hash import prompt_block_hashes
    from streamengine.config import EngineConfig
    from streamengine.engine import AsyncEngine
    from streamengine.errors import (
        EngineDeadError,
        EngineError,
        EngineOverloadedError,
        GrammarError,
        LimitExceededError,
        RequestFailedError,
    )
    from streamengine.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventBatch,
        KVEventSubscription,
    )
    from streamengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from streamengine.sampling_params import SamplingParams
    from streamengine.structured_params import (
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
