"""The compiled-grammar cache: least recently used, bounded in bytes, and how an entry's bytes
are measured.

A compiled grammar's size varies by five orders of magnitude (a small JSON schema takes kilobytes,
a regex such as `(a{1000}){1000}` keeps about 180 MB of lexer states), so a bound on the
number of entries bounds nothing: the cache holds each entry with its measured size and drops the
least recently used until the total fits its budget. An entry larger than the whole budget is not
kept: it would evict everything else and still not fit.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """Values with a size each, at most `budget` bytes in all. Not thread-safe: its owner locks."""

    __slots__ = ("budget", "nbytes", "_entries")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nbytes = 0  # the sum of the kept entries' sizes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The value under `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, nbytes: int) -> bool:
        """Keeps `value` as the most recently used, evicting the least recently used until the
        total fits; False (nothing kept, nothing evicted) when `nbytes` alone exceeds the budget."""
        self.pop(key)
        if nbytes > self.budget:
            return False
        while self._entries and self.nbytes + nbytes > self.budget:
            _, (_, size) = self._entries.popitem(last=False)
            self.nbytes -= size
        self._entries[key] = (value, nbytes)
        self.nbytes += nbytes
        return True

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry[1]
        return entry[0]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


def _find_mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc 2.33 and later
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _find_mallinfo2()  # looked up once, never changed
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def heap_bytes() -> int | None:
    """Bytes the process's C heap holds now, or None where that cannot be read.

    llguidance is Rust on the system allocator, so what a compile keeps is malloc'd memory that
    Python's tracemalloc never sees. glibc's mallinfo2 gives the bytes in use in every arena plus
    the mmapped chunks, which drop again when a grammar is freed; elsewhere the resident set
    (/proc/self/statm) stands in, which only grows, so it can count a compile that reuses freed
    memory as smaller than it is. Either is process-wide: see GrammarCompiler for what that means.
    """
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        return info.uordblks + info.hblkhd
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_size_t]
    return fn


_MALLOC_TRIM = _find_malloc_trim()  # looked up once, never changed


class HeapTrim:
    """Hands the C heap's free pages back to the system, at most every `interval_s`.

    A hostile grammar's lexer states take hundreds of megabytes of malloc'd memory in the compile
    and step threads; glibc keeps what is freed in each thread's arena for reuse, so the process
    would stay as large as its worst moment. Trimming after such memory is freed returns it.
    Does nothing where malloc_trim is not glibc's."""

    def __init__(self, interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = -interval_s
        self.num_trims = 0

    def maybe(self) -> bool:
        """Trims unless it did within `interval_s`; True when it trimmed."""
        now = self._clock()
        if _MALLOC_TRIM is None or now - self._last < self.interval_s:
            return False
        self._last = now
        _MALLOC_TRIM(0)
        self.num_trims += 1
        return True
