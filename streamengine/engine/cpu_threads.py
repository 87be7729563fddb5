"""How many CPU threads the forward pass uses: as many as the machine actually gives it.

An embedded engine shares its CPU with the host application. Every parallel region of the
forward pass (a GEMM, an attention call, a fused element-wise step: hundreds per step) ends at
a barrier where all its threads meet, so one thread that the OS has descheduled to run another
process holds the whole team for a time slice, and the step slows far more than the CPU it
lost. With fewer threads than busy cores nobody waits at a barrier for a descheduled peer.

`ThreadGovernor` watches two signals over windows of stepping time and moves the thread count
by one at a time:
- down, when this process's threads spent a noticeable share of the window runnable but not
  running (the kernel's per-thread run delay, /proc/self/task/*/schedstat): other work holds
  our cores;
- up, when a CPU of this process's affinity set sat idle while the steps ran (/proc/stat):
  there is room for one more thread.
Where /proc is not Linux's, the governor does nothing and the count stays where it started.
`release_openmp_pool` frees the OpenMP pool a thread that no longer runs the forward pass holds.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

USER_HZ = 100  # /proc/stat counts in 1/100 s on every Linux architecture
WINDOW_S = 0.25  # stepping time between two decisions: tens of steps, and a quick reaction
DELAY_DOWN = 0.15  # run delay per thread, as a share of the window, that takes one thread away
IDLE_UP = 0.75  # idle CPUs seen during the steps that give one thread back
MAX_UP_AFTER = 32  # most windows in a row (8 s of steps) a raise may have to wait for


@dataclass(slots=True)
class Window:
    """What one window of steps saw."""

    step_s: float = 0.0  # wall time inside steps
    idle_cpu_s: float = 0.0  # idle time of the affinity CPUs during those steps
    run_delay_s: float = 0.0  # time this process's threads waited for a CPU (whole window)


def decide(threads: int, max_threads: int, window: Window) -> int:
    """The thread count for the next window."""
    if window.step_s <= 0:
        return threads
    if threads > 1 and window.run_delay_s / (window.step_s * threads) >= DELAY_DOWN:
        return threads - 1
    if threads < max_threads and window.idle_cpu_s / window.step_s >= IDLE_UP:
        return threads + 1
    return threads


class ProcCpu:
    """Reads the two signals from Linux's /proc; `available` is False elsewhere."""

    def __init__(self) -> None:
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._cpu_names = {f"cpu{i}".encode() for i in self.cpus}  # their /proc/stat lines
        self.available = bool(self.cpus) and os.path.exists("/proc/stat") and self._run_delay_ns() is not None

    def idle_s(self) -> float:
        """Idle plus iowait seconds of the affinity CPUs since boot."""
        total = 0
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu"):
                    break
                fields = line.split()
                if fields[0] in self._cpu_names:
                    total += int(fields[4]) + int(fields[5])
        return total / USER_HZ

    def run_delay_s(self) -> float:
        return (self._run_delay_ns() or 0) / 1e9

    @staticmethod
    def _run_delay_ns() -> int | None:
        """Summed run delay of this process's threads (the second field of schedstat)."""
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return None
        total = 0
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that ended meanwhile
        return total


class ThreadGovernor:
    """Sets the step thread's thread count before each step (call `before_step` and
    `after_step` from the thread that runs the forward pass: OpenMP's count is per thread)."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 proc: ProcCpu | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._set_threads = set_threads
        self._proc = proc if proc is not None else ProcCpu()
        self._clock = clock
        self._applied = 0  # the count last set in the step thread
        self._window = Window()
        self._window_delay0: float | None = None  # run delay at the window's start
        self._raised = False  # the last decision added a thread
        self._idle_windows = 0  # windows in a row that asked for one more thread
        self._up_after = 1  # how many such windows it takes: doubles when a raise fails
        self._step_start = 0.0
        self._idle_start = 0.0

    @property
    def active(self) -> bool:
        return self.max_threads > 1 and self._proc.available

    def before_step(self) -> None:
        if self._applied != self.threads:
            self._set_threads(self.threads)
            self._applied = self.threads
        if not self.active:
            return
        if self._window_delay0 is None:
            self._window_delay0 = self._proc.run_delay_s()
        self._step_start = self._clock()
        self._idle_start = self._proc.idle_s()

    def after_step(self) -> None:
        if not self.active or self._window_delay0 is None:
            return
        self._window.step_s += self._clock() - self._step_start
        self._window.idle_cpu_s += self._proc.idle_s() - self._idle_start
        if self._window.step_s < WINDOW_S:
            return
        self._window.run_delay_s = self._proc.run_delay_s() - self._window_delay0
        self.threads = self._next(decide(self.threads, self.max_threads, self._window))
        self._window, self._window_delay0 = Window(), None

    def _next(self, wanted: int) -> int:
        """`wanted` (one window's verdict), held back from adding a thread until as many windows
        in a row as `_up_after` asked for it. A CPU can look idle at the moment the scheduler
        has put our thread on the competitor's core; a thread added then is taken away again
        one window later, at a window's cost at the wrong width. Each such failed raise doubles
        the windows the next raise waits for (up to MAX_UP_AFTER); a raise that holds resets it."""
        raised, self._raised = self._raised, False
        if wanted < self.threads:
            if raised:
                self._up_after = min(MAX_UP_AFTER, 2 * self._up_after)
            self._idle_windows = 0
            return wanted
        if raised:
            self._up_after = 1
        if wanted == self.threads:
            self._idle_windows = 0
            return wanted
        self._idle_windows += 1
        if self._idle_windows < self._up_after:
            return self.threads
        self._idle_windows, self._raised = 0, True
        return wanted


def thread_governor(num_threads: int | None, device_type: str) -> ThreadGovernor:
    """The engine's governor: adaptive up to torch's thread count on CPU when `num_threads` is
    None; a fixed count otherwise (set in the step thread, where the forward pass runs)."""
    import torch

    if num_threads is not None or device_type != "cpu":
        fixed = num_threads if num_threads is not None else torch.get_num_threads()
        return ThreadGovernor(fixed, torch.set_num_threads, proc=_NoProc())
    return ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)


class _NoProc(ProcCpu):
    """A count that never moves."""

    def __init__(self) -> None:
        self.cpus, self.available = [], False


def release_openmp_pool() -> None:
    """Frees the calling thread's OpenMP thread pool, if torch's libgomp made one for it.

    Why: the forward pass runs on the step thread, which gets its own pool; loading the model
    on this thread left another. With more OpenMP threads alive than CPUs, libgomp throttles
    the spin-wait of idle workers to ~100 iterations, so each of the ~150 parallel regions of
    a step pays a futex wake-up. The pool comes back if this thread runs parallel torch work
    again.
    """
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # only the copy already loaded
        pause = gomp.omp_pause_resource_all  # OpenMP 5.0: libgomp of GCC >= 9
    except (OSError, AttributeError):
        return  # another OpenMP runtime, or none: nothing to release
    pause(1)  # omp_pause_soft
