"""Linear layers with weights packed once for the CPU GEMM in cpu_gemm.cpp.

`make_linear(weight, bias)` returns a `PackedLinear` when the kernel can run here (x86-64 with
AVX-512, a C++ compiler, float32 on CPU) and a `TorchLinear` (plain `F.linear`) otherwise, so
callers never branch. The shared library is compiled on first use with g++ and kept under the
streamengine cache dir, keyed by the source and this CPU's flags; later processes load it in
milliseconds. Set STREAMENGINE_CPU_GEMM=0 to force the PyTorch path (for A/B measurements).

Packed layout: panels of `width` (48) output columns, k-major: [N_padded / width, K, width].
Rows up to SMALL_M_MAX run through the kernel (one pass over the weights); larger batches
(prefill) run as one batched matmul over the same panels, which MKL handles at full speed, so
no unpacked copy of the weights is kept.
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

import torch
import torch.nn.functional as F

from streamengine.config import default_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
SMALL_M_MAX = 128  # measured crossover with the batched matmul is ~128-256 rows on 2 cores
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


class TorchLinear:
    """F.linear over the original weight: the fallback with the same call signature."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    """y = x @ W^T + b with W stored as k-major panels (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        self.out_features, self.in_features = weight.shape
        self.width = lib.streamengine_panel_width()
        self.padded = -(-self.out_features // self.width) * self.width
        self.panels = pack_panels(weight, self.width)  # [P, K, width]
        self.bias = bias
        self._lib = lib

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected [M, {self.in_features}] input, got {list(x.shape)}")
        x = x.contiguous()
        m = x.shape[0]
        if m <= SMALL_M_MAX:
            y = torch.empty((m, self.padded), dtype=x.dtype)  # [M, N_padded]
            rc = self._lib.streamengine_sgemm_packed(
                x.data_ptr(), m, self.in_features, self.panels.data_ptr(), self.padded, y.data_ptr()
            )
            if rc != 0:
                raise RuntimeError(f"cpu gemm rejected shape M={m} K={self.in_features} N={self.padded}")
        else:
            # [P, M, width] -> [M, P * width]
            y = torch.matmul(x, self.panels).transpose(0, 1).reshape(m, self.padded)
        if self.padded != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / width), K, width], zero-padded past N."""
    n, k = weight.shape
    padded = -(-n // width) * width
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    return weight.reshape(padded // width, width, k).transpose(1, 2).contiguous()


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | TorchLinear:
    """The fastest linear available for this weight here."""
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    lib = load_library() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
    if lib is None:
        return TorchLinear(weight, bias)
    return PackedLinear(weight, bias, lib)


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot run (logged once per process)."""
    if os.environ.get("STREAMENGINE_CPU_GEMM", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64") or "avx512f" not in cpu_flags():
        log.info("cpu gemm: no AVX-512 here, using torch matmul")
        return None
    try:
        path = build_library()
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("cpu gemm: build failed (%s), using torch matmul", exc)
        return None
    lib = ctypes.CDLL(str(path))
    lib.streamengine_panel_width.restype = ctypes.c_int
    lib.streamengine_sgemm_packed.restype = ctypes.c_int
    lib.streamengine_sgemm_packed.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
    ]
    if lib.streamengine_panel_width() <= 0:
        return None
    return lib


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_library(cache_dir: Path | None = None) -> Path:
    """Compiles cpu_gemm.cpp once per (source, compiler flags, CPU flags); returns the .so."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++) on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join(COMPILE_FLAGS).encode() + " ".join(sorted(cpu_flags())).encode()
    ).hexdigest()[:16]
    out_dir = cache_dir or default_cache_dir() / "kernels"
    target = out_dir / f"cpu_gemm-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *COMPILE_FLAGS, str(SOURCE), "-o", tmp],
            check=True, capture_output=True, timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target

