"""The PyTorch path: SDPA over K/V gathered through the block tables.

Decode rows (one query token) run as batched SDPAs over padded block gathers, grouped by
context length; other rows (prefill, chunked prefill, prefill after a cache hit) run per
request with a causal mask offset by their cached context. A prompt with no cached context
attends to its own fresh K/V directly, without reading the cache back.

The row split and the per-request prefill are plain functions: the CPU backend
(cpu_backend.py) uses them for its prefill rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamengine.kernels import fp8
from streamengine.models.attention import AttentionMetadata
from streamengine.models.kv_scales import layer_scales, store_scales


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows of similar context length, attended in one batched SDPA."""

    tokens: torch.Tensor  # [G] int64: their query token in the packed batch
    blocks: torch.Tensor  # [G * num_blocks] int64: block tables cut to the group's longest
    mask: torch.Tensor  # [G, 1, 1, num_blocks * block_size] bool: True = a real token


def group_by_length(rows: list[int], lens: list[int], min_ratio: float = 0.6) -> list[list[int]]:
    """Splits decode rows into groups sorted by length, each group's shortest at least
    `min_ratio` of its longest, so padding to the longest wastes under 1 / min_ratio. Context
    lengths are heavy-tailed: one padded batch would copy the longest context for every row."""
    groups: list[list[int]] = []
    head = 0
    for i in sorted(rows, key=lambda r: -lens[r]):
        if groups and lens[i] >= min_ratio * head:
            groups[-1].append(i)
        else:
            groups.append([i])
            head = lens[i]
    return [sorted(g) for g in groups]  # batch order inside a group


def split_rows(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(decode rows: one query token each, other rows: prefill or a chunk of one)."""
    decode = [i for i, n in enumerate(meta.query_lens_host) if n == 1]
    other = [i for i, n in enumerate(meta.query_lens_host) if n != 1]
    return decode, other


@dataclass(slots=True)
class TorchPlan:
    meta: AttentionMetadata
    decode_groups: list[DecodeGroup]
    other_rows: list[int]
    # A pure-decode step in a single group needs no gather of queries or scatter of outputs.
    direct: bool
    decode_kernel: None = None  # this backend never runs the C++ decode kernel

    def store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        flat_k, flat_v = flat_caches(self.meta, layer_idx)
        k_scale, v_scale = store_scales(self.meta.kv_scales, layer_idx, k, v)
        fp8.store_slots(flat_k, self.meta.slot_mapping, k, k_scale)  # a narrower cache rounds here
        fp8.store_slots(flat_v, self.meta.slot_mapping, v, v_scale)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        key_cache, value_cache = self.meta.kv_caches[layer_idx]
        scales = layer_scales(self.meta.kv_scales, layer_idx)
        if self.direct:
            return decode_rows(q, key_cache, value_cache, self.decode_groups[0], scale, scales)
        out = torch.empty_like(q)  # [T, num_heads, head_dim]
        for group in self.decode_groups:
            out[group.tokens] = decode_rows(q[group.tokens], key_cache, value_cache, group, scale, scales)
        for i in self.other_rows:
            prefill_row(self.meta, layer_idx, i, q, k, v, scale, out)
        return out


class TorchPagedAttention:
    fused_cpu_layers = False

    def plan(self, meta: AttentionMetadata) -> TorchPlan:
        decode, other = split_rows(meta)
        groups = [_group(meta, rows) for rows in group_by_length(decode, meta.seq_lens_host)]
        return TorchPlan(meta, groups, other, direct=not other and len(groups) == 1)


def _group(meta: AttentionMetadata, rows: list[int]) -> DecodeGroup:
    block_size = meta.kv_caches[0][0].shape[1]
    dev = meta.seq_lens.device
    num_blocks = -(-max(meta.seq_lens_host[r] for r in rows) // block_size)
    index = torch.tensor(rows, device=dev)
    pos = torch.arange(num_blocks * block_size, device=dev)  # [L]
    return DecodeGroup(
        tokens=meta.query_start_loc[index].long(),
        # Whole blocks (contiguous block_size x kv_heads x head_dim runs), not single slots.
        blocks=meta.block_tables[index, :num_blocks].long().reshape(-1),
        mask=(pos < meta.seq_lens[index].long()[:, None])[:, None, None, :],
    )


def flat_caches(meta: AttentionMetadata, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K and V caches as [num_slots, kv_heads, head_dim] views."""
    key_cache, value_cache = meta.kv_caches[layer_idx]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    return key_cache.view(-1, num_kv_heads, head_dim), value_cache.view(-1, num_kv_heads, head_dim)


def decode_rows(qd, key_cache, value_cache, group: DecodeGroup, scale: float,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """qd [G, num_heads, D], one query token per decode row -> [G, num_heads, D]; kv_scales:
    an fp8 cache's (k_scale, v_scale)."""
    num_seqs = group.tokens.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_q_per_kv = qd.shape[1] // num_kv_heads
    # Query heads sharing a KV head become rows of one matrix: GQA without repeating K/V.
    qd = qd.reshape(num_seqs, num_kv_heads, num_q_per_kv, head_dim)  # [G, kv_heads, group, D]
    # index_select copies whole rows; several times faster on CPU than advanced indexing.
    kd = key_cache.index_select(0, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)  # [G, kv_heads, L, D]
    vd = value_cache.index_select(0, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    # no-ops unless the cache has its own dtype
    kd, vd = fp8.widen(kd, kv_scales[0], qd.dtype), fp8.widen(vd, kv_scales[1], qd.dtype)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale)
    return o.reshape(num_seqs, -1, head_dim)  # [G, num_heads, D]


def prefill_row(
    meta: AttentionMetadata, layer_idx: int, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float, out: torch.Tensor,
) -> None:
    """Attention of row i's query tokens (a prompt or a chunk of one), written into `out`,
    with its K/V already stored in the layer's cache. Over an fp8 cache every row reads the
    cache, a fresh prompt too: a prompt then attends to the same values whether its prefix
    came from the prefix cache, a swap, an earlier chunk or this step."""
    start = int(meta.query_start_loc[i])
    q_len, ctx_len = meta.query_lens_host[i], meta.seq_lens_host[i]
    end = start + q_len
    qi = q[start:end].transpose(0, 1)  # [num_heads, q_len, D]
    if ctx_len == q_len and meta.kv_scales is None:  # nothing cached before this chunk: use the fresh K/V
        ki = k[start:end].transpose(0, 1)  # [kv_heads, q_len, D]
        vi = v[start:end].transpose(0, 1)
        o = _sdpa(qi, ki, vi, is_causal=True, scale=scale)
    else:
        flat_k, flat_v = flat_caches(meta, layer_idx)
        block_size = meta.kv_caches[0][0].shape[1]
        num_blocks = -(-ctx_len // block_size)
        table = meta.block_tables[i, :num_blocks].long()
        offsets = torch.arange(block_size, device=q.device)
        slots = (table[:, None] * block_size + offsets).reshape(-1)[:ctx_len]
        k_scale, v_scale = layer_scales(meta.kv_scales, layer_idx)
        ki = fp8.widen(flat_k.index_select(0, slots), k_scale, q.dtype).transpose(0, 1)  # [kv_heads, ctx_len, D]
        vi = fp8.widen(flat_v.index_select(0, slots), v_scale, q.dtype).transpose(0, 1)
        qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= qpos  # [q_len, ctx_len]
        o = _sdpa(qi, ki, vi, attn_mask=mask, scale=scale)
    out[start:end] = o.transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA of one request, q [num_heads, q_len, D] over k/v [kv_heads, ctx_len, D].

    With a batch dimension PyTorch's fused CPU (flash) kernel takes the call; 3-D inputs fall
    back to the unfused math path, which is several times slower for long contexts.
    """
    return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True, **kwargs)[0]
