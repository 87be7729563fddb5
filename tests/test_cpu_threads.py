"""The CPU thread governor: the forward pass's thread count follows the CPU actually available."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from streamengine.engine.cpu_threads import (
    DELAY_DOWN,
    IDLE_UP,
    WINDOW_S,
    ProcCpu,
    ThreadGovernor,
    Window,
    decide,
)


def test_decide_takes_a_thread_away_when_threads_wait_for_a_cpu():
    waited = Window(step_s=1.0, idle_cpu_s=0.0, run_delay_s=2 * DELAY_DOWN)  # per thread: DELAY_DOWN
    assert decide(2, 2, waited) == 1
    assert decide(1, 2, waited) == 1  # never below one
    barely = Window(step_s=1.0, idle_cpu_s=0.0, run_delay_s=2 * DELAY_DOWN * 0.9)
    assert decide(2, 2, barely) == 2


def test_decide_gives_a_thread_back_when_a_cpu_sat_idle():
    idle = Window(step_s=1.0, idle_cpu_s=IDLE_UP, run_delay_s=0.0)
    assert decide(1, 2, idle) == 2
    assert decide(2, 2, idle) == 2  # never above the maximum
    assert decide(1, 2, Window(step_s=1.0, idle_cpu_s=IDLE_UP * 0.9)) == 1
    assert decide(1, 2, Window()) == 1  # no steps: no evidence


class FakeProc:
    available = True

    def __init__(self) -> None:
        self.idle = 0.0
        self.delay = 0.0

    def idle_s(self) -> float:
        return self.idle

    def run_delay_s(self) -> float:
        return self.delay


def run_steps(governor: ThreadGovernor, proc: FakeProc, clock: list[float], n: int,
              idle_per_step: float, delay_per_step: float, step_s: float = 0.01) -> None:
    for _ in range(n):
        governor.before_step()
        clock[0] += step_s
        proc.idle += idle_per_step
        proc.delay += delay_per_step
        governor.after_step()


def test_governor_follows_a_competitor_that_comes_and_goes():
    proc, clock, applied = FakeProc(), [0.0], []
    governor = ThreadGovernor(2, applied.append, proc=proc, clock=lambda: clock[0])
    steps = int(WINDOW_S / 0.01) + 1
    run_steps(governor, proc, clock, steps, idle_per_step=0.0, delay_per_step=0.0)  # quiet, both busy
    assert governor.threads == 2
    run_steps(governor, proc, clock, steps, idle_per_step=0.0, delay_per_step=0.01)  # a competitor
    assert governor.threads == 1
    run_steps(governor, proc, clock, 2, idle_per_step=0.0, delay_per_step=0.0)
    assert applied == [2, 1]  # set in the step thread before the next step, once per change
    run_steps(governor, proc, clock, steps, idle_per_step=0.0, delay_per_step=0.0)  # still shared
    assert governor.threads == 1
    # It left: a CPU of ours sits idle during our steps (two windows: the first may have begun
    # with steps before it left).
    run_steps(governor, proc, clock, 2 * steps, idle_per_step=0.009, delay_per_step=0.0)
    assert governor.threads == 2


def test_raises_that_fail_back_off():
    """A CPU that looks idle at one thread but is not there at two (the scheduler parked our
    thread on the competitor's core for a while): each failed raise doubles the wait for the
    next, so few windows are spent at the wrong width."""
    proc, clock = FakeProc(), [0.0]
    governor = ThreadGovernor(2, lambda n: None, proc=proc, clock=lambda: clock[0])
    steps = int(WINDOW_S / 0.01) + 1
    raises, at_two = 0, 0
    for _ in range(64):
        before = governor.threads
        if before == 1:
            run_steps(governor, proc, clock, steps, idle_per_step=0.009, delay_per_step=0.0)
        else:
            at_two += 1
            run_steps(governor, proc, clock, steps, idle_per_step=0.0, delay_per_step=0.01)
        raises += governor.threads > before
    assert governor.threads in (1, 2)
    assert raises <= 6 and at_two <= 7, (raises, at_two)  # without the back-off: 32 of 64


def test_governor_without_proc_keeps_its_count():
    proc = FakeProc()
    proc.available = False
    applied: list[int] = []
    governor = ThreadGovernor(2, applied.append, proc=proc)
    for _ in range(3):
        governor.before_step()
        governor.after_step()
    assert governor.threads == 2 and applied == [2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_proc_cpu_sees_this_process_wait_for_a_cpu():
    """With a spinning process on every CPU of ours, our own spinning thread waits for a CPU."""
    proc = ProcCpu()
    assert proc.available
    idle0, delay0 = proc.idle_s(), proc.run_delay_s()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in proc.cpus]
    try:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert proc.run_delay_s() - delay0 > 0.02
    assert proc.idle_s() >= idle0


async def test_engine_runs_each_step_with_the_governors_count(tiny_llama_dir):
    import torch

    from streamengine import AsyncEngine, EngineConfig, SamplingParams

    # Two threads to take one away, whatever an earlier test in this process left (an engine
    # with num_threads=1 sets one for the whole process): the governor starts from this count.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []
    try:
        async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=16)) as engine:
            assert engine.threads.max_threads == 2
            execute = engine.core.execute

            def recording(step):
                seen.append(torch.get_num_threads())
                return execute(step)

            engine.core.execute = recording
            engine.threads.threads = 1  # as after a window in which our threads waited for a CPU
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)):
                pass
    finally:
        torch.set_num_threads(num_threads)
    assert seen and set(seen) == {1}
