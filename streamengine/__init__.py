"""streamengine: an asyncio-native, embeddable LLM serving engine built on PagedAttention."""

from streamengine.config import EngineConfig
from streamengine.engine import AsyncEngine, EngineDeadError
from streamengine.outputs import CompletionOutput, RequestOutput
from streamengine.sampling import SamplingParams

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
