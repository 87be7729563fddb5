"""ClusterEngine: the engine interface the server uses, backed by engine replicas.

The ingress runs the single-process aiohttp server unchanged on top of this class: the same
routes, validation, formatting, WebSocket protocol and metrics. Requests go through a
DeploymentHandle (streamed, placed by the request router); the figures the server reads
synchronously (`stats`, `health`, `kv_state`) come from the replicas' reports in the
directory, refreshed in the background.

LoRA adapters are the deployed ones, changed at run time by `add_lora` / `remove_lora` on the
whole cluster; each replica loads an adapter on its first request for it (adapters.py).

Tenants and pinned prefixes are the application's, fixed when it is deployed: every replica,
including one that replaces a dead one, registers the same tenants and pins the same
prefixes at start, so every replica hashes a request's blocks the same way and the ingress
can compute those hashes for the router (`Pins.segments`, as the engine does).

Faults: a request whose replica fails before its first output is retried on another one
(up to `max_attempts`); once output has streamed, it ends with RequestFailedError naming the
cause. Nothing waits on a dead replica: Ray fails its calls and the router forgets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.serve.handle import DeploymentHandle

from streamengine.config import EngineConfig
from streamengine.engine.async_engine import AsyncEngine
from streamengine.engine.intake import encode_prompt
from streamengine.errors import EngineDeadError, RequestFailedError
from streamengine.lora.adapter import identity, with_adapter
from streamengine.ray.adapters import ClusterLoRAs
from streamengine.ray.directory import get_or_create_directory
from streamengine.ray.replica import PinSpec
from streamengine.ray.request import ReplicaRequest
from streamengine.sample.outputs import CompletionOutput, RequestOutput
from streamengine.sample.sampling_params import SamplingParams
from streamengine.tenancy.pinning import Pin, PinnedPrefix, Pins
from streamengine.tenancy.tenants import DEFAULT_TENANT, TenantConfig, Tenants

log = logging.getLogger(__name__)

DEFAULT_MAX_ATTEMPTS = 3
_REFRESH_S = 0.5
_RETRY_BACKOFF_S = 0.2
# Ray's errors for a replica that died or cannot be reached: the request may be retried.
_REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class ClusterEngine:
    """See the module docstring."""

    def __init__(
        self, handle: DeploymentHandle, app_name: str, config: EngineConfig,
        pins: tuple[PinSpec, ...] = (), *, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        prompt_text: bool = False,
    ) -> None:
        from streamengine.models.loader import load_tokenizer

        self.config = config
        self._handle = handle.options(stream=True)
        self._app_name = app_name
        self._tenants = Tenants(config.tenants)
        self._pins = Pins(config.block_size)
        self._pinned = [self._mirror_pin(spec) for spec in pins]
        self._max_attempts = max_attempts
        self._prompt_text = prompt_text  # the router matches text (Ray's prefix router)
        self.tokenizer, self._model_name = load_tokenizer(config.model, config.cache_dir)
        self._loads: dict[str, dict[str, Any]] = {}
        self._loras = ClusterLoRAs(config, lambda: get_or_create_directory(app_name))
        self._live: dict[str, Any] = {}  # request id -> its streaming response
        self._aborted: set[str] = set()
        self._task: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self.is_running:
            raise RuntimeError("engine already started")
        self._task = asyncio.get_running_loop().create_task(self._refresh(), name="streamengine-cluster-loads")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for response in list(self._live.values()):
            response.cancel()

    async def _refresh(self) -> None:
        directory = get_or_create_directory(self._app_name)
        try:  # adapters added or removed before this ingress started (it may replace another)
            self._loras.apply(await directory.adapters.remote())
        except Exception:
            log.warning("reading the cluster's LoRA adapters failed; serving the deployed ones", exc_info=True)
        while True:
            try:
                self._loads = await directory.loads.remote()
            except Exception:
                log.warning("reading replica loads failed", exc_info=True)
            await asyncio.sleep(_REFRESH_S)

    # -- requests --------------------------------------------------------------------------

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None,
        request_id: str | None = None, cache_salt: str | None = None, tenant: str | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate, on whichever replica the router picks."""
        if not self.is_running:
            raise EngineDeadError("engine stopped: the cluster engine is not running")
        request = self._request(prompt, params, request_id, cache_salt, tenant, lora)
        last: RequestOutput | None = None
        try:
            async for output in self._stream(request):
                last = output
                yield output
            if last is None or not last.finished:
                if request.request_id in self._aborted:
                    yield _aborted(request, last)
                else:
                    raise RequestFailedError("the replica ended the stream before the request finished")
        finally:
            self._aborted.discard(request.request_id)

    async def _stream(self, request: ReplicaRequest) -> AsyncIterator[RequestOutput]:
        """The replica's outputs; retried elsewhere while none has come."""
        for attempt in range(1, self._max_attempts + 1):
            response = self._handle.generate.remote(request)
            self._live[request.request_id] = response
            started = False
            try:
                async for output in response:
                    started = True
                    yield output
                return
            except _REPLICA_LOST as exc:
                if started or attempt == self._max_attempts or request.request_id in self._aborted:
                    raise RequestFailedError(f"the replica serving this request failed: {_cause(exc)}") from None
                log.warning("replica lost before request %s started (%s); retrying", request.request_id, _cause(exc))
                await asyncio.sleep(_RETRY_BACKOFF_S * attempt)
            except ray.exceptions.RayTaskError as exc:
                raise _unwrapped(exc) from None
            except (asyncio.CancelledError, GeneratorExit):
                response.cancel()
                raise
            except Exception as exc:
                if request.request_id in self._aborted:
                    return  # the cancel that `abort` caused
                raise RequestFailedError(f"the cluster could not serve this request: {_cause(exc)}") from None
            finally:
                self._live.pop(request.request_id, None)

    def _request(
        self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
        cache_salt: str | None, tenant: str | None, lora: str | None = None,
    ) -> ReplicaRequest:
        ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        name = tenant if tenant is not None else DEFAULT_TENANT
        segments = self._pins.segments(ids, name, self._tenants.get(name).salt, cache_salt)
        lora = lora if lora is not None else self._tenants.get(name).lora
        adapter = self._loras.get(lora) if lora is not None else None  # LoRAError as the engine's
        if adapter is not None:  # hashed as the replica will (core_pins.salt_segments), for the router
            segments = with_adapter(segments, identity(adapter.name, adapter.digest))
        text = "" if not self._prompt_text else prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        return ReplicaRequest(
            ids, params if params is not None else SamplingParams(), request_id or uuid.uuid4().hex,
            cache_salt, tenant, segments, lora=adapter, prompt=text,
        )

    # -- LoRA adapters: the deployed ones, changed at run time on every replica ---------------

    def lora_adapters(self) -> list[dict[str, Any]]:
        return self._loras.listing()

    async def add_lora(self, name: str, path: str) -> None:
        """As AsyncEngine.add_lora, for the whole cluster: checked here against the base model
        (LoRAError says what is wrong), loaded by each replica on its first request for it."""
        await self._loras.add(name, path)

    async def remove_lora(self, name: str) -> None:
        """As AsyncEngine.remove_lora, for the whole cluster: refuses new requests for `name`
        at once and returns when every replica has dropped it (after its running requests)."""
        await self._loras.remove(name)

    async def abort(self, request_id: str) -> None:
        """Ends the request; its stream yields a final output with finish_reason "abort"."""
        response = self._live.get(request_id)
        if response is not None:
            self._aborted.add(request_id)
            response.cancel()

    # -- tenants and pinned prefixes: the application's, set at deploy time ------------------

    @property
    def tenants(self) -> list[TenantConfig]:
        return [self._tenants.get(name) for name in self._tenants.names()]

    def add_tenant(self, config: TenantConfig) -> None:
        """Accepts the tenants the application was deployed with; others are a clear error."""
        if config.name in self._tenants and self._tenants.get(config.name) == config:
            return
        raise ValueError(
            f"tenant {config.name!r}: a cluster's tenants are set when it is deployed "
            "(EngineConfig.tenants or --tenants); redeploy to change them"
        )

    def pinned(self) -> list[PinnedPrefix]:
        return list(self._pinned)

    async def pin_prefix(self, prompt: str | list[int], tenant: str | None = None, shared: bool = False) -> PinnedPrefix:
        """The deployed pin with these tokens; pins are set when the cluster is deployed."""
        ids = self._prompt_ids(prompt)
        owner = None if shared else (tenant if tenant is not None else DEFAULT_TENANT)
        for pin in self._pins.all():
            if pin.token_ids == tuple(ids) and pin.info.tenant == owner and pin.info.shared == shared:
                return pin.info
        raise ValueError("a cluster's pinned prefixes are set when it is deployed (ClusterOptions.pins); redeploy to add one")

    async def unpin(self, pin_id: str) -> None:
        raise ValueError("a cluster's pinned prefixes are set when it is deployed; redeploy to remove one")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Tokenized as the engine's Intake does; the replica validates the ids."""
        return encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)

    def _mirror_pin(self, spec: PinSpec) -> PinnedPrefix:
        owner = None if spec.shared else (spec.tenant if spec.tenant is not None else DEFAULT_TENANT)
        bs = self.config.block_size
        info = PinnedPrefix(spec.pin_id, owner, spec.shared, len(spec.token_ids), len(spec.token_ids) // bs)
        self._pins.add(Pin(info, spec.token_ids))
        return info

    # -- figures, from the replicas' reports -----------------------------------------------

    def health(self) -> dict:
        """Ready while any replica is; the figures of all of them."""
        healths = [load["health"] for load in self._loads.values()]
        if not self.is_running:
            return {"state": "stopped", "reason": "stopped", "seconds_since_progress": 0.0,
                    "num_restarts": 0, "num_requests": 0, "num_replicas": len(healths)}
        ready = [h for h in healths if h["state"] == "ready"]
        return {
            "state": "ready" if ready else "starting",
            "reason": None if ready else "no replica is ready yet",
            "seconds_since_progress": min((h["seconds_since_progress"] for h in ready), default=0.0),
            "num_restarts": sum(h["num_restarts"] for h in healths),
            "num_requests": sum(h["num_requests"] for h in healths),
            "num_replicas": len(healths),
        }

    def stats(self) -> dict[str, Any]:
        """The replicas' counters summed (kv_cache_usage averaged), per tenant too."""
        return merge_stats([load["stats"] for load in self._loads.values()])

    def kv_state(self) -> dict:
        """Every replica's blocks, one after the other."""
        states = [load["kv_state"] for load in self._loads.values() if "kv_state" in load]
        return {
            "block_size": self.config.block_size, "num_blocks": sum(s["num_blocks"] for s in states),
            "blocks": [b for s in states for b in s["blocks"]],
            "tenants": [t for s in states for t in s["tenants"]],
        }

    # The engine's own rendering: it only reads self.tokenizer.
    apply_chat_template = AsyncEngine.apply_chat_template


def merge_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums numeric figures across replicas; keeps per-replica constants; merges tenants."""
    merged: dict[str, Any] = {"num_replicas": len(stats)}
    for figures in stats:
        for key, value in figures.items():
            if key == "tenants":
                tenants = merged.setdefault("tenants", {})
                for name, row in value.items():
                    tenants[name] = _summed(tenants.get(name, {}), row)
            elif key in ("block_size", "max_model_len"):
                merged[key] = value
            elif key == "spec_decode_num_accepted_tokens_per_pos":
                merged[key] = _summed_lists(merged.get(key, []), value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
    if stats and "kv_cache_usage" in merged:
        merged["kv_cache_usage"] /= len(stats)
    if merged.get("spec_decode_num_drafts"):  # a mean: of the summed counts, not a sum of means
        merged["spec_decode_mean_accepted_length"] = (
            1.0 + merged["spec_decode_num_accepted_tokens"] / merged["spec_decode_num_drafts"])
    return merged


def _summed_lists(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]


def _summed(into: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    out = dict(into)
    for key, value in row.items():
        if key == "weight":  # a setting, the same on every replica
            out[key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = out.get(key, 0) + value
    return out


def _aborted(request: ReplicaRequest, last: RequestOutput | None) -> RequestOutput:
    """The final output of a request ended by `abort`: nothing new for a delta stream, the
    text so far for a cumulative one."""
    n = request.params.n
    delta = request.params.output_kind == "delta"
    previous = {c.index: c for c in last.outputs} if last is not None and not delta else {}
    outputs = [
        CompletionOutput(i, previous[i].text if i in previous else "",
                         list(previous[i].token_ids) if i in previous else [], "abort")
        for i in range(n)
    ]
    cached = last.num_cached_tokens if last is not None else 0
    metrics = last.metrics if last is not None else None  # the replica's clock: stamped there only
    return RequestOutput(request.request_id, request.prompt_token_ids, outputs, True, cached, metrics)


def _unwrapped(exc: ray.exceptions.RayTaskError) -> BaseException:
    """The replica's own exception (ValueError, EngineOverloadedError, ...), so the server
    classifies it exactly as it would a local engine's."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else RequestFailedError(str(exc))


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
