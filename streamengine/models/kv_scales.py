"""The per-layer scales of an 8-bit (fp8) KV cache.

Each layer's K and V caches hold `x / scale` as float8 codes (kernels/fp8.py), one scale per
tensor as in vLLM. A scale is either given (`EngineConfig.k_scale` / `v_scale`, the same for
every layer) or set from the first K (V) the layer stores: max |x| of that step's tokens times
SCALE_HEADROOM, over the format's largest value. Set once, it never changes: every block in
the pool, cached prefixes and swapped-out blocks included, was written with it, so a cached
or swapped block reads back as it was written.

Why a headroom: later tokens may exceed the first step's largest value, and a value past the
format's range saturates. 4x costs two of e4m3's ~18 binades at the small end, where values
hardly weigh in a dot product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from streamengine.config import EngineConfig
from streamengine.kernels import fp8

SCALE_HEADROOM = 4.0
"""How far past the first step's largest |K| (|V|) a layer's codes reach before saturating."""


def _float32(x: float) -> float:
    """x rounded to float32, the scale the kernels receive: every path then uses the same one."""
    return float(torch.tensor(x, dtype=torch.float32))


def calibrated_scale(x: torch.Tensor, dtype: torch.dtype) -> float:
    """The scale that puts SCALE_HEADROOM x max |x| at the format's largest value; 1 for an
    all-zero or non-finite x (nothing to calibrate on)."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    if not math.isfinite(amax) or amax == 0.0:
        return 1.0
    return _float32(amax * SCALE_HEADROOM / fp8.fp8_max(dtype))


@dataclass(slots=True)
class KVScales:
    """One engine's fp8 scales: per layer, a K and a V scale (None until set by the first store)."""

    dtype: torch.dtype  # torch.float8_e4m3fn or torch.float8_e5m2
    k: list[float | None]
    v: list[float | None]
    # [num_layers, 2] float32 (k_scale, v_scale) per layer, for the fused C++ layers (which read
    # it by address); a row is valid once both of its scales are set.
    table: torch.Tensor

    @classmethod
    def of(cls, config: EngineConfig, num_layers: int, dtype: torch.dtype) -> KVScales | None:
        """The scales of a cache of `dtype`; None for a cache that is not 8-bit."""
        if not fp8.is_fp8(dtype):
            return None
        k = None if config.k_scale is None else _float32(config.k_scale)
        v = None if config.v_scale is None else _float32(config.v_scale)
        table = torch.tensor([[k or 0.0, v or 0.0]] * num_layers, dtype=torch.float32)
        return cls(dtype, [k] * num_layers, [v] * num_layers, table)

    @property
    def ready(self) -> bool:
        """Whether every layer's scales are set (given, or set by a first store)."""
        return None not in self.k and None not in self.v

    def for_store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
        """The layer's (k_scale, v_scale) for storing k and v, set from them if not yet set
        (the table's row with them: once, not at every store of every step)."""
        if self.k[layer] is None or self.v[layer] is None:
            if self.k[layer] is None:
                self.k[layer] = calibrated_scale(k, self.dtype)
            if self.v[layer] is None:
                self.v[layer] = calibrated_scale(v, self.dtype)
            self.table[layer, 0], self.table[layer, 1] = self.k[layer], self.v[layer]
        return self.k[layer], self.v[layer]

    def __getitem__(self, layer: int) -> tuple[float, float]:
        """The layer's (k_scale, v_scale) for reading its cache: set by an earlier store."""
        k, v = self.k[layer], self.v[layer]
        if k is None or v is None:
            raise RuntimeError(f"layer {layer}'s fp8 cache is read before anything was stored in it")
        return k, v


def layer_scales(scales: KVScales | None, layer: int) -> tuple[float, float]:
    """(k_scale, v_scale) for reading a layer's cache: (1, 1) when it is not 8-bit."""
    return (1.0, 1.0) if scales is None else scales[layer]


def store_scales(scales: KVScales | None, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """(k_scale, v_scale) for writing k and v into a layer's cache: (1, 1) when it is not 8-bit."""
    return (1.0, 1.0) if scales is None else scales.for_store(layer, k, v)
