"""Plain PyTorch references of the Triton kernels, which the kernel tests check them against.

They take the same tensors as the Triton wrappers (`ref_paged_attention` is also the
reference of the C++ CPU decode kernel's tests). The engine does not run them for attention:
its CPU paths are the C++ kernels and the torch backend in streamengine/models/; only
`ref_copy_blocks` serves it, as the copy-on-write block copy on CPU, and
`ref_lora_shrink_expand`, as the multi-LoRA fallback where the C++ kernels cannot run
(kernels/cpu_lora.py).

Attention is computed in fp32 with torch SDPA. Decode requests (one query token) are batched
into padded SDPA calls so that tests over many requests stay quick; longer queries run one
request at a time over only the blocks they use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import as_bytes

# Upper bound on the padded K/V elements gathered for one batched decode call, so a batch of
# long contexts is split into several calls instead of one huge temporary.
_DECODE_GATHER_ELEMENTS = 1 << 24


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Contiguous [seq_len, num_kv_heads, head_dim] view of one request's cached tokens."""
    # cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_ids: [num_used_blocks]
    blocks = cache.index_select(0, block_ids)  # [n, block_size, num_kv_heads, head_dim]
    return blocks.flatten(0, 1)[:seq_len]


def _prefill_one(
    q: torch.Tensor,  # [query_len, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [num_used_blocks] int64
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    query_len = q.shape[0]
    k = _gather_kv(key_cache, block_ids, seq_len).float()  # [seq_len, num_kv_heads, head_dim]
    v = _gather_kv(value_cache, block_ids, seq_len).float()
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
    # Query row j sits at absolute position seq_len - query_len + j and sees keys <= it.
    q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)  # [query_len]
    k_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
    mask = k_pos[None, :] <= q_pos[:, None]  # [query_len, seq_len]
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),  # [num_heads, query_len, head_dim]
        k.transpose(0, 1),  # [num_heads, seq_len, head_dim]
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )  # [num_heads, query_len, head_dim]
    return o.transpose(0, 1)


def _decode_batch(
    q: torch.Tensor,  # [n, num_heads, head_dim], one token per request
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [n, max_blocks] int64, rows of these requests
    seq_lens: torch.Tensor,  # [n] int64
    max_len: int,
    scale: float,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = -(-max_len // block_size)
    ids = block_tables[:, :num_blocks].reshape(-1)  # [n * num_blocks]
    k = key_cache.index_select(0, ids).view(n, num_blocks * block_size, num_kv_heads, head_dim)
    v = value_cache.index_select(0, ids).view(n, num_blocks * block_size, num_kv_heads, head_dim)
    visible = torch.arange(num_blocks * block_size, device=q.device)[None, :] < seq_lens[:, None]
    # Slots past a request's length hold stale data (possibly NaN bit patterns), and a masked
    # score still multiplies its value: zero them rather than trusting the mask alone.
    hidden = ~visible[:, :, None, None]  # [n, L, 1, 1]
    k = k.float().masked_fill(hidden, 0.0)
    v = v.float().masked_fill(hidden, 0.0)
    group = num_heads // num_kv_heads
    # [n, num_kv_heads, group, 1, head_dim] against [n, num_kv_heads, 1, L, head_dim]
    qg = q.float().view(n, num_kv_heads, group, 1, head_dim)
    kg = k.transpose(1, 2).unsqueeze(2)
    vg = v.transpose(1, 2).unsqueeze(2)
    mask = visible.view(n, 1, 1, 1, -1)  # [n, 1, 1, 1, L]
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    return o.view(n, num_heads, head_dim)


def ref_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `paged_attention`; computes in fp32, returns query's dtype."""
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"ref_paged_attention: bad shapes query {tuple(query.shape)}, key_cache "
            f"{tuple(key_cache.shape)}, value_cache {tuple(value_cache.shape)}"
        )
    if query.shape[1] % key_cache.shape[2] != 0:
        raise ValueError("ref_paged_attention: num_heads must be a multiple of num_kv_heads")
    if out is None:
        out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.to(torch.int64)
    decode_rows: list[int] = []
    for i, seq_len in enumerate(lens):
        begin, end = starts[i], starts[i + 1]
        if end == begin:
            continue
        if end - begin == 1:
            decode_rows.append(i)
            continue
        ids = tables[i, : -(-seq_len // block_size)]
        o = _prefill_one(query[begin:end], key_cache, value_cache, ids, seq_len, scale)
        out[begin:end] = o.to(out.dtype)
    _run_decodes(query, key_cache, value_cache, tables, lens, starts, decode_rows, scale, out)
    return out


def _run_decodes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: list[int],
    starts: list[int],
    rows: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Batched decode in chunks whose padded gather stays under _DECODE_GATHER_ELEMENTS."""
    per_token = key_cache.shape[2] * key_cache.shape[3]
    chunk: list[int] = []
    longest = 0
    for i in sorted(rows, key=lambda r: lens[r]):  # similar lengths together: less padding
        grown = max(longest, lens[i])
        if chunk and (len(chunk) + 1) * grown * per_token > _DECODE_GATHER_ELEMENTS:
            _decode_chunk(query, key_cache, value_cache, tables, lens, starts, chunk, scale, out)
            chunk, grown = [], lens[i]
        chunk.append(i)
        longest = grown
    if chunk:
        _decode_chunk(query, key_cache, value_cache, tables, lens, starts, chunk, scale, out)


def _decode_chunk(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: list[int],
    starts: list[int],
    chunk: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    device = query.device
    token_idx = torch.tensor([starts[i] for i in chunk], device=device)  # [n]
    rows = torch.tensor(chunk, device=device)
    seq_lens = torch.tensor([lens[i] for i in chunk], device=device)
    o = _decode_batch(
        query.index_select(0, token_idx),
        key_cache,
        value_cache,
        tables.index_select(0, rows),
        seq_lens,
        max(lens[i] for i in chunk),
        scale,
    )
    out.index_copy_(0, token_idx, o.to(out.dtype))


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their slots; slot -1 is skipped."""
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep].to(torch.int64)
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("ref_reshape_and_cache: key_cache and value_cache must be contiguous")
    # [num_blocks * block_size, num_kv_heads, head_dim] views that write through to the caches
    flat_k = key_cache.flatten(0, 1)
    flat_v = value_cache.flatten(0, 1)
    flat_k.index_copy_(0, slots, key[keep].to(key_cache.dtype))
    flat_v.index_copy_(0, slots, value[keep].to(value_cache.dtype))


def ref_copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks src -> dst (block_mapping [num_pairs, 2]) in every layer's caches."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(torch.int64)
    dst = block_mapping[:, 1].to(torch.int64)
    for cache in (*key_caches, *value_caches):
        s, d = src.to(cache.device), dst.to(cache.device)
        cache = as_bytes(cache)  # torch has no index_copy_ for float8: copy an 8-bit cache's bytes
        cache.index_copy_(0, d, cache.index_select(0, s))


def ref_lora_shrink_expand(
    x: torch.Tensor,
    y: torch.Tensor,
    slot: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    rank: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """y[t] += scale[s] * B[s, :, :rank[s]] @ (A[s, :rank[s]] @ x[t]) for every row t with
    s = slot[t] >= 0, in place (y may be any strided view); rows with slot -1 are untouched.

    x [T, in], y [T, out], slot [T], A [S, R, in], B [S, out, R], rank [S], scale [S]. One pair
    of fp32 matmuls per slot present; entries of A and B past a slot's rank are never read.
    """
    slot = slot.to(torch.int64)
    for s in torch.unique(slot).tolist():
        r = int(rank[s]) if s >= 0 else 0
        if r == 0:
            continue
        rows = (slot == s).nonzero().squeeze(1)
        h = x.index_select(0, rows).float() @ A[s, :r].float().T  # [n, r]
        delta = (h @ B[s, :, :r].float().T) * scale[s].float()  # [n, out]
        y.index_add_(0, rows, delta.to(y.dtype))
