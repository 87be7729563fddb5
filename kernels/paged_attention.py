"""Paged attention over a packed varlen batch (decode, prefill, chunked prefill, cached prefix).

One program owns (query tile, KV head, request [, KV split]). Its rows are the query tokens
of the tile times the query heads that share the KV head (GQA/MQA), so every K/V element read
from the cache serves all heads of its group. The program walks the request's keys in tiles
of TILE_N positions, finds each key's physical block through the block table, and merges the
tiles with the online softmax (running max m, running sum l, rescaled accumulator), all in
fp32. Keys are masked causally by absolute position: the new tokens of request i sit at
positions seq_len - query_len .. seq_len - 1 and the earlier ones are the cached context.

Long decodes with few (request, KV head) pairs leave most of a GPU idle, so the key range can
be split over several programs (split-KV); each writes its own softmax-normalised fp32 result
plus its log-sum-exp, and a second kernel weighs and sums them.

An fp8 cache (kernels/fp8.py) is read as its bytes and widened in registers
(kernels/fp8_triton.py); its k_scale is folded into the softmax scale, its v_scale into the
final normalization.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import (
    cdiv,
    check_launchable,
    next_power_of_2,
    runs_interpreted,
)
from .fp8_triton import fp8_code, from_cache, kernel_view
from .paged_attention_checks import check_inputs, check_out

_NAME = "paged_attention"
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] (or fp32 partials, see PARTIAL)
    lse_ptr,  # [num_splits, num_tokens, num_heads] fp32, written only when PARTIAL
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32, context length including the new tokens
    query_start_loc_ptr,  # [num_seqs + 1] int32, cumulative query lengths
    qk_scale,  # float: softmax scale * log2(e) (* k_scale), so the kernel can use exp2
    v_scale,  # float: an fp8 cache's V scale (1 otherwise)
    kv_split_len,  # int: keys per split (a multiple of TILE_N); ignored unless PARTIAL
    num_splits,  # int: splits per request (1 unless PARTIAL)
    stride_qt,  # query strides (elements); the head_dim stride is 1
    stride_qh,
    stride_ot,  # out strides; for PARTIAL, out is [num_splits, num_tokens, num_heads, head_dim]
    stride_oh,
    stride_os,  # out split stride (PARTIAL only)
    stride_ls,  # lse strides (PARTIAL only)
    stride_lt,
    stride_kb,  # key cache strides: block, slot in block, head
    stride_ks,
    stride_kh,
    stride_vb,  # value cache strides: block, slot in block, head
    stride_vs,
    stride_vh,
    stride_bt,  # block table row stride
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two, masked
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two, masked
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_R: tl.constexpr,  # rows per program: max(16, BLOCK_Q * GROUP_P), tl.dot needs >= 16
    TILE_N: tl.constexpr,  # key positions per iteration (>= 16 for tl.dot)
    PARTIAL: tl.constexpr,  # write this split's fp32 result + lse for the split-KV merge
    UPCAST: tl.constexpr,  # do the dots in fp32 (bf16 in the CPU interpreter is wrong otherwise)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding), else None
    FP8: tl.constexpr,  # fp8_triton's code of the cache format; 0: read as stored
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    pid_z = tl.program_id(2)
    seq = pid_z // num_splits
    split = pid_z % num_splits

    q_begin = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_begin
    tile_start = pid_q * BLOCK_Q
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    prefix_len = seq_len - q_len  # tokens already in the cache before this step

    rows = tl.arange(0, BLOCK_R)
    row_tok = rows // GROUP_P  # query token of the row, within the tile
    row_head = rows % GROUP_P  # query head of the row, within the KV head's group
    tok = tile_start + row_tok
    row_valid = (row_tok < BLOCK_Q) & (tok < q_len) & (row_head < GROUP)
    head = (kv_head * GROUP + row_head).to(tl.int64)
    q_pos = prefix_len + tok  # absolute position of each row's token

    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_begin + tok) * stride_qt + head * stride_qh  # [BLOCK_R] int64
    q = tl.load(
        query_ptr + q_offs[:, None] + dims[None, :],
        mask=row_valid[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [BLOCK_R, HEAD_DIM_P]
    if UPCAST:
        q = q.to(tl.float32)

    # Keys past the last query token of the tile are masked for every row: stop there.
    last_tok = tl.minimum(tile_start + BLOCK_Q, q_len)
    kv_end = prefix_len + last_tok
    kv_begin = 0
    if PARTIAL:
        kv_begin = split * kv_split_len
        kv_end = tl.minimum(kv_end, kv_begin + kv_split_len)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM_P], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head64 = kv_head.to(tl.int64)
    for start in range(kv_begin, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)  # [TILE_N] key positions
        pos_ok = pos < kv_end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_offs = block * stride_kb + slot * stride_ks + kv_head64 * stride_kh  # [TILE_N]
        k = from_cache(tl.load(
            key_cache_ptr + k_offs[None, :] + dims[:, None],
            mask=pos_ok[None, :] & dim_ok[:, None],
            other=0,
        ), q.dtype, FP8)  # [HEAD_DIM_P, TILE_N]
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_R, TILE_N]
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead so
        # exp2 gives 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])  # [BLOCK_R, TILE_N]
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

        v_offs = block * stride_vb + slot * stride_vs + kv_head64 * stride_vh
        v = from_cache(tl.load(
            value_cache_ptr + v_offs[:, None] + dims[None, :],
            mask=pos_ok[:, None] & dim_ok[None, :],
            other=0,
        ), q.dtype, FP8)  # [TILE_N, HEAD_DIM_P]
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    out_offs = (q_begin + tok) * stride_ot + head * stride_oh  # [BLOCK_R] int64
    out_mask = row_valid[:, None] & dim_ok[None, :]
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc * (v_scale / l_safe)[:, None]  # [BLOCK_R, HEAD_DIM_P]
    if PARTIAL:
        # fp32 result of this split plus its log-sum-exp (base 2); an empty split stores 0
        # with lse = -inf, which the merge weighs with 0.
        split64 = split.to(tl.int64)
        tl.store(
            out_ptr + split64 * stride_os + out_offs[:, None] + dims[None, :], result, mask=out_mask
        )
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        lse_offs = split64 * stride_ls + (q_begin + tok) * stride_lt + head
        tl.store(lse_ptr + lse_offs, lse, mask=row_valid)
    else:
        tl.store(
            out_ptr + out_offs[:, None] + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partials_ptr,  # [num_splits, num_tokens, num_heads, head_dim] fp32, each split normalised
    lse_ptr,  # [num_splits, num_tokens, num_heads] fp32, base 2, -inf for an empty split
    num_splits,
    stride_ot,
    stride_oh,
    stride_ps,  # partials strides: split, token, head
    stride_pt,
    stride_ph,
    stride_ls,  # lse strides: split, token
    stride_lt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLITS_P: tl.constexpr,  # num_splits rounded up to a power of two, masked
):
    """out = sum_s w_s * o_s, w_s = 2^lse_s / sum_s 2^lse_s (each split's share of the softmax
    mass), for one (token, head) per program: one launch where torch needed five."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_P)
    split_ok = splits < num_splits
    lse_offs = splits.to(tl.int64) * stride_ls + tok * stride_lt + head
    lse = tl.load(lse_ptr + lse_offs, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # [SPLITS_P]
    total = tl.sum(weights, 0)
    weights = weights / tl.where(total > 0.0, total, 1.0)  # no keys at all: 0, not NaN
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    row = tok * stride_pt + head * stride_ph
    part_offs = splits[:, None].to(tl.int64) * stride_ps + row + dims[None, :]
    parts = tl.load(partials_ptr + part_offs, mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    merged = tl.sum(parts * weights[:, None], 0)  # [HEAD_DIM_P]
    out_offs = tok * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + out_offs, merged.to(out_ptr.dtype.element_ty), mask=dim_ok)


# Fixed when the module is imported (Triton decides at decoration time).
_INTERPRETED = runs_interpreted(_paged_attention_kernel)


def _tile_config(max_query_len: int, group: int, head_dim_p: int) -> tuple[int, int, int, int, int]:
    """(GROUP_P, BLOCK_Q, BLOCK_R, TILE_N, num_warps) for one launch."""
    group_p = next_power_of_2(group)
    block_q = (
        1
        if max_query_len <= 1
        else min(next_power_of_2(max_query_len), max(1, 64 // group_p))
    )
    block_r = max(16, block_q * group_p)
    tile_n = 64 if head_dim_p <= 64 else 32
    num_warps = 8 if block_r * head_dim_p >= 128 * 128 else 4
    return group_p, block_q, block_r, tile_n, num_warps


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Split-KV for decode. An SM runs several (request, KV head) programs at once, so a batch with
# fewer than about 3 programs per SM leaves the GPU part idle; splitting each key range until
# there are about 16 programs per SM fills it, as long as every split keeps 2 key tiles. Below
# 2,048 keys a split saves less device time than the merge's extra launch costs the host (the
# engine launches eagerly). The constants come from a sweep of every split count over decode
# shapes on an H200 (`bench/attention_kernels.py --split-sweep`; docs/performance.md).
_MIN_SPLIT_CONTEXT = 2048
_SPLIT_BELOW_PROGRAMS_PER_SM = 3
_SPLIT_TARGET_PROGRAMS_PER_SM = 16
_MIN_TILES_PER_SPLIT = 2
_MAX_SPLITS = 64
_MAX_MERGE_SPLITS = 256  # the merge kernel holds every split's row of one head at once


def _choose_num_splits(
    query: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    num_seqs: int,
    num_kv_heads: int,
    tile_n: int,
) -> int:
    """Split the key range only for decode batches on CUDA too small to fill the GPU."""
    if max_query_len != 1 or query.device.type != "cuda" or _INTERPRETED:
        return 1
    programs = num_seqs * num_kv_heads
    num_sms = _num_sms(
        query.device.index if query.device.index is not None else torch.cuda.current_device()
    )
    return split_count(programs, num_sms, max_seq_len, tile_n)


def split_count(programs: int, num_sms: int, max_seq_len: int, tile_n: int) -> int:
    """Key-range splits for a decode launch of `programs` (request, KV head) programs."""
    if programs >= _SPLIT_BELOW_PROGRAMS_PER_SM * num_sms or max_seq_len < _MIN_SPLIT_CONTEXT:
        return 1
    by_occupancy = cdiv(_SPLIT_TARGET_PROGRAMS_PER_SM * num_sms, programs)
    by_length = max_seq_len // (_MIN_TILES_PER_SPLIT * tile_n)
    splits = max(1, min(by_occupancy, by_length, _MAX_SPLITS))
    # Whole tiles per split can leave the last splits empty: count only those with keys.
    return cdiv(max_seq_len, _split_len(max_seq_len, splits, tile_n))


def _split_len(max_seq_len: int, num_splits: int, tile_n: int) -> int:
    """Keys per split: an equal share of the longest request's, rounded up to whole tiles."""
    return cdiv(cdiv(max(max_seq_len, 1), num_splits), tile_n) * tile_n


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a packed varlen batch of queries over the paged KV cache.

    query [num_tokens, num_heads, head_dim]; key_cache/value_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks_per_seq] int32; seq_lens
    [num_seqs] int32 (context length including the new tokens, which must already be in the
    cache); query_start_loc [num_seqs + 1] int32. Returns out [num_tokens, num_heads, head_dim]
    in query's dtype; out, when given, receives it (any strides with a unit head_dim stride).

    max_query_len must be >= every query length (None: read from query_start_loc, a device
    sync on CUDA); it sizes the grid. max_seq_len must be >= every seq_len (None: the block
    table width times block_size); with num_kv_splits (None: a heuristic that splits only
    decode batches on CUDA that would leave SMs idle) it sizes split-KV. Values inside the
    index tensors are trusted: checking them would need a device sync. An fp8 cache's values
    are its codes times k_scale / v_scale (scales of 1 for other caches).
    """
    check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    fp8 = fp8_code(key_cache.dtype)
    if not (k_scale > 0 and v_scale > 0) or (not fp8 and (k_scale, v_scale) != (1.0, 1.0)):
        raise ValueError(f"{_NAME}: scales ({k_scale}, {v_scale}) must be > 0, and 1 for a {key_cache.dtype} cache")
    if out is None:
        out = torch.empty_like(query)
    else:
        check_out(out, query)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len <= 0:
        return out
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    head_dim_p = max(16, next_power_of_2(head_dim))
    group_p, block_q, block_r, tile_n, num_warps = _tile_config(max_query_len, group, head_dim_p)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_kv_splits is None:
        num_kv_splits = _choose_num_splits(
            query, max_query_len, max_seq_len, num_seqs, num_kv_heads, tile_n
        )
    elif not 1 <= num_kv_splits <= _MAX_MERGE_SPLITS:
        raise ValueError(
            f"{_NAME}: num_kv_splits must be in 1..{_MAX_MERGE_SPLITS}, got {num_kv_splits}"
        )
    kv_split_len = _split_len(max_seq_len, num_kv_splits, tile_n)
    partial = num_kv_splits > 1
    if partial:
        # [num_splits, num_tokens, num_heads, head_dim] fp32 partials and their lse (base 2).
        target = query.new_empty(
            (num_kv_splits, num_tokens, num_heads, head_dim), dtype=torch.float32
        )
        lse = query.new_empty((num_kv_splits, num_tokens, num_heads), dtype=torch.float32)
    else:
        target = out
        lse = out  # never touched without PARTIAL; saves an allocation per call

    check_launchable(_NAME, _paged_attention_kernel, query.device)
    grid = (cdiv(max_query_len, block_q), num_kv_heads, num_seqs * num_kv_splits)
    _paged_attention_kernel[grid](
        out_ptr=target,
        lse_ptr=lse,
        query_ptr=query,
        key_cache_ptr=kernel_view(key_cache),
        value_cache_ptr=kernel_view(value_cache),
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc,
        qk_scale=float(scale) * _LOG2E * k_scale,
        v_scale=v_scale,
        kv_split_len=kv_split_len,
        num_splits=num_kv_splits,
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_ot=target.stride(-3),
        stride_oh=target.stride(-2),
        stride_os=target.stride(0) if partial else 0,
        stride_ls=lse.stride(0) if partial else 0,
        stride_lt=lse.stride(1) if partial else 0,
        stride_kb=key_cache.stride(0),
        stride_ks=key_cache.stride(1),
        stride_kh=key_cache.stride(2),
        stride_vb=value_cache.stride(0),
        stride_vs=value_cache.stride(1),
        stride_vh=value_cache.stride(2),
        stride_bt=block_tables.stride(0),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        BLOCK_R=block_r,
        TILE_N=tile_n,
        PARTIAL=partial,
        UPCAST=_INTERPRETED and query.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        FP8=fp8,
        num_warps=num_warps,
        num_stages=2,
    )
    if partial:
        _merge_splits(target, lse, out, head_dim_p)
    return out


def _merge_splits(
    partials: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, head_dim_p: int
) -> None:
    """Weighs each split's result by its softmax mass and sums them into out."""
    num_splits, num_tokens, num_heads, head_dim = partials.shape
    _merge_splits_kernel[(num_tokens, num_heads)](
        out_ptr=out,
        partials_ptr=partials,
        lse_ptr=lse,
        num_splits=num_splits,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_ps=partials.stride(0),
        stride_pt=partials.stride(1),
        stride_ph=partials.stride(2),
        stride_ls=lse.stride(0),
        stride_lt=lse.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        SPLITS_P=next_power_of_2(num_splits),
        num_warps=1 if head_dim <= 64 else 2,
    )
