"""The engine streams of one HTTP request, side by side: a `/v1/completions` request with a
list of prompts runs each prompt as its own engine request, concurrently.

`first_outputs` waits for every stream's first output together, so a prompt the engine
refuses fails the whole request with a plain status before anything is sent; `merged` then
yields every output as it comes, tagged with its stream's index. Leaving either early
cancels what is still pending (a cancelled stream aborts its engine request); the caller
closes the streams themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

T = TypeVar("T")


async def first_outputs(streams: list[AsyncIterator[T]]) -> list[T]:
    """The first output of every stream; the first error among them is raised (the streams
    still waiting are cancelled). A stream that ends without output raises StopAsyncIteration."""
    tasks = [asyncio.ensure_future(anext(stream)) for stream in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        await _cancel(tasks)


async def merged(streams: list[AsyncIterator[T]], firsts: list[T]) -> AsyncIterator[tuple[int, T]]:
    """`firsts` (one per stream), then each stream's further outputs as they come, as
    (stream index, output) until every stream has ended; a stream's error is raised."""
    for i, first in enumerate(firsts):
        yield i, first
    if len(streams) == 1:  # no one to wait beside: no task per output
        async for item in streams[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):  # in stream order, for a stable output
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, item
    finally:
        await _cancel(pending)


async def _cancel(tasks: Iterable[asyncio.Future]) -> None:
    """Cancels the tasks and waits for them (their own errors are of no one's interest now; a
    cancellation of the caller still propagates)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
