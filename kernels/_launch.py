"""Checks shared by the kernel wrappers: where a Triton kernel can launch, argument checks.

Triton decides when it is imported, and again when each kernel is decorated, whether kernels
are compiled or interpreted (TRITON_INTERPRET=1). On CPU tensors a kernel can only run in the
interpreter, and only when both triton.language and the kernel were set up for it: the
standard library helpers (tl.sum, tl.max, tl.zeros) are themselves jit functions.
"""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl


def runs_interpreted(kernel: Any) -> bool:
    """Whether `kernel` (and the triton.language it calls) runs in the Triton interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every Triton 3.x ships the interpreter
        return False
    return isinstance(kernel, InterpretedFunction) and isinstance(tl.zeros, InterpretedFunction)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host side of a launch. Triton's own `triton.cdiv` and
    `triton.next_power_of_2` are constexpr functions: every host call goes through Triton's
    argument unwrapping, about as long as the whole rest of a wrapper's Python."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for the host side of a launch."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def check_launchable(name: str, kernel: Any, device: torch.device) -> None:
    """Raise a clear error instead of Triton's when `kernel` cannot run on `device`."""
    if device.type == "cuda" or (device.type == "cpu" and runs_interpreted(kernel)):
        return
    raise RuntimeError(
        f"{name}: Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
        f"before triton is first imported; got tensors on {device}. "
        "Use the streamengine.kernels.reference functions instead."
    )


def check_same_device(name: str, ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    for arg, t in tensors.items():
        if t.device != ref.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, expected {ref.device}")


def check_int_tensor(name: str, arg: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: {arg} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name}: {arg} must have {dim} dims, got shape {tuple(t.shape)}")
