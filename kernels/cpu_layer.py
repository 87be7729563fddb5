"""The fused CPU decoder layer (kernels/csrc/cpu_layer.cpp): two calls per layer around attention.

`FusedLayer` holds one layer's packed weights (the native model's `PanelLinear`s: float32
panels or GGUF blocks) and runs `layer_in` (q/k/v GEMM, RoPE, K/V store) and `layer_out` (output projection, residual,
RMSNorm, gate/up GEMM, SiLU-times-up, down GEMM, residual, next RMSNorm). `DecodeStack` runs
every layer of a decode-only step, attention included, in one call. `available()` says
whether the library runs here; callers keep their op-by-op path otherwise.

A step with LoRA adapter rows passes `lora`: (step fields [4] int64, layer table [layers, 7, 4]
int64) as kernels/csrc/cpu_lora.h lays them out (streamengine/models/lora.py builds them);
every adapted projection then adds its rows' deltas inside the same calls.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_build
from .cpu_attention import DecodePlan
from .cpu_build import F32, I64, PTR
from .cpu_linear import PanelLinear
from .cpu_ops import cache_type

KEY_CACHE, VALUE_CACHE, KV_SCALES, NUM_FIELDS = 8, 9, 10, 11  # LayerField in csrc/cpu_layer.cpp


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    return cpu_build.bind({
        "streamengine_layer_in": [PTR, I64, I64, PTR, PTR, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR, PTR],
        "streamengine_layer_out": [
            PTR, I64, I64, PTR, PTR, PTR, I64, PTR, PTR, I64, PTR, PTR, F32, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR,
        ],
        "streamengine_decode_layers": [
            PTR, I64, I64, I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, F32, PTR, PTR, PTR, I64, I64, PTR,
            I64, PTR, PTR, PTR, I64, PTR, PTR, PTR, PTR, PTR,
        ],
    }, probe="streamengine_cpu_layer_available")


def available() -> bool:
    return load_library() is not None


LoRAView = tuple[torch.Tensor, torch.Tensor]  # (step fields [4], layer table [layers, 7, 4]), int64


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _lora_ptrs(lora: LoRAView | None, layer: int | None) -> tuple[int | None, int | None]:
    """The step's and the layer's (or, with layer None, the whole table's) LoRA addresses."""
    if lora is None:
        return None, None
    step, table = lora
    if (step.dtype != torch.int64 or step.shape != (4,) or table.dtype != torch.int64
            or table.shape[1:] != (7, 4) or not table.is_contiguous()):
        raise ValueError("lora must be (int64 [4], contiguous int64 [layers, 7, 4]) as kernels/csrc/cpu_lora.h lays them out")
    return step.data_ptr(), (table if layer is None else table[layer]).data_ptr()


def _checked_scales(kv_scales: torch.Tensor | None, layers: int) -> torch.Tensor | None:
    """An fp8 cache's scales as the C++ side reads them: contiguous float32 (k_scale, v_scale),
    one row per layer (the kernels refuse scales <= 0 themselves)."""
    if kv_scales is not None and (kv_scales.dtype != torch.float32 or not kv_scales.is_contiguous()
                                  or kv_scales.numel() != 2 * layers):
        raise ValueError(f"kv_scales must be contiguous float32 (k_scale, v_scale) for {layers} layers")
    return kv_scales


class FusedLayer:
    """One decoder layer's weights, packed (float32 panels or GGUF blocks, mixed freely), with
    the two fused calls."""

    def __init__(self, qkv: PanelLinear, o: PanelLinear, gate_up: PanelLinear, down: PanelLinear,
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
                 key_cache: torch.Tensor, value_cache: torch.Tensor, lora: LoRAView | None = None,
                 index: int = 0, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] normed -> qkv [T, padded] with RoPE applied; K/V stored at `slots`
        (float32 or float16 caches, contiguous; or fp8 with kv_scales, float32 (k_scale, v_scale)).
        `index`: this layer's row of lora's table."""
        t = x.shape[0]
        code = cache_type(key_cache, value_cache, scaled=_checked_scales(kv_scales, 1) is not None)
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("the fused layer stores into contiguous caches")
        qkv = torch.empty((t, self.qkv.padded), dtype=torch.float32)
        rc = self.lib.streamengine_layer_in(
            x.data_ptr(), t, self.hidden, self.qkv.kernel_weight.data_ptr(), _ptr(self.qkv.bias),
            self.heads, self.kv_heads, self.head_dim, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            key_cache.data_ptr(), value_cache.data_ptr(), code, _ptr(kv_scales), *_lora_ptrs(lora, index),
            qkv.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError("fused layer rejected its shapes")
        return qkv

    def layer_out(self, attn: torch.Tensor, h: torch.Tensor, next_norm: torch.Tensor,
                  lora: LoRAView | None = None, index: int = 0) -> torch.Tensor:
        """attn [T, heads * head_dim]; h [T, hidden] updated in place; returns RMSNorm(h) with
        next_norm, the next layer's input."""
        t = h.shape[0]
        empty = functools.partial(torch.empty, dtype=torch.float32)
        o, x, gu = empty((t, self.o.padded)), empty((t, self.hidden)), empty((t, self.gate_up.padded))
        act, down, x_out = empty((t, self.intermediate)), empty((t, self.down.padded)), empty((t, self.hidden))
        rc = self.lib.streamengine_layer_out(
            attn.data_ptr(), t, attn.shape[1], self.o.kernel_weight.data_ptr(), _ptr(self.o.bias),
            h.data_ptr(), self.hidden, self.post_norm.data_ptr(), self.gate_up.kernel_weight.data_ptr(),
            self.intermediate, self.down.kernel_weight.data_ptr(), next_norm.data_ptr(), self.eps,
            *_lora_ptrs(lora, index), o.data_ptr(), x.data_ptr(), gu.data_ptr(), act.data_ptr(), down.data_ptr(),
            x_out.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError("fused layer rejected its shapes")
        return x_out


class DecodeStack:
    """All layers of a decoder for steps whose rows each have one query token: one C++ call
    (streamengine_decode_layers) runs layer_in, the paged attention and layer_out of every
    layer, so no Python runs between layers."""

    def __init__(self, layers: list[FusedLayer], next_norms: list[torch.Tensor]) -> None:
        if len(layers) != len(next_norms) or not layers:
            raise ValueError("one next norm per layer, at least one layer")
        first = layers[0]
        self.widths = (first.qkv.padded, first.o.padded, first.gate_up.padded, first.down.padded)
        shape = (first.heads, first.kv_heads, first.head_dim, first.hidden, first.intermediate, first.eps)
        for layer in layers:
            widths = (layer.qkv.padded, layer.o.padded, layer.gate_up.padded, layer.down.padded)
            if widths != self.widths or (layer.heads, layer.kv_heads, layer.head_dim, layer.hidden,
                                         layer.intermediate, layer.eps) != shape:
                raise ValueError("every layer of a DecodeStack must have the same shapes")
            if any(b is not None and not b.is_contiguous() for b in (layer.qkv.bias, layer.o.bias)):
                raise ValueError("biases must be contiguous")  # the table below holds addresses
        self.lib, self.first = first.lib, first
        self.layers = layers  # the table below holds their weights' addresses: keep them alive
        self.next_norms = [n.contiguous() for n in next_norms]  # kept alive for their addresses
        self.table = torch.tensor([  # [layers, NUM_FIELDS], cache columns filled per call
            [layer.qkv.kernel_weight.data_ptr(), _ptr(layer.qkv.bias) or 0, layer.o.kernel_weight.data_ptr(),
             _ptr(layer.o.bias) or 0, layer.post_norm.data_ptr(), layer.gate_up.kernel_weight.data_ptr(),
             layer.down.kernel_weight.data_ptr(), norm.data_ptr(), 0, 0, 0]
            for layer, norm in zip(layers, self.next_norms, strict=True)
        ], dtype=torch.int64)
        # The engine's caches live as long as it does: their table is built (and checked) once.
        self._bound: tuple[list, torch.Tensor, int, torch.Tensor | None] | None = None

    def run(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], plan: DecodePlan, scale: float,
            lora: LoRAView | None = None, kv_scales: torch.Tensor | None = None) -> None:
        """h [T, hidden] residual stream and x [T, hidden] the first layer's normed input, both
        updated in place: x ends as the final normed hidden state. cos/sin [T, head_dim / 2].
        kv_caches (and an fp8 cache's kv_scales, [layers, 2] float32, read at each call) are
        bound on first use: pass new ones, not the same ones changed in place."""
        f, t = self.first, h.shape[0]
        self._check(t, h, x, cos, sin, slots, plan)
        table, code = self._table(kv_caches, kv_scales)
        if lora is not None and lora[1].shape[0] != len(kv_caches):
            raise ValueError(f"a LoRA table of {lora[1].shape[0]} layers for {len(kv_caches)}")
        qkv_w, o_w, gu_w, down_w = self.widths
        work = torch.empty(t * (qkv_w + f.heads * f.head_dim + o_w + f.hidden + gu_w + f.intermediate + down_w))
        rc = self.lib.streamengine_decode_layers(
            table.data_ptr(), len(kv_caches), t, f.hidden, f.heads, f.kv_heads, f.head_dim, qkv_w, o_w, gu_w,
            f.intermediate, down_w, f.eps, scale, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            code, kv_caches[0][0].shape[1], plan.tables, plan.table_stride, plan.seq_lens,
            plan.query_start_loc, plan.rows, plan.num_rows, *_lora_ptrs(lora, None), h.data_ptr(), x.data_ptr(),
            work.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError("decode stack rejected its shapes")

    def _table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """The layer table with these caches' (and scales') addresses and their CacheType code,
        checked and built once per cache list."""
        if self._bound is not None and self._bound[0] is kv_caches and self._bound[3] is kv_scales:
            return self._bound[1], self._bound[2]
        f = self.first
        _checked_scales(kv_scales, len(kv_caches))
        if len(kv_caches) != self.table.shape[0]:
            raise ValueError(f"{len(kv_caches)} caches for {self.table.shape[0]} layers")
        block_shape, dtype = kv_caches[0][0].shape[1:], kv_caches[0][0].dtype
        code = cache_type(*kv_caches[0], scaled=kv_scales is not None)
        for cache in (c for pair in kv_caches for c in pair):
            if (cache.dtype != dtype or not cache.is_contiguous() or cache.shape[1:] != block_shape
                    or block_shape[1:] != (f.kv_heads, f.head_dim)):
                raise ValueError("caches must be contiguous [blocks, block_size, kv_heads, head_dim], all alike")
        table = self.table.clone()
        table[:, KEY_CACHE] = torch.tensor([k.data_ptr() for k, _ in kv_caches])
        table[:, VALUE_CACHE] = torch.tensor([v.data_ptr() for _, v in kv_caches])
        if kv_scales is not None:
            table[:, KV_SCALES] = torch.tensor([row.data_ptr() for row in kv_scales.view(-1, 2)])
        self._bound = (kv_caches, table, code, kv_scales)  # keeps them, and so their tensors, alive
        return table, code

    def _check(self, t: int, h, x, cos, sin, slots, plan: DecodePlan) -> None:
        """The C++ side trusts every address and shape: reject what would make it read or
        write out of bounds."""
        f = self.first
        if plan.num_rows != t:
            raise ValueError("a decode stack step has one query token per row")
        for name, tensor, dtype, width in (
            ("h", h, torch.float32, f.hidden), ("x", x, torch.float32, f.hidden),
            ("cos", cos, torch.float32, f.head_dim // 2), ("sin", sin, torch.float32, f.head_dim // 2),
            ("slots", slots, torch.int64, None),
        ):
            if (tensor.dtype != dtype or not tensor.is_contiguous() or tensor.shape[0] != t
                    or (width is not None and tensor.shape[-1] != width)):
                raise ValueError(f"{name} must be a contiguous {dtype} tensor of {t} rows")
