"""Batched multi-LoRA on CUDA: the Triton version of kernels/cpu_lora.py, same arguments.

    y[t] += scale[s] * B[s, :, :rank[s]] @ (A[s, :rank[s]] @ x[t])    for each row t, s = slot[t] >= 0

Two launches, as Punica's BGMV (one row per program, each row gathering its own adapter):
  shrink: program t computes h[t] = scale[s] * A[s, :rank] @ x[t] into an fp32 buffer
          [T, R_P] (zero past the rank), walking `in` in tiles of BLOCK_K;
  expand: program (t, tile) adds B[s, tile, :rank] @ h[t] to BLOCK_O columns of y[t].
Why two: a fused kernel would redo the shrink (rank x in) for every output tile of a row,
which at prefill sizes reads each A tens of times more than the expand reads B. Rows of one
adapter read the same A and B, which then come from L2. Rows with slot -1 return at once.
Sums are fp32 whatever the inputs' dtype; y is read, added to and written in its own dtype.

Slots and ranks are trusted (checking their values would be a device sync): a slot outside
[-1, S) or a rank outside [0, R] reads outside the stacks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, check_launchable, next_power_of_2
from .cpu_lora import check_lora_args

_NAME = "lora_shrink_expand"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_K = 128  # input features per shrink iteration: an [R_P, 128] tile of A
_BLOCK_O = 128  # output columns per expand program: a [128, R_P] tile of B


@triton.jit
def _lora_shrink_kernel(
    h_ptr,  # [T, R_P] fp32, written: scale * A[s, :rank] @ x[t], zero past rank
    x_ptr,  # [T, in], unit stride along in
    slot_ptr,  # [T] int32/int64, -1 = no adapter
    a_ptr,  # [S, R, in], unit stride along in
    rank_ptr,  # [S]
    scale_ptr,  # [S]
    in_features,
    stride_ht,
    stride_xt,
    stride_as,  # A strides: slot, rank row
    stride_ar,
    R_P: tl.constexpr,  # the stack's rank R rounded up to a power of two, masked
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(slot_ptr + t).to(tl.int64)
    if s < 0:
        return
    rank = tl.load(rank_ptr + s)
    r = tl.arange(0, R_P)
    r_ok = r < rank
    a_rows = a_ptr + s * stride_as + r.to(tl.int64)[:, None] * stride_ar  # [R_P, 1]
    x_row = x_ptr + t * stride_xt
    acc = tl.zeros([R_P], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(a_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * xv[None, :], 1)
    scale = tl.load(scale_ptr + s).to(tl.float32)
    tl.store(h_ptr + t * stride_ht + r, acc * scale)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, out], unit stride along out; updated in place
    h_ptr,  # [T, R_P] fp32 from the shrink
    slot_ptr,  # [T]
    b_ptr,  # [S, out, R], unit stride along R
    rank_ptr,  # [S]
    out_features,
    stride_yt,
    stride_ht,
    stride_bs,  # B strides: slot, output row
    stride_bo,
    R_P: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    s = tl.load(slot_ptr + t).to(tl.int64)
    if s < 0:
        return
    rank = tl.load(rank_ptr + s)
    r = tl.arange(0, R_P)
    h = tl.load(h_ptr + t * stride_ht + r)  # [R_P], zero past the rank
    o = tile * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = o < out_features
    b_offs = s * stride_bs + o.to(tl.int64)[:, None] * stride_bo + r[None, :]
    b = tl.load(b_ptr + b_offs, mask=o_ok[:, None] & (r < rank)[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * h[None, :], 1)  # [BLOCK_O]
    y_ptrs = y_ptr + t * stride_yt + o
    y = tl.load(y_ptrs, mask=o_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=o_ok)


def lora_shrink_expand(
    x: torch.Tensor,
    y: torch.Tensor,
    slot: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    rank: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """y[t] += scale[s] * B[s, :, :rank[s]] @ (A[s, :rank[s]] @ x[t]) for every row t with
    s = slot[t] >= 0, in place, on CUDA tensors (or CPU ones under TRITON_INTERPRET=1).

    x [T, in], y [T, out] (row strides free, e.g. a column slice of a fused qkv output; unit
    stride along the features); slot [T], rank [S] int32 or int64; A [S, R, in], B [S, out, R]
    (unit stride along their last dim); scale [S]. Floats fp16, bf16 or fp32, summed in fp32.
    """
    check_lora_args(_NAME, x, y, slot, A, B, rank, scale, _FLOAT_DTYPES)
    for arg, t in (("x", x), ("y", y), ("A", A), ("B", B)):
        if t.stride(-1) != 1:
            raise ValueError(f"{_NAME}: {arg} needs a unit stride on its last dim, got strides {t.stride()}")
    rows, in_features = x.shape
    S, R = A.shape[0], A.shape[1]
    out_features = y.shape[1]
    if rows == 0 or S == 0 or R == 0 or out_features == 0:
        return
    check_launchable(_NAME, _lora_shrink_kernel, x.device)
    slot, rank, scale = slot.contiguous(), rank.contiguous(), scale.contiguous()
    r_p = max(16, next_power_of_2(R))
    h = torch.empty((rows, r_p), dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(rows,)](
        h_ptr=h,
        x_ptr=x,
        slot_ptr=slot,
        a_ptr=A,
        rank_ptr=rank,
        scale_ptr=scale,
        in_features=in_features,
        stride_ht=h.stride(0),
        stride_xt=x.stride(0),
        stride_as=A.stride(0),
        stride_ar=A.stride(1),
        R_P=r_p,
        BLOCK_K=_BLOCK_K,
        num_warps=4,
    )
    _lora_expand_kernel[(rows, cdiv(out_features, _BLOCK_O))](
        y_ptr=y,
        h_ptr=h,
        slot_ptr=slot,
        b_ptr=B,
        rank_ptr=rank,
        out_features=out_features,
        stride_yt=y.stride(0),
        stride_ht=h.stride(0),
        stride_bs=B.stride(0),
        stride_bo=B.stride(1),
        R_P=r_p,
        BLOCK_O=_BLOCK_O,
        num_warps=4,
    )
