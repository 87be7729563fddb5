"""AsyncEngine: the engine inside the caller's event loop.

One owned background task runs the step loop: schedule (loop thread), forward pass (worker
thread, so the loop stays responsive while torch computes), postprocess (loop thread), then
hand each request's latest output to its stream. Aborts that arrive while a forward pass is in
flight are applied right after it, so the worker never sees a block table change under it.

The loop is supervised, so no request can stop it: a fault in one request's postprocessing or
abort fails that request (RequestFailedError); a fault that leaves the bookkeeping untrusted
(in `schedule()`, or refcounts that no longer add up) restarts the core in place: fresh block
manager and scheduler, same model and KV tensors, every request in flight failed. Restarts in
a tight loop stop the engine (EngineDeadError) rather than spin.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from streamengine.config import EngineConfig
from streamengine.engine.admission import check_queue_room
from streamengine.engine.core import EngineCore, EngineStateError, StepPlan, StepResult
from streamengine.engine.cpu_threads import release_openmp_pool, thread_governor
from streamengine.engine.lora_admin import LoRAAdmin
from streamengine.engine.output_stream import RequestStream
from streamengine.engine.pin_keeper import PinKeeper
from streamengine.errors import (
    EngineDeadError,
    GrammarError,
    RequestFailedError,
)
from streamengine.kv.events import KVEventHub, KVEventSubscription
from streamengine.models import LoadedModel
from streamengine.sample.outputs import RequestOutput
from streamengine.sample.sampling_params import SamplingParams
from streamengine.structured.grammar import CompiledGrammar
from streamengine.tenancy.pinning import Pin
from streamengine.tenancy.tenants import DEFAULT_TENANT

log = logging.getLogger(__name__)

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
"""More than MAX_RESTARTS core restarts within RESTART_WINDOW_S stop the engine: the fault
is not transient, and restarting again would only fail every new request the same way."""
RESTART_BACKOFF_S = 0.1
"""Pause after a restart (health() says "restarting"), so a fault on every step cannot spin."""


class AsyncEngine(PinKeeper, LoRAAdmin):
    """`async with AsyncEngine(config) as engine:` then `async for out in engine.generate(...)`."""

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self.core = EngineCore(self.config, loaded)
        self.threads = thread_governor(self.config.num_threads, self.core.device.type)
        self._streams: dict[str, RequestStream] = {}
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight = False
        self._pending_aborts: list[str] = []
        self._init_pins()
        self._state, self._reason = "stopped", "not started"
        self._restart_reason: str | None = None  # set by a fault outside the loop: restart next
        self._restart_times: deque[float] = deque()
        self._last_progress = time.monotonic()
        self.num_restarts = 0
        self._kv_hub = KVEventHub(self.core.kv_snapshot, self.core.record_kv_events)

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_name(self) -> str:
        return self.core.loaded.name

    @property
    def weight_format(self) -> str:
        """How the weights run: "packed" (a GGUF file's blocks as stored), "dequantized" (float,
        as loaded) or "int8" (quantized to Q8_0 at load)."""
        return self.core.runner.weight_format

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self.is_running:
            raise RuntimeError("engine already started")
        if self._executor is not None:  # a cancelled stop() left a forward pass running: no overlap
            await asyncio.to_thread(self._executor.shutdown, True)
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="streamengine-step")
        release_openmp_pool()
        self._state, self._reason = "starting", "the step loop has not started yet"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="streamengine-step-loop")
        self._start_repin()  # a stop() came before a restart's repin was done: resume it

    async def stop(self) -> None:
        """Stops the step loop, waits for a forward pass in flight, aborts every request."""
        task, self._task = self._task, None
        repin, self._repin_task = self._repin_task, None
        if self._state != "stopped":  # from now on new requests get EngineDeadError
            self._state, self._reason = "stopped", "stopped"
        try:
            owned = [t for t in (repin, task) if t is not None]
            for own in owned:
                own.cancel()
            if owned:
                # asyncio.wait raises only for a cancellation of our caller, never for those of
                # the tasks we cancelled (awaiting them one by one, a caller's stale cancel
                # count could not be told apart from theirs).
                await asyncio.wait(owned)
            if self._executor is not None:
                await asyncio.to_thread(self._executor.shutdown, True)
                self._executor = None
        finally:
            # Also when our caller stops waiting for the forward pass (cancelled, timed out):
            # nothing will step these requests again, so their streams must end now. The
            # forward still running only reads its plan and the KV tensors, never the
            # bookkeeping that aborting releases.
            self.core.grammars.shutdown()
            self._in_flight = False
            # Aborts that waited for the cancelled step: _drop_all ends their requests. Kept,
            # they would abort a request reusing the id after a later start().
            self._pending_aborts.clear()
            self._drop_all(EngineDeadError("engine stopped"))

    def _drop_all(self, error: BaseException) -> None:
        """Aborts every request (a fresh core if even that fails) and ends every stream."""
        try:
            for request_id in list(self.core.requests):
                self.core.abort_request(request_id)
        except Exception:
            log.exception("aborting requests at shutdown failed; resetting the core")
            self.core.reset()
        for stream in self._streams.values():
            stream.put_error(error)
        self._streams.clear()
        self._kv_hub.end_all()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def health(self) -> dict:
        """{"state": "stopped" | "starting" | "ready" | "restarting", "reason": why it is not
        ready (None when ready), "seconds_since_progress": since the last completed step while
        work is pending (0.0 when idle), "num_restarts", "num_requests"}."""
        busy = self.core.has_work() and self._state != "stopped"
        return {
            "state": self._state,
            "reason": self._reason,
            "seconds_since_progress": time.monotonic() - self._last_progress if busy else 0.0,
            "num_restarts": self.num_restarts,
            "num_requests": len(self.core.requests),
        }

    # -- requests ------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of one request, one per engine step: cumulative by default,
        only what is new with `params.output_kind="delta"`; a consumer slower than the engine
        gets the steps it missed folded into one output. Leaving early (break, cancel, error)
        aborts it and frees its blocks.

        `tenant` (None: "default") is whose share the request counts against and whose cache
        blocks it may share; `cache_salt` is a per-user salt for what follows the tenant's
        pinned prefixes. `params.structured` is compiled first, in the engine's compile threads
        (the loop keeps serving), queued per tenant and served round robin, within
        `EngineConfig.grammar_compile_timeout_s` of its compile's start. `lora` names a
        loaded LoRA adapter (`add_lora`, `EngineConfig.lora_modules`) to run the request
        under; None: the tenant's adapter if its config names one, else the base model.
        Raises ValueError for a bad request (GrammarError for a spec that does not compile,
        times out, or gives out while decoding), EngineOverloadedError when
        `max_waiting` requests already wait or the tenant's compile queue is full
        (GrammarOverloadedError; TenantRateLimitError past the tenant's tokens per
        minute), RequestFailedError if the engine fails it, EngineDeadError if it stops."""
        # The compiled grammar is not kept in this frame: the cache may drop it mid-request.
        grammar = await self._compile(params, tenant)
        request_id, stream = self._submit(prompt, params, request_id, cache_salt, tenant, grammar=grammar, lora=lora)
        del grammar
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            # Once the core released a finished request its id is free again: a new request may
            # already have registered its own stream under it. Only clean up what is ours.
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                if not finished:
                    self._abort(request_id)

    async def _compile(self, params: SamplingParams | None, tenant: str | None) -> CompiledGrammar | None:
        if not isinstance(params, SamplingParams) or params.structured is None:
            return None  # _submit refuses what is not SamplingParams
        # No compile for a request the engine or the tenant's rate would refuse anyway.
        self._check_admission(tenant)
        self.core.tenants.check_rate(tenant if tenant is not None else DEFAULT_TENANT)
        # Queued and cached per tenant: one tenant's flood of specs waits behind itself, and no
        # tenant can time whether another sent a spec. stop() fails a spec still waiting with
        # EngineDeadError.
        grammar = await self.core.grammars.compile_async(params.structured, tenant)
        if not self.is_running:  # stopped while compiling: as for a stream open at shutdown
            raise EngineDeadError("engine stopped while compiling the structured-output spec")
        return grammar

    def _submit(
        self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
        cache_salt: str | None, tenant: str | None, pin: Pin | None = None,
        grammar: CompiledGrammar | None = None, lora: str | None = None,
    ) -> tuple[str, RequestStream]:
        self._check_admission(tenant)
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if not self.core.has_work():  # progress is measured from when work arrives
            self._last_progress = time.monotonic()
        lora = lora if lora is not None else self.core.tenant_lora(tenant)
        req = self.core.add_request(request_id, prompt, params, cache_salt, tenant, pin, grammar, lora)  # raises ValueError
        stream = self._streams[request_id] = RequestStream(delta=req.params.output_kind == "delta")
        self._wakeup.set()
        return request_id, stream

    # tenants and pinned prefixes: PinKeeper (streamengine.engine.pin_keeper)

    def _check_admission(self, tenant: str | None) -> None:
        if not self.is_running:
            if self._state == "stopped" and self._reason == "stopped":  # by stop(): no fault
                raise EngineDeadError("engine stopped")
            if self._state == "stopped" and self._reason != "not started":
                raise EngineDeadError(f"engine stopped: {self._reason}")
            raise RuntimeError("engine is not running: use `async with engine:` or `await engine.start()`")
        limit = self.config.max_waiting
        if limit is not None:
            check_queue_room(self.core.scheduler.waiting, limit, tenant if tenant is not None else DEFAULT_TENANT)

    async def abort(self, request_id: str) -> None:
        """Ends a request with finish_reason "abort"; its stream yields that final output."""
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if self._in_flight:
            self._pending_aborts.append(request_id)
            return
        try:
            output = self.core.abort_request(request_id)
        except Exception as exc:  # fail this request alone, unless the bookkeeping broke
            log.exception("aborting request %s failed", request_id)
            self.core.fail_request(request_id, f"abort failed: {type(exc).__name__}: {exc}")
            self._deliver_failures()
            self._audit_or_restart()
            return
        stream = self._streams.get(request_id)
        if output is not None and stream is not None:
            stream.put(output)

    def _audit_or_restart(self) -> None:
        """After a fault outside the step loop: if the bookkeeping broke, restart the core
        from the loop (the only place that knows no forward pass is in flight)."""
        try:
            self.core.audit()
        except EngineStateError as exc:
            self._restart_reason = str(exc)
            if self._wakeup is not None:
                self._wakeup.set()

    # -- KV events and block hashes ----------------------------------------------------------

    def kv_events(self, max_batches: int = 1024) -> KVEventSubscription:
        """Subscribes to the engine's KV cache events: an async iterator of `EventBatch`es
        (streamengine.kv.events), one per engine step that changed the set of cached blocks,
        buffering at most `max_batches` (past that: `dropped` counts, then one resync batch).
        Its first batch is a snapshot of the blocks cached already, if any. Ends at `close()`
        or when the engine stops; raises EngineDeadError for a dead engine."""
        if self._state == "stopped" and self._reason not in ("not started", "stopped"):
            raise EngineDeadError(f"engine stopped: {self._reason}")
        self._publish_kv_events()  # events recorded so far belong to the earlier subscribers
        return self._kv_hub.subscribe(max_batches)

    def block_hashes(
        self, prompt: str | list[int], tenant: str | None = None, cache_salt: str | None = None,
        lora: str | None = None,
    ) -> list[bytes]:
        """The hashes of every full block of `prompt` that a request with these arguments
        would look up now (salted as `generate` salts it: under a LoRA adapter, the one
        `lora` names or the tenant's, with the adapter's identity), as KV events name them."""
        return self.core.block_hashes(prompt, tenant, cache_salt, lora)

    def _publish_kv_events(self) -> None:
        if self._kv_hub.active:
            self._kv_hub.publish(self.core.take_kv_events())

    def stats(self) -> dict[str, int | float]:
        return self.core.stats()

    def kv_state(self) -> dict:
        return self.core.kv_state()

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Renders chat messages to a prompt string with the model's template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs string 'role' and 'content' fields")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # -- the step loop -------------------------------------------------------------------

    async def _run(self) -> None:
        self._state, self._reason = "ready", None
        try:
            await self._step_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the supervisor itself failed, or gave up: stop, loudly
            log.exception("engine stopped")
            self._state, self._reason = "stopped", str(exc)
            self._pending_aborts.clear()
            self._drop_all(EngineDeadError(f"engine stopped: {exc}"))

    async def _step_loop(self) -> None:
        while True:
            if self._restart_reason is not None:
                await self._restart(self._restart_reason)
            elif not self.core.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                self._last_progress = time.monotonic()
            else:
                try:
                    await self._step()
                except Exception as exc:  # the bookkeeping cannot be trusted any more
                    log.exception("engine step failed")
                    self._restart_reason = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0)  # let consumers run between steps even if the thread was instant

    async def _step(self) -> None:
        step = self.core.schedule()
        if step.plan.is_empty:
            # Requests that prefixes pinned after their arrival left without room fail alone;
            # any other empty step is a bookkeeping fault (never spin on it).
            if self.core.fail_unfittable():
                self._deliver_failures()
                return
            raise EngineStateError("scheduler produced an empty step with work pending")
        self._in_flight = True
        try:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._executor, self._execute, step)
        except Exception:
            log.exception("engine step failed; failing the requests in it")
            outputs = self.core.fail(step)
        else:
            outputs = self.core.process(step, result)
        finally:
            self._in_flight = False
        self._last_progress = time.monotonic()
        self._publish_kv_events()
        self._deliver(outputs)
        self._deliver_failures()
        for request_id in self._take_pending_aborts():
            self._abort(request_id)
        self.core.trim_heap()

    def _execute(self, step: StepPlan) -> StepResult:
        """The forward pass, on the step thread, with the thread count the governor chose."""
        self.threads.before_step()
        try:
            return self.core.execute(step)
        finally:
            self.threads.after_step()

    async def _restart(self, why: str) -> None:
        """Fails every request in flight and starts the core's bookkeeping afresh; raises
        EngineDeadError when restarts come too fast to be transient."""
        self._restart_reason = None
        now = time.monotonic()
        self._restart_times.append(now)
        while now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        if len(self._restart_times) > MAX_RESTARTS:
            raise EngineDeadError(f"{len(self._restart_times)} restarts within {RESTART_WINDOW_S:g} s; last: {why}")
        self.num_restarts += 1
        log.error("restarting the engine core (restart %d): %s", self.num_restarts, why)
        self._deliver_failures()  # requests whose own fault came first keep their own message
        self._pending_aborts.clear()
        await self._hold_pins_for_repin()
        for request_id in self.core.reset():
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_error(RequestFailedError(f"engine restarted: {why}"))
        self._publish_kv_events()  # AllBlocksCleared: the fresh block manager holds nothing
        self._state, self._reason = "restarting", f"restarting after: {why}"
        await asyncio.sleep(RESTART_BACKOFF_S)
        self._state, self._reason = "ready", None
        self._last_progress = time.monotonic()
        self._start_repin()

    def _take_pending_aborts(self) -> list[str]:
        aborts, self._pending_aborts = self._pending_aborts, []
        return aborts

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def _deliver_failures(self) -> None:
        for request_id, why in self.core.take_failures().items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(why, GrammarError):  # the request's own spec gave out: a client error
                stream.put_error(why)
            else:
                stream.put_error(RequestFailedError(f"request {request_id!r} failed inside the engine: {why}"))
