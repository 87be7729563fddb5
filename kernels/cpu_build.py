"""Builds and loads the C++ CPU kernels (kernels/csrc) as one shared library on first use.

Every csrc/*.cpp is compiled once with g++ (-O3 -march=native -fopenmp) and linked into one
library in the kernel cache (`cache_dir()`), keyed by the sources, the flags and this CPU's
feature flags; later processes load it in milliseconds. The library is plain C ABI called
through ctypes (which releases the GIL), and its OpenMP resolves to the libgomp that torch has
already loaded, so it shares torch's threads.

The kernels are written once over a 16-lane vector (csrc/cpu_simd.h) that compiles to AVX-512,
or to AVX2 + FMA + F16C where the CPU has no AVX-512 (most AMD before Zen 4, Intel client
cores). STREAMENGINE_CPU_KERNELS selects: "1" (default) the best this CPU runs, "avx2" the AVX2
build even on an AVX-512 CPU (to test or compare it), "0" none. Where none can run (not x86-64,
neither instruction set, no compiler, a failed build, or "0") `load` returns None and callers
keep their PyTorch path. Which build runs, and why, is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
LIBRARY = "streamengine_cpu"
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
BUILD_TIMEOUT_S = 600  # every source in one compiler run, on a possibly busy machine


AVX2_FEATURES = frozenset({"avx2", "fma", "f16c"})
# The AVX2 build on a CPU that has AVX-512 too: -march=native minus every AVX-512 extension.
AVX2_ONLY_FLAGS = ["-mno-avx512f"]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot run (logged once)."""
    choice = os.environ.get("STREAMENGINE_CPU_KERNELS", "1")
    if choice == "0":
        log.info("cpu kernels: off (STREAMENGINE_CPU_KERNELS=0), using the PyTorch path")
        return None
    isa = instruction_set(choice)
    if isa is None:
        found = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c")))) or "none"
        log.info("cpu kernels: %s has neither AVX-512 nor AVX2 + FMA + F16C (found: %s), using the PyTorch path",
                 platform.machine(), found)
        return None
    try:
        path = build(extra_flags=AVX2_ONLY_FLAGS if isa == "avx2" and "avx512f" in cpu_flags() else [])
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cpu kernels: build failed, using the PyTorch path: %s", exc)
        return None
    log.info("cpu kernels: %s build%s", isa, " (STREAMENGINE_CPU_KERNELS=avx2)" if choice == "avx2" else "")
    return ctypes.CDLL(str(path))


def selected_instruction_set() -> str | None:
    """"avx512" or "avx2": the build `load` makes here under the current
    STREAMENGINE_CPU_KERNELS; None where it makes none."""
    choice = os.environ.get("STREAMENGINE_CPU_KERNELS", "1")
    return None if choice == "0" else instruction_set(choice)


def instruction_set(choice: str = "1") -> str | None:
    """"avx512" or "avx2": the build `load` makes here for STREAMENGINE_CPU_KERNELS=`choice`;
    None where the CPU runs neither."""
    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    if "avx512f" in flags and choice != "avx2":
        return "avx512"
    return "avx2" if AVX2_FEATURES <= flags else None


# Argument types of the C entry points (every one returns int: ctypes' default restype).
PTR, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def bind(signatures: dict[str, list], probe: str | None = None) -> ctypes.CDLL | None:
    """`load()` with each entry point's argument types declared; None also when the
    parameterless `probe` entry point returns 0 (a build with neither AVX-512 nor AVX2)."""
    lib = load()
    if lib is None or (probe is not None and getattr(lib, probe)() <= 0):
        return None
    for function, argtypes in signatures.items():
        getattr(lib, function).argtypes = argtypes
    return lib


def cache_dir() -> Path:
    """Where built libraries are kept: the engine's cache folder, found from the same variables
    ($STREAMENGINE_CACHE, else $XDG_CACHE_HOME/streamengine, else ~/.cache/streamengine), plus
    /kernels. Read here so that this package needs nothing from the engine."""
    base = os.environ.get("STREAMENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "streamengine"
    )
    return Path(base) / "kernels"


def build(sources: Path = SOURCES, out_dir: Path | None = None, extra_flags: list[str] | None = None) -> Path:
    """Compiles the .cpp files of `sources` into one library, once per (sources, flags, CPU
    flags); returns its path in `out_dir` (default `cache_dir()`). `extra_flags` follow
    COMPILE_FLAGS (e.g. AVX2_ONLY_FLAGS)."""
    flags = [*COMPILE_FLAGS, *(extra_flags or [])]
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++) on PATH")
    units = sorted(sources.glob("*.cpp"))
    out_dir = out_dir or cache_dir()
    target = out_dir / f"{LIBRARY}-{_build_key(sources, flags)}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, *map(str, units), "-o", tmp],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed on {sources}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _build_key(sources: Path, flags: list[str]) -> str:
    """A digest of every source and header, the flags and this CPU's feature flags."""
    files = sorted([*sources.glob("*.cpp"), *sources.glob("*.h")])
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags).encode() + b"\0" + " ".join(sorted(cpu_flags())).encode())
    return digest.hexdigest()[:16]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (read once; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()
