"""Model loading, the native Llama-family forward, and attention over the paged KV cache.

attention.py: the hook, the per-step metadata and the backend protocol; torch_backend.py,
cpu_backend.py, triton_backend.py: the backends; native.py: the native decoder; loader.py:
loading a folder or GGUF file.
"""

from streamengine.models.loader import LoadedModel, load_model, resolve_default_model

__all__ = ["LoadedModel", "load_model", "resolve_default_model"]
