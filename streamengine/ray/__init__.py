"""Scale-out on Ray Serve: engine replicas routed by the KV blocks they hold.

Install with `pip install -e '.[ray]'`. One `AsyncEngine` runs per replica deployment
(replica.py); each publishes its KV events to a directory actor (directory.py); the request
router (router.py) mirrors them in a block index (block_index.py) and sends a request to the
replica holding the longest chain of its salted block hashes. The ingress deployment
(ingress.py) runs the single-process aiohttp server unchanged over a `ClusterEngine`
(cluster_engine.py), the engine interface backed by the replicas; adapters.py keeps the
cluster's LoRA adapters, which replicas load on first use. app.py builds and runs it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ClusterApp", "ClusterOptions", "build_app", "deploy"]


def __getattr__(name: str) -> Any:
    """The deployment API, imported on first use: submodules that need no Ray (the ASGI
    bridge) import without it, and a missing Ray is a clear error naming the extra."""
    if name not in __all__:
        raise AttributeError(f"module 'streamengine.ray' has no attribute {name!r}")
    try:
        from streamengine.ray import app
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("ray"):
            raise
        raise ImportError(
            "streamengine.ray needs Ray Serve: pip install -e '.[ray]' (or pip install 'ray[serve]==2.60.0')"
        ) from exc
    return getattr(app, name)
