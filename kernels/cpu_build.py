"""Builds and loads the C++ CPU kernels of this folder (cpu_*.cpp) on first use.

Each source is compiled with g++ (-O3 -march=native -fopenmp) into the streamengine cache dir,
keyed by the source, the flags and this CPU's feature flags; later processes load it in
milliseconds. The libraries are plain C ABI called through ctypes (which releases the GIL),
and their OpenMP resolves to the libgomp that torch has already loaded, so they share torch's
threads. Where a kernel cannot run (not x86-64 with AVX-512, no compiler, a failed build, or
STREAMENGINE_CPU_KERNELS=0) `load` returns None and callers keep their PyTorch path.
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

from streamengine.config import default_cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled `name`.cpp of this folder, or None where it cannot run (logged once)."""
    if os.environ.get("STREAMENGINE_CPU_KERNELS", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64") or "avx512f" not in cpu_flags():
        log.info("cpu kernel %s: no AVX-512 here, using the PyTorch path", name)
        return None
    try:
        path = build(HERE / f"{name}.cpp")
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cpu kernel %s: build failed, using the PyTorch path: %s", name, exc)
        return None
    return ctypes.CDLL(str(path))


# Argument types of the C entry points (every one returns int: ctypes' default restype).
PTR, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def bind(name: str, signatures: dict[str, list], probe: str | None = None) -> ctypes.CDLL | None:
    """`load(name)` with each entry point's argument types declared; None also when the
    parameterless `probe` entry point returns 0 (a build without AVX-512)."""
    lib = load(name)
    if lib is None or (probe is not None and getattr(lib, probe)() <= 0):
        return None
    for function, argtypes in signatures.items():
        getattr(lib, function).argtypes = argtypes
    return lib


def build(source: Path, cache_dir: Path | None = None) -> Path:
    """Compiles `source` once per (source, flags, CPU flags); returns the shared library."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++) on PATH")
    # Sources may #include their siblings: the key covers every C++ file and header of the folder.
    files = sorted([*source.parent.glob("*.cpp"), *source.parent.glob("*.h")])
    text = b"".join(p.read_bytes() for p in files)
    key = hashlib.sha256(
        text + " ".join(COMPILE_FLAGS).encode() + " ".join(sorted(cpu_flags())).encode()
    ).hexdigest()[:16]
    out_dir = cache_dir or default_cache_dir() / "kernels"
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *COMPILE_FLAGS, str(source), "-o", tmp], capture_output=True, text=True, timeout=180
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
