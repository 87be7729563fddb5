"""The C++ kernels' AVX2 build, tested on a CPU that would otherwise only run the AVX-512 one.

Every kernel is written once over cpu_simd.h's 16-lane vector, which compiles to AVX-512 or to
AVX2 + FMA + F16C. On an AVX2-only CPU the kernel tests below already run the AVX2 build; on an
AVX-512 CPU this test reruns them in a fresh process with STREAMENGINE_CPU_KERNELS=avx2 (the
library is loaded once per process), so both builds are checked against the same references.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from streamengine.kernels import cpu_build

TESTS = Path(__file__).parent
KERNEL_TESTS = ["test_quant_gemm.py", "test_cpu_decode_kernel.py", "test_cpu_prefill_attention.py",
                "test_packed_weights.py", "test_lora_kernels.py", "test_cpu_fp8_kv.py"]


@pytest.mark.skipif(cpu_build.instruction_set() != "avx512" or cpu_build.instruction_set("avx2") != "avx2",
                    reason="the AVX2 build is the one the kernel tests run here, or neither runs")
def test_kernel_tests_pass_on_the_avx2_build() -> None:
    env = {**os.environ, "STREAMENGINE_CPU_KERNELS": "avx2"}
    # Only the C++ kernels depend on the instruction set: the Triton LoRA tests (interpreted) stay
    # out, and so do the builds for older CPUs, which set their own -march whatever the setting
    # (two full compiles, ~20 s, the same as in the main run), and the AMX path, which the AVX2
    # build does not have (its tests would skip).
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-k", "not triton and not builds_for_older_cpus and not amx", *(str(TESTS / t) for t in KERNEL_TESTS)]
    proc = subprocess.run(cmd, env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=1200)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    # The rerun must really run the kernel tests, not skip them (a build that failed skips them).
    assert proc.returncode == 0 and " passed" in summary and "skipped" not in summary, \
        proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("flags, default, forced", [
    ({"avx512f", "avx2", "fma", "f16c"}, "avx512", "avx2"),
    ({"avx2", "fma", "f16c"}, "avx2", "avx2"),
    ({"avx", "avx2", "fma"}, None, None),  # no F16C: the float16 KV cache could not be read
    (set(), None, None),
])
def test_the_build_follows_the_cpu_and_the_setting(monkeypatch, flags, default, forced) -> None:
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    assert cpu_build.instruction_set() == default
    assert cpu_build.instruction_set("avx2") == forced
    monkeypatch.setenv("STREAMENGINE_CPU_KERNELS", "0")
    assert cpu_build.selected_instruction_set() is None
