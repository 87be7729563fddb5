"""Runs tests/test_kernels.py in a fresh process when it cannot run in this one.

The Triton interpreter has to be switched on (TRITON_INTERPRET=1) before triton is first
imported. In a full test session on CPU something may import triton in compiled mode before
tests/test_kernels.py is collected (torch._dynamo does, pulled in by transformers); that module
then skips itself, and this test reruns it where the interpreter is on from the start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamengine import kernels as K

KERNEL_TESTS = Path(__file__).with_name("test_kernels.py")


@pytest.mark.skipif(K.triton_available(), reason="tests/test_kernels.py runs in this process")
def test_kernel_tests_in_interpreter_subprocess(request: pytest.FixtureRequest) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(KERNEL_TESTS)]
    markexpr = request.config.getoption("markexpr")
    if markexpr:
        cmd += ["-m", markexpr]
    proc = subprocess.run(
        cmd, env=env, cwd=KERNEL_TESTS.parents[1], capture_output=True, text=True, timeout=900
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    # The rerun must really run the kernel tests, not skip them all again.
    assert proc.returncode == 0 and " passed" in summary, proc.stdout[-4000:] + proc.stderr[-4000:]
