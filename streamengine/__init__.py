"""streamengine: an asyncio-native, embeddable LLM serving engine built on PagedAttention.

The public names are imported lazily, so the pure-Python parts (block manager, scheduler)
load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineOverloadedError",
    "LimitExceededError",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"

_WHERE = {
    "AsyncEngine": "streamengine.engine",
    "EngineDeadError": "streamengine.errors",
    "EngineError": "streamengine.errors",
    "EngineOverloadedError": "streamengine.errors",
    "LimitExceededError": "streamengine.errors",
    "RequestFailedError": "streamengine.errors",
    "EngineConfig": "streamengine.config",
    "CompletionOutput": "streamengine.outputs",
    "RequestOutput": "streamengine.outputs",
    "SamplingParams": "streamengine.sampling_params",
}

if TYPE_CHECKING:
    from streamengine.config import EngineConfig
    from streamengine.engine import AsyncEngine
    from streamengine.errors import (
        EngineDeadError,
        EngineError,
        EngineOverloadedError,
        LimitExceededError,
        RequestFailedError,
    )
    from streamengine.outputs import CompletionOutput, RequestOutput
    from streamengine.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'streamengine' has no attribute {name!r}")
