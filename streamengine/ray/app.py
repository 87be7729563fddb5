"""Building and running the application: N engine replicas behind one ingress.

`deploy` starts (or joins) a Ray cluster, runs the application and returns once every
replica is up; `serve_cluster` is `python -m streamengine serve --replicas N`, serving until
a signal. Routers: "cached" (ours, router.py), "pow2" (Ray Serve's default power-of-two
choices) and "ray_prefix" (Ray's PrefixCacheAffinityRouter, which matches prompt text), so
a benchmark can compare them on one build.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from streamengine.config import EngineConfig
from streamengine.ray.directory import DIRECTORY_NAMESPACE, directory_name, get_or_create_directory
from streamengine.ray.ingress import Ingress
from streamengine.ray.replica import DEFAULT_REPORT_INTERVAL_S, EngineReplica, PinSpec
from streamengine.ray.router import CachedBlockRouter
from streamengine.server.config import ServerConfig
from streamengine.server.tenants_file import TenantsFile

ROUTERS = ("cached", "pow2", "ray_prefix")
_RAY_PREFIX_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
)


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int = 2
    router: str = "cached"
    app_name: str = "streamengine"
    host: str = "127.0.0.1"
    port: int = 8000
    replica_cpus: float = 1.0  # Ray CPUs per replica; also its torch threads unless set
    replica_gpus: float = 0.0  # Ray GPUs per replica (EngineConfig.device "auto" then uses CUDA)
    max_ongoing_requests: int = 256  # per replica, as Ray Serve counts them
    graceful_shutdown_timeout_s: float = 60.0  # a replica scaled down finishes its streams first
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)  # the ingress app's (its tenants: tenants_file)
    tenants_file: TenantsFile | None = None  # its prompts are pinned on every replica

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")


@dataclass
class ClusterApp:
    """A running application: its URL, its engine handle, and how to take it down."""

    url: str
    app_name: str
    handle: Any
    replicas: int

    def replica_loads(self) -> dict[str, dict[str, Any]]:
        """Each live replica's last report (stats, health, KV map), by replica id."""
        directory = get_or_create_directory(self.app_name)
        return ray.get(directory.loads.remote())

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every replica reported a ready engine to the directory."""
        deadline = time.monotonic() + timeout_s
        while True:
            loads = self.replica_loads()
            ready = [r for r in loads.values() if r["health"]["state"] == "ready"]
            if len(ready) >= self.replicas:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ready)} of {self.replicas} replicas ready after {timeout_s:g} s")
            time.sleep(0.1)

    def shutdown(self) -> None:
        serve.delete(self.app_name)
        try:
            ray.kill(ray.get_actor(directory_name(self.app_name), namespace=DIRECTORY_NAMESPACE))
        except ValueError:  # never created
            pass


def build_app(config: EngineConfig, options: ClusterOptions) -> serve.Application:
    """The application graph: the engine deployment bound into the ingress."""
    pins = tenant_pins(config, options.tenants_file)
    threads = config.num_threads if config.num_threads is not None else max(1, int(options.replica_cpus))
    replica_config = dataclasses.replace(config, num_threads=threads)
    router = _router_config(config, options)
    engine = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        max_ongoing_requests=options.max_ongoing_requests,
        graceful_shutdown_timeout_s=options.graceful_shutdown_timeout_s,
        **({"request_router_config": router} if router is not None else {}),
    ).bind(replica_config, options.app_name, pins, options.report_interval_s)
    ingress = serve.deployment(
        serve.ingress()(Ingress), name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1000, options.max_ongoing_requests * options.replicas),
        graceful_shutdown_timeout_s=options.graceful_shutdown_timeout_s,
    )
    server = dataclasses.replace(options.server, tenants=options.tenants_file)
    return ingress.bind(
        engine, options.app_name, config, pins, server, options.graceful_shutdown_timeout_s,
        prompt_text=options.router == "ray_prefix",  # the only router that reads prompt text
    )


def deploy(config: EngineConfig, options: ClusterOptions, *, ray_address: str | None = None) -> ClusterApp:
    """Starts a local Ray cluster (or joins `ray_address`), runs the application, and returns
    once every replica is ready."""
    if not ray.is_initialized():
        if ray_address is None:
            ray.init(num_cpus=max(2, int(options.replicas * options.replica_cpus + 0.999)),
                     include_dashboard=False, namespace=DIRECTORY_NAMESPACE)
        else:
            ray.init(address=ray_address, namespace=DIRECTORY_NAMESPACE)
    serve.start(http_options={"host": options.host, "port": options.port})
    handle = serve.run(build_app(config, options), name=options.app_name, route_prefix="/")
    app = ClusterApp(f"http://{options.host}:{options.port}", options.app_name, handle, options.replicas)
    app.wait_ready()
    return app


def serve_cluster(config: EngineConfig, options: ClusterOptions, *, ray_address: str | None = None) -> None:
    """Deploys, serves until SIGINT/SIGTERM, then deletes the application (replicas finish
    their streams first, up to graceful_shutdown_timeout_s)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"streamengine: starting {options.replicas} replicas on Ray ...", flush=True)
    app = deploy(config, options, ray_address=ray_address)
    print(f"streamengine: serving at {app.url}/ with {options.replicas} replicas, "
          f"router {options.router}  (Ctrl+C to stop)", flush=True)
    stop.wait()
    print("streamengine: shutting down ...", flush=True)
    app.shutdown()
    if ray_address is None:
        serve.shutdown()
        ray.shutdown()


def tenant_pins(config: EngineConfig, tenants: TenantsFile | None) -> tuple[PinSpec, ...]:
    """The tenants file's prefixes as token ids, tokenized once here exactly as the server
    tokenizes them, so every replica pins the same blocks and the ingress recognises them."""
    if tenants is None:
        return ()
    from streamengine.models.loader import load_tokenizer
    from streamengine.server.tenancy import file_pins

    tokenizer, _ = load_tokenizer(config.model, config.cache_dir)
    return tuple(
        PinSpec(uuid.uuid4().hex[:12], tuple(ids), tenant, tenant is None)
        for ids, tenant, _ in file_pins(tokenizer, tenants)
    )


def _router_config(config: EngineConfig, options: ClusterOptions) -> RequestRouterConfig | None:
    if options.router == "pow2":
        return None  # Ray Serve's default
    if options.router == "ray_prefix":
        return RequestRouterConfig(request_router_class=_RAY_PREFIX_ROUTER,
                                   request_router_kwargs=dict(options.router_kwargs))
    kwargs = {"app_name": options.app_name, "block_size": config.block_size, **options.router_kwargs}
    return RequestRouterConfig(request_router_class=CachedBlockRouter, request_router_kwargs=kwargs)
