"""GrammarCompiler: compiles structured-output specs into grammar.CompiledGrammar.

One per engine. Its compile threads are shared fairly by tenants (a queue per tenant,
queue.TenantQueues), and what they compile is cached per tenant, bounded in bytes
(cache.ByteLRU); a spec that does not compile keeps only its error message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import GbnfToLarkError

from streamengine.errors import EngineDeadError, GrammarError, GrammarOverloadedError

# grammar.grammar_text is looked up per compile: tests patch it there.
from streamengine.structured import grammar
from streamengine.structured.cache import ByteLRU, heap_bytes
from streamengine.structured.grammar import CompiledGrammar, _llg_error
from streamengine.structured.params import StructuredOutput, structured_key
from streamengine.structured.queue import TenantQueues
from streamengine.tenancy.tenants import DEFAULT_TENANT

# Short errors: the verbose ones carry the parser's state and the whole grammar.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_COMPILE_THREADS = 2  # one hostile spec still compiling leaves room for the others
_IDLE_EXIT_S = 60.0  # a compile thread idle this long exits (the next spec starts one again)
_MIN_ENTRY_BYTES = 16 * 1024  # what a cached grammar counts for at least, whatever was measured
_ENTRY_OVERHEAD_BYTES = 256  # a cached error message's record, beside its text and key
_ERROR_CACHE_BYTES = 1024 * 1024  # messages of specs that did not compile, all tenants
# A compile thread's niceness above the process's: where it shares a core with a decode step,
# the step gets about nine tenths of it (CFS weights 1024 against 110), so one tenant's slow
# regexes stretch other tenants' steps less; 10, not 19, so compiles under a saturated engine
# still progress within their timeout.
_COMPILE_NICE = 10


class GrammarCompiler:
    """Compiles specs for one tokenizer in `threads` compile threads that tenants share fairly.

    Cache: compiled grammars are kept per (tenant, spec), so a spec a tenant sends again
    compiles once, and no tenant can tell by timing whether another sent a spec. They are
    bounded to `cache_bytes` by each grammar's measured size, least recently used dropped first.
    A spec that does not compile keeps only its error message (a short, bounded list), so it
    fails fast when sent again; a compile that ran past `timeout_s` is not kept at all.

    Queue: specs wait per tenant and are compiled round robin across tenants (TenantQueues),
    at most `max_queued_per_tenant` waiting per tenant and `max_queued` in all; past either the
    caller gets GrammarOverloadedError (HTTP 429, Retry-After). The same spec sent again while
    it compiles waits for that compile.

    Time: a caller waits at most `queue_timeout_s` for its compile to start
    (GrammarOverloadedError), then at most `timeout_s` counted from that start (GrammarError):
    time spent behind other tenants' slow specs is never charged to it. llguidance cannot be
    interrupted, so a compile past its timeout runs on in its thread (llguidance bounds its
    work) and its result is dropped. A caller that stops waiting (cancelled, timed out) takes
    its spec out of the queue unless another caller waits for it.

    Size: the C heap's growth over the compile (cache.heap_bytes): llguidance keeps
    its grammar, lexer states and first mask in malloc'd memory, which tracemalloc never sees
    and which llguidance does not report. The heap is process-wide, so what other threads
    allocate or free during the compile shifts the figure by that much (the step thread's
    tensors mostly come and go within one step); each entry counts at least
    `_MIN_ENTRY_BYTES` plus its key.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, timeout_s: float, cache_bytes: int,
        *, max_queued_per_tenant: int = 64, max_queued: int = 256, queue_timeout_s: float = 30.0,
        threads: int = _COMPILE_THREADS,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width
        self.timeout_s = timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.threads = threads
        self._lock = threading.Lock()  # everything below and the workers' queue: held only briefly
        self._cache: ByteLRU[tuple[str, bytes], CompiledGrammar] = ByteLRU(cache_bytes)
        self._errors: ByteLRU[tuple[str, bytes], str] = ByteLRU(_ERROR_CACHE_BYTES)
        self._compiling: dict[tuple[str, bytes], _Job] = {}  # waiting or running, by (tenant, key)
        self._max_queued = (max_queued_per_tenant, max_queued)
        self._workers: _Workers | None = None
        self._mean_compile_s = 0.1  # moving average, for Retry-After
        self._tokenizer_lock = threading.Lock()  # the slow one-time build, never on the loop
        self._lltok: llguidance.LLTokenizer | None = None

    def compile(self, spec: StructuredOutput, tenant: str | None = None) -> CompiledGrammar:
        """`spec` compiled for `tenant` (None: the default tenant), from its cache or its
        compile queue, blocking this thread meanwhile."""
        job = self._submit(spec, tenant)
        if isinstance(job, CompiledGrammar):
            return job
        try:
            while not job.done.done():  # _wait_left raises past the deadline
                concurrent.futures.wait(job.events(), self._wait_left(job), concurrent.futures.FIRST_COMPLETED)
            return _unwrap(job.done.result())
        finally:
            self._leave(job)

    async def compile_async(self, spec: StructuredOutput, tenant: str | None = None) -> CompiledGrammar:
        """`compile` without blocking the event loop; a cancelled caller leaves the queue."""
        job = self._submit(spec, tenant)
        if isinstance(job, CompiledGrammar):
            return job
        try:
            while not job.done.done():  # _wait_left raises past the deadline
                await _wait_first(job.events(), self._wait_left(job))
            return _unwrap(job.done.result())
        finally:
            self._leave(job)

    def forget(self, spec: StructuredOutput, tenant: str | None = None) -> None:
        """Drops `tenant`'s compiled `spec` from the cache: its grammar failed a request while
        decoding, so keeping its memory serves nothing."""
        with self._lock:
            self._cache.pop((tenant or DEFAULT_TENANT, structured_key(spec)))

    def stats(self) -> dict[str, int]:
        """The cache's bytes and entries; the compiles waiting for a thread, and running (those
        past their timeout included, until they end); the compile threads alive."""
        with self._lock:
            workers = self._workers
            waiting = len(workers.queue) if workers is not None else 0
            return {
                "grammar_cache_bytes": self._cache.nbytes,
                "grammar_cache_entries": len(self._cache),
                "grammar_compiles_waiting": waiting,
                "grammar_compiles_running": len(self._compiling) - waiting,
                "grammar_compile_threads": workers.live if workers is not None else 0,
            }

    def shutdown(self) -> None:
        """Stops the compile threads: specs still waiting fail with EngineDeadError, a compile
        still running finishes on its own (its callers get its result). A later compile starts
        new threads."""
        with self._lock:
            workers, self._workers = self._workers, None
            if workers is None:
                return
            workers.stopped = True
            dropped = workers.queue.clear()
            for job in dropped:
                del self._compiling[job.tenant, job.key]
            workers.wake.notify_all()
        for job in dropped:
            job.done.set_exception(EngineDeadError("the engine stopped while the spec waited to compile"))

    # -- callers' side ---------------------------------------------------------------------

    def _submit(self, spec: StructuredOutput, tenant: str | None) -> CompiledGrammar | _Job:
        """The cached grammar, or the job that compiles it (joined, or queued now). Raises
        GrammarError for a spec known not to compile, GrammarOverloadedError when the queue is full."""
        tenant = tenant or DEFAULT_TENANT
        key = structured_key(spec)
        with self._lock:
            grammar = self._cache.get((tenant, key))
            if grammar is not None:
                return grammar
            error = self._errors.get((tenant, key))
            if error is not None:
                raise GrammarError(error)
            job = self._compiling.get((tenant, key))
            if job is not None:
                job.waiters += 1
                return job
            workers = self._running_workers()
            if (bound := workers.queue.full(tenant)) is not None:
                raise self._full_error(bound, workers.queue.waiting(tenant))
            job = self._compiling[tenant, key] = _Job(tenant, key, spec, time.monotonic())
            workers.queue.put(tenant, job)
            workers.wake.notify()
            return job

    def _wait_left(self, job: _Job) -> float:
        """How long `job`'s caller may still wait: until `queue_timeout_s` after it was queued
        while it waits, then until `timeout_s` after its compile started. Raises past that."""
        with self._lock:
            started = job.started_at
        now = time.monotonic()
        if started is None:
            left = job.queued_at + self.queue_timeout_s - now
            if left <= 0:
                raise GrammarOverloadedError(
                    "grammar_queue_timeout_s",
                    f"the structured-output spec waited {self.queue_timeout_s:g} s for a compile thread "
                    f"(EngineConfig.grammar_queue_timeout_s): the grammar compiler is busy",
                    retry_after=self._retry_after(1),
                )
            return left
        left = started + self.timeout_s - now
        if left <= 0:
            raise GrammarError(f"the structured-output spec did not compile within {self.timeout_s:g} s")
        return left

    def _leave(self, job: _Job) -> None:
        """A caller stops waiting for `job`: the last one takes it out of the queue if it has
        not started (its result would serve no one)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.started_at is not None or job.done.done():
                return
            workers = self._workers
            if workers is not None and workers.queue.remove(job.tenant, job):
                del self._compiling[job.tenant, job.key]

    def _full_error(self, bound: str, waiting: int) -> GrammarOverloadedError:
        per_tenant, total = self._max_queued
        retry_after = self._retry_after(waiting)
        if bound == "per_tenant":
            return GrammarOverloadedError(
                "grammar_max_queued_per_tenant",
                f"{waiting} structured-output specs of this tenant already wait to compile "
                f"(EngineConfig.grammar_max_queued_per_tenant={per_tenant}); retry in {retry_after:g} s",
                retry_after=retry_after,
            )
        return GrammarOverloadedError(
            "grammar_max_queued",
            f"{total} structured-output specs already wait to compile (EngineConfig.grammar_max_queued="
            f"{total}); retry in {retry_after:g} s",
            retry_after=retry_after,
        )

    def _retry_after(self, waiting: int) -> float:
        """Seconds until `waiting` compiles are likely done at the recent pace: at least 1 s,
        at most one compile timeout."""
        return float(round(min(max(1.0, self._mean_compile_s * waiting / self.threads), max(1.0, self.timeout_s))))

    # -- compile threads' side -------------------------------------------------------------

    def _running_workers(self) -> _Workers:
        """The compile threads (under the lock), started or topped up to `threads`."""
        workers = self._workers
        if workers is None:
            per_tenant, total = self._max_queued
            workers = self._workers = _Workers(TenantQueues(per_tenant, total), threading.Condition(self._lock))
        while workers.live < self.threads:
            workers.live += 1
            name = f"streamengine-grammar-{workers.live}"
            threading.Thread(target=self._work, args=(workers,), name=name, daemon=True).start()
        return workers

    def _work(self, workers: _Workers) -> None:
        """One compile thread: takes jobs until shut down, or idle for `_IDLE_EXIT_S` (an idle
        compiler holds no threads)."""
        _lower_priority(_COMPILE_NICE)
        while (job := self._next_job(workers)) is not None:
            try:
                self._run(job)
            finally:
                with self._lock:
                    workers.queue.finished(job.tenant)
            # Not held while waiting for the next job: its result may be a grammar of tens of
            # MB that the cache has dropped or never kept.
            del job

    def _next_job(self, workers: _Workers) -> _Job | None:
        with workers.wake:
            while not workers.stopped:
                taken = workers.queue.take()
                if taken is not None:
                    return taken[1]
                if not workers.wake.wait(_IDLE_EXIT_S) and not len(workers.queue):
                    break
            workers.live -= 1
            return None

    def _run(self, job: _Job) -> None:
        """Compiles `job` (in a compile thread), keeps what is worth keeping, wakes its callers."""
        try:
            self._tokenizer()  # once per compiler, before the clock starts: it bounds the spec's work only
            with self._lock:
                job.started_at = time.monotonic()
            job.started.set_result(job.started_at)  # its callers' clocks restart from here
            before = heap_bytes()
            result = self._build(job.spec)
            after = heap_bytes()
        except Exception as exc:  # the narrow-logits GrammarError, or a bug: its callers get it
            with self._lock:
                self._compiling.pop((job.tenant, job.key), None)
            job.done.set_exception(exc)
            return
        elapsed = time.monotonic() - job.started_at
        size = max(after - before, 0) if before is not None and after is not None else 0
        with self._lock:
            self._mean_compile_s += 0.2 * (elapsed - self._mean_compile_s)
            self._compiling.pop((job.tenant, job.key), None)
            self._keep(job, result, size, elapsed)
        job.done.set_result(result)

    def _keep(self, job: _Job, result: CompiledGrammar | str, size: int, elapsed: float) -> None:
        """Caches a grammar compiled within the timeout, or a failure's message (under the lock)."""
        key = (job.tenant, job.key)
        if isinstance(result, str):
            self._errors.put(key, result, len(result) + len(job.key) + _ENTRY_OVERHEAD_BYTES)
        elif elapsed <= self.timeout_s:
            self._cache.put(key, result, max(size, _MIN_ENTRY_BYTES) + len(job.key))

    def _build(self, spec: StructuredOutput) -> CompiledGrammar | str:
        """The compiled grammar, or why the spec does not compile (runs in a compile thread)."""
        try:
            text = grammar.grammar_text(spec)
        except (ValueError, GbnfToLarkError) as exc:
            return f"invalid structured-output spec: {exc}"
        matcher = llguidance.LLMatcher(self._tokenizer(), text, log_level=0, limits=_LIMITS)
        if not matcher.is_error():
            # The first mask builds the lexer's first states: here, within the timeout and
            # for every copy, rather than in a decode step that the whole batch waits for;
            # a spec that exhausts llguidance's limits there fails now, as a bad spec.
            matcher.compute_bitmask()
        if matcher.is_error():
            return f"invalid structured-output spec: {_llg_error(matcher)}"
        return CompiledGrammar(matcher)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built on first use (it takes a while)."""
        with self._tokenizer_lock:
            if self._lltok is None:
                if len(self.tokenizer) > self.vocab_size:
                    raise GrammarError(
                        f"the model's logits ({self.vocab_size} tokens) are narrower than its tokenizer "
                        f"({len(self.tokenizer)} tokens): structured outputs cannot mask them"
                    )
                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            return self._lltok


@dataclass(slots=True, eq=False)
class _Job:
    """One spec of one tenant, waiting or compiling; every caller sending it waits on `done`."""

    tenant: str
    key: bytes  # structured_key(spec)
    spec: StructuredOutput
    queued_at: float
    started_at: float | None = None  # when a compile thread started it (under the lock)
    waiters: int = 1  # callers waiting for it (under the lock)
    started: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # started_at
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # CompiledGrammar | str

    def events(self) -> list[concurrent.futures.Future]:
        """What its callers wait for next: its start (which changes their deadline), its end."""
        return [self.done] if self.started.done() else [self.started, self.done]


@dataclass(slots=True, eq=False)
class _Workers:
    """A compiler's compile threads and their queue; shutdown replaces them with a fresh set."""

    queue: TenantQueues[_Job]
    wake: threading.Condition  # on the compiler's lock: a job was queued, or shutdown
    live: int = 0  # threads started and not yet exited
    stopped: bool = False


async def _wait_first(futures: list[concurrent.futures.Future], timeout_s: float) -> None:
    """Waits until one of `futures` (completed by a compile thread) is done, or `timeout_s`
    passed. Unlike asyncio.wrap_future, giving up never cancels them: others may wait too."""
    loop = asyncio.get_running_loop()
    woken = loop.create_future()

    def wake(_: concurrent.futures.Future) -> None:
        try:
            loop.call_soon_threadsafe(_set_if_pending, woken)
        except RuntimeError:  # the loop closed: no one waits any more
            pass

    for future in futures:
        future.add_done_callback(wake)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(woken, timeout_s)


def _set_if_pending(woken: asyncio.Future) -> None:
    if not woken.done():
        woken.set_result(None)


def _unwrap(result: CompiledGrammar | str) -> CompiledGrammar:
    if isinstance(result, str):
        raise GrammarError(result)
    return result


def _lower_priority(nice: int) -> None:
    """Raises the calling thread's niceness by `nice` (Linux, where a thread id names one thread
    for setpriority; elsewhere it would renice the whole process, so nothing is done)."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
