"""The attention backends (models/*_backend.py) against the kernels' PyTorch reference: the
PyTorch backend with its length grouping, and the C++ CPU backend on the same mixed step.

The C++ decode kernel on its own is tested in test_cpu_decode_kernel.py."""

from __future__ import annotations

import random

import pytest
import torch
from streamengine.kernels import ref_paged_attention
from streamengine.kernels.cpu_attention import decode_supported

from streamengine.models.attention import AttentionMetadata, store_and_attend
from streamengine.models.torch_backend import TorchPagedAttention, group_by_length


def test_group_by_length_bounds_padding():
    rng = random.Random(0)
    lens = [int(rng.lognormvariate(5, 1)) + 1 for _ in range(200)]
    groups = group_by_length(list(range(200)), lens, min_ratio=0.6)
    assert sorted(i for g in groups for i in g) == list(range(200))
    for g in groups:
        assert g == sorted(g)
        assert min(lens[i] for i in g) >= 0.6 * max(lens[i] for i in g)


def mixed_step():
    """Decode rows of very different lengths plus a chunked prefill after a cached prefix:
    (metadata, q, k, v, the reference output)."""
    torch.manual_seed(0)
    block_size, kv_heads, heads, dim, num_blocks = 16, 2, 6, 32, 64
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    seq_lens = [5, 300, 40, 290, 21, 17]  # rows 0-3 decode; 4: 5 new tokens; 5: a fresh prompt
    query_lens = [1, 1, 1, 1, 5, 17]
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb] + [0] * (20 - nb))
        used += nb
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = []
    for table, n, q in zip(tables, seq_lens, query_lens, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - q, n)]
    T = starts[-1]
    q = torch.randn(T, heads, dim)
    k = torch.randn(T, kv_heads, dim)
    v = torch.randn(T, kv_heads, dim)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_host=query_lens, seq_lens_host=seq_lens, max_query_len=max(query_lens),
        kv_caches=[(key_cache.clone(), value_cache.clone())],
    )
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    ref_k.view(-1, kv_heads, dim)[meta.slot_mapping] = k
    ref_v.view(-1, kv_heads, dim)[meta.slot_mapping] = v
    expected = ref_paged_attention(
        q, ref_k, ref_v, meta.block_tables, meta.seq_lens, meta.query_start_loc, dim**-0.5
    )
    return meta, q, k, v, expected


def test_mixed_step_matches_reference():
    meta, q, k, v, expected = mixed_step()
    plan = TorchPagedAttention().plan(meta)
    assert len(plan.decode_groups) >= 2  # lengths 300/290 apart from 40/5
    out = store_and_attend(plan, 0, q, k, v, q.shape[-1]**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not decode_supported(6, 2, 32, 16), reason="no C++ kernels here (they need AVX-512 or AVX2, and g++)")
def test_cpu_backend_mixed_step_matches_reference():
    """The kernel takes the decode rows, the PyTorch backend's SDPA the two prefill rows."""
    from streamengine.models.cpu_backend import CpuPagedAttention

    meta, q, k, v, expected = mixed_step()
    plan = CpuPagedAttention().plan(meta)
    assert plan.decode is not None and plan.other_rows == [4, 5]
    assert plan.decode_kernel is None  # prefill rows in the step: no whole-stack decode
    out = store_and_attend(plan, 0, q, k, v, q.shape[-1]**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
