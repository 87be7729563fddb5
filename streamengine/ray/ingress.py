"""The ingress deployment: the single-process server's aiohttp app, served through Ray
Serve's HTTP proxy.

Ray Serve's ingress speaks ASGI; the server speaks aiohttp. Rather than a second copy of the
routes, validation, OpenAI formatting and WebSocket protocol, the ingress runs the unchanged
app (create_app) over a ClusterEngine on a private Unix socket, and an ASGI bridge forwards
each HTTP request and WebSocket to it.
"""

from __future__ import annotations

from ray.serve.handle import DeploymentHandle

from streamengine.config import EngineConfig
from streamengine.ray.asgi_bridge import AiohttpBridge
from streamengine.ray.cluster_engine import ClusterEngine
from streamengine.ray.replica import PinSpec
from streamengine.server.config import ServerConfig


class Ingress:
    """The deployment's class (app.py wraps it with `serve.ingress()` and `serve.deployment`)."""

    async def __init__(
        self, engine: DeploymentHandle, app_name: str, config: EngineConfig,
        pins: tuple[PinSpec, ...] = (), server: ServerConfig | None = None,
        drain_timeout_s: float = 5.0, prompt_text: bool = False,
    ) -> None:
        from streamengine.server import create_app

        self.engine = ClusterEngine(engine, app_name, config, pins, prompt_text=prompt_text)
        self._app = create_app(self.engine, server)
        self._drain_s = drain_timeout_s
        # The bridge answers 413 for bodies past the app's own limit (client_max_size).
        self._bridge = AiohttpBridge(self._app)
        await self._bridge.start()  # runs the app's startup: the ClusterEngine starts

    def __serve_build_asgi_app__(self) -> AiohttpBridge:
        return self._bridge

    async def __del__(self) -> None:
        """Ray Serve has let the requests in flight finish; what is left (WebSockets) gets
        the server's own drain (1001 "going away") before the app stops."""
        from streamengine.server import drain

        await drain(self._app, self._drain_s)
        await self._bridge.close()
