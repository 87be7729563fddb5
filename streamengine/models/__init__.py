"""Model loading and the attention hook that reads/writes the paged KV cache."""

from streamengine.models.loader import LoadedModel, load_model, resolve_default_model

__all__ = ["LoadedModel", "load_model", "resolve_default_model"]
