"""Worker threads shared fairly between clients: each client's jobs wait in their own queue; a
free worker takes the next job of the next client in turn (round robin), and a client whose
job is running waits for it to end before its turn comes again. So a client with many long
jobs (huge prompts to tokenize) holds at most one worker, and delays another client's job by
at most the job it is running, never by its backlog.

All bookkeeping happens on the event loop (no locks): a job is handed to the executor only when
a worker is free, and each job's end hands the next one over.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[[], Any], asyncio.Future]


class FairPool:
    def __init__(self, workers: int, thread_name_prefix: str) -> None:
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, got {workers}")
        self.workers = workers
        self._prefix = thread_name_prefix
        self._executor: ThreadPoolExecutor | None = None
        self._queues: dict[str, deque[_Job]] = {}  # clients with jobs not started
        self._turn: OrderedDict[str, None] = OrderedDict()  # those of them with no job running, in turn
        self._running: set[str] = set()

    async def run(self, client: str, fn: Callable[[], T]) -> T:
        """`fn()` in a worker thread, in `client`'s turn. Cancelling the caller before the job
        started drops it; a job already running finishes in its thread."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(client, deque()).append((fn, done))
        if client not in self._running:
            self._turn[client] = None  # (already in turn: keeps its place)
        self._dispatch()
        return await done

    def pending(self) -> int:
        """Jobs not started yet, of every client."""
        return sum(len(queue) for queue in self._queues.values())

    def close(self) -> None:
        for queue in self._queues.values():
            for _, done in queue:
                done.cancel()
        self._queues.clear()
        self._turn.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _dispatch(self) -> None:
        while len(self._running) < self.workers and self._turn:
            client, _ = self._turn.popitem(last=False)
            job = self._next_job(client)
            if job is None:
                continue
            fn, done = job
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=self._prefix)
            self._running.add(client)
            running = asyncio.get_running_loop().run_in_executor(self._executor, fn)
            running.add_done_callback(lambda job, client=client, done=done: self._finished(client, job, done))

    def _next_job(self, client: str) -> _Job | None:
        """The client's oldest job whose caller still waits (cancelled ones are dropped)."""
        queue = self._queues.get(client)
        while queue:
            fn, done = queue.popleft()
            if not done.done():
                if not queue:
                    del self._queues[client]
                return fn, done
        self._queues.pop(client, None)
        return None

    def _finished(self, client: str, job: asyncio.Future, done: asyncio.Future) -> None:
        self._running.discard(client)
        if client in self._queues:
            self._turn[client] = None  # to the back of the turn
        if not done.done():
            if job.cancelled():
                done.cancel()
            elif (exc := job.exception()) is not None:
                done.set_exception(exc)
            else:
                done.set_result(job.result())
        self._dispatch()
