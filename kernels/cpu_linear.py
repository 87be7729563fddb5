"""Linear layers with weights packed once for the CPU GEMM in csrc/cpu_gemm.cpp.

`make_linear(weight, bias)` returns a `PackedLinear` when the kernel can run here (x86-64 with
AVX-512 or AVX2, a C++ compiler, float32 on CPU) and a `TorchLinear` (plain `F.linear`) otherwise, so
callers never branch. kernels/cpu_build.py compiles the library on first use; set
STREAMENGINE_CPU_KERNELS=0 to force the PyTorch path (for A/B measurements).

Packed layout: panels of `width` (48) output columns, k-major: [N_padded / width, K, width].
Rows up to SMALL_M_MAX run through the kernel (one pass over the weights); larger batches
(prefill) run as one batched matmul over the same panels, which MKL handles at full speed, so
no unpacked copy of the weights is kept.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from . import cpu_build
from .cpu_build import I64, PTR

# The kernel matches or beats the batched matmul up to this many rows. Measured per build: the
# AVX-512 one (8-row register tiles) to 1,024 rows; the AVX2 one (2-row tiles, so the panel is
# re-read from L2 for every 2 rows) ties at 64 and is 6-14% slower at 128-256
# (docs/performance.md, "On a CPU with AVX2 only").
SMALL_M_MAX = 1024 if cpu_build.selected_instruction_set() == "avx512" else 64


class TorchLinear:
    """F.linear over the original weight: the fallback with the same call signature."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PanelLinear:
    """What the kernels' linears share: weights in panels of `width` output columns, seen by
    C++ through `kernel_weight` ({format, panels address, n_padded, K}, csrc/cpu_quant_gemm.h);
    y = x @ W^T + b for float32 x [M, in_features]. Subclasses fill the fields and say how
    their panels unpack to float32 (`float_panels`)."""

    out_features: int
    in_features: int
    padded: int  # out_features rounded up to whole panels
    bias: torch.Tensor | None
    kernel_weight: torch.Tensor
    _lib: ctypes.CDLL

    kernel_only = False  # whether every batch size must run through the kernel (not a float32 matmul)

    def _view(self, fmt: int, panels: torch.Tensor) -> torch.Tensor:
        return torch.tensor([fmt, panels.data_ptr(), self.padded, self.in_features], dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"expected a float32 CPU [M, {self.in_features}] input, got {x.dtype} {list(x.shape)}")
        x = x.contiguous()
        m = x.shape[0]
        if m <= SMALL_M_MAX or self.kernel_only:
            y = torch.empty((m, self.padded), dtype=torch.float32)  # [M, N_padded]
            if self._lib.streamengine_gemm(self.kernel_weight.data_ptr(), x.data_ptr(), m, y.data_ptr()) != 0:
                raise RuntimeError(f"cpu gemm rejected shape M={m} K={self.in_features} N={self.padded}")
        else:  # [P, M, width] -> [M, P * width]
            y = torch.matmul(x, self.float_panels()).transpose(0, 1).reshape(m, self.padded)
        if self.padded != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y

    def float_panels(self) -> torch.Tensor:
        """[P, K, width] float32: the weight as the float32 kernel's panels."""
        raise NotImplementedError


class PackedLinear(PanelLinear):
    """y = x @ W^T + b with W stored as k-major float32 panels (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        self.out_features, self.in_features = weight.shape
        self.width = lib.streamengine_panel_width()
        self.padded = -(-self.out_features // self.width) * self.width
        self.panels = pack_panels(weight, self.width)  # [P, K, width]
        self.bias = bias
        self.kernel_weight = self._view(0, self.panels)  # format 0: float32 panels
        self._lib = lib

    def float_panels(self) -> torch.Tensor:
        return self.panels


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
    """The CPU library with the GEMM bound, or None (see cpu_build)."""
    return cpu_build.bind({"streamengine_gemm": [PTR, PTR, I64, PTR]}, probe="streamengine_panel_width")
