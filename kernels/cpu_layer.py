"""The fused CPU decoder layer (kernels/cpu_layer.cpp): two calls per layer around attention.

`FusedLayer` holds one layer's packed weights (the `PackedLinear`s of the native model) and
runs `layer_in` (q/k/v GEMM, RoPE, K/V store) and `layer_out` (output projection, residual,
RMSNorm, gate/up GEMM, SiLU-times-up, down GEMM, residual, next RMSNorm). `available()` says
whether the library runs here; callers keep their op-by-op path otherwise.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_build
from .cpu_build import F32, I64, PTR
from .cpu_linear import PackedLinear


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    return cpu_build.bind("cpu_layer", {
        "streamengine_layer_in": [PTR, I64, I64, PTR, I64, PTR, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR],
        "streamengine_layer_out": [
            PTR, I64, I64, PTR, I64, PTR, PTR, I64, PTR, PTR, I64, I64, PTR, I64, PTR, F32, PTR, PTR, PTR, PTR, PTR, PTR,
        ],
    }, probe="streamengine_cpu_layer_available")


def available() -> bool:
    return load_library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedLayer:
    """One decoder layer's weights, packed, with the two fused calls."""

    def __init__(self, qkv: PackedLinear, o: PackedLinear, gate_up: PackedLinear, down: PackedLinear,
                 post_norm: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        self.lib = load_library()
        if self.lib is None:
            raise RuntimeError("the fused CPU layer library is not available here")
        if gate_up.bias is not None or down.bias is not None:
            raise ValueError("the fused layer has no MLP biases")
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.post_norm = post_norm.contiguous()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.hidden = o.out_features
        self.intermediate = down.in_features

    def layer_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] normed -> qkv [T, padded] with RoPE applied; K/V stored at `slots`."""
        t = x.shape[0]
        qkv = torch.empty((t, self.qkv.padded), dtype=torch.float32)
        self.lib.streamengine_layer_in(
            x.data_ptr(), t, self.hidden, self.qkv.panels.data_ptr(), self.qkv.padded, _ptr(self.qkv.bias),
            self.heads, self.kv_heads, self.head_dim, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            key_cache.data_ptr(), value_cache.data_ptr(), qkv.data_ptr(),
        )
        return qkv

    def layer_out(self, attn: torch.Tensor, h: torch.Tensor, next_norm: torch.Tensor) -> torch.Tensor:
        """attn [T, heads * head_dim]; h [T, hidden] updated in place; returns RMSNorm(h) with
        next_norm, the next layer's input."""
        t = h.shape[0]
        empty = functools.partial(torch.empty, dtype=torch.float32)
        o, x, gu = empty((t, self.o.padded)), empty((t, self.hidden)), empty((t, self.gate_up.padded))
        act, down, x_out = empty((t, self.intermediate)), empty((t, self.down.padded)), empty((t, self.hidden))
        rc = self.lib.streamengine_layer_out(
            attn.data_ptr(), t, attn.shape[1], self.o.panels.data_ptr(), self.o.padded, _ptr(self.o.bias),
            h.data_ptr(), self.hidden, self.post_norm.data_ptr(), self.gate_up.panels.data_ptr(),
            self.gate_up.padded, self.intermediate, self.down.panels.data_ptr(), self.down.padded,
            next_norm.data_ptr(), self.eps, o.data_ptr(), x.data_ptr(), gu.data_ptr(), act.data_ptr(),
            down.data_ptr(), x_out.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError("fused layer rejected its shapes")
        return x_out
