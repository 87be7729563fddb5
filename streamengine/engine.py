"""AsyncEngine: the engine inside the caller's event loop.

One owned background task runs the step loop: schedule (loop thread), forward pass (worker
thread, so the loop stays responsive while torch computes), postprocess (loop thread), then
hand each request's latest output to its stream. Aborts that arrive while a forward pass is in
flight are applied right after it, so the worker never sees a block table change under it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from streamengine.config import EngineConfig
from streamengine.errors import EngineDeadError
from streamengine.core import EngineCore
from streamengine.models import LoadedModel
from streamengine.outputs import RequestOutput
from streamengine.sampling import SamplingParams

log = logging.getLogger(__name__)


class _RequestStream:
    """Latest output of one request. Outputs are cumulative, so a slow consumer loses nothing
    when a newer output replaces one it has not read yet."""

    __slots__ = ("_latest", "_error", "_ready")

    def __init__(self) -> None:
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._latest is None or not self._latest.finished:
            self._latest = output
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        if self._latest is not None:
            output, self._latest = self._latest, None
            return output
        assert self._error is not None  # _ready is only set by put or put_error
        raise self._error


def release_openmp_pool() -> None:
    """Frees the calling thread's OpenMP thread pool, if torch's libgomp made one for it.

    Why: the forward pass runs on the step thread, which gets its own pool; loading the model
    on this thread left another. With more OpenMP threads alive than CPUs, libgomp throttles
    the spin-wait of idle workers to ~100 iterations, so each of the ~150 parallel regions of
    a step pays a futex wake-up: measured 45 ms instead of 37 ms per SmolLM2 decode step on 2
    cores. The pool comes back if this thread runs parallel torch work again.
    """
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # only the copy already loaded
        pause = gomp.omp_pause_resource_all  # OpenMP 5.0: libgomp of GCC >= 9
    except (OSError, AttributeError):
        return  # another OpenMP runtime, or none: nothing to release
    pause(1)  # omp_pause_soft


class AsyncEngine:
    """`async with AsyncEngine(config) as engine:` then `async for out in engine.generate(...)`."""

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self.core = EngineCore(self.config, loaded)
        self._streams: dict[str, _RequestStream] = {}
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight = False
        self._pending_aborts: list[str] = []

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_name(self) -> str:
        return self.core.loaded.name

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self.is_running:
            raise RuntimeError("engine already started")
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="streamengine-step")
        release_openmp_pool()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="streamengine-step-loop")

    async def stop(self) -> None:
        """Stops the step loop, waits for a forward pass in flight, aborts every request."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, True)
            self._executor = None
        self._in_flight = False
        for request_id in list(self.core.requests):
            self.core.abort_request(request_id)
        for stream in self._streams.values():
            stream.put_error(EngineDeadError("engine stopped"))
        self._streams.clear()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # -- requests ------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams cumulative outputs of one request, one per engine step (coalesced when the
        consumer is slower). Leaving early (break, cancel, error) aborts it and frees its blocks."""
        if not self.is_running:
            raise RuntimeError("engine is not running: use `async with engine:` or `await engine.start()`")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        self.core.add_request(request_id, prompt, params, cache_salt)  # raises ValueError
        stream = self._streams[request_id] = _RequestStream()
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Ends a request with finish_reason "abort"; its stream yields that final output."""
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if self._in_flight:
            self._pending_aborts.append(request_id)
            return
        output = self.core.abort_request(request_id)
        stream = self._streams.get(request_id)
        if output is not None and stream is not None:
            stream.put(output)

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
        try:
            await self._step_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in scheduling or postprocessing: fail loudly, not hang
            log.exception("engine step loop died")
            for stream in self._streams.values():
                stream.put_error(EngineDeadError(f"engine step loop died: {exc!r}"))
            raise

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.core.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            step = self.core.schedule()
            if step.plan.is_empty:  # cannot happen while intake checks lengths; never spin
                raise RuntimeError("scheduler produced an empty step with work pending")
            self._in_flight = True
            try:
                result = await loop.run_in_executor(self._executor, self.core.execute, step)
            except Exception:
                log.exception("engine step failed; failing the requests in it")
                outputs = self.core.fail(step)
            else:
                outputs = self.core.process(step, result)
            finally:
                self._in_flight = False
            self._deliver(outputs)
            for request_id in self._take_pending_aborts():
                self._abort(request_id)
            await asyncio.sleep(0)  # let consumers run between steps even if the thread was instant

    def _take_pending_aborts(self) -> list[str]:
        aborts, self._pending_aborts = self._pending_aborts, []
        return aborts

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
