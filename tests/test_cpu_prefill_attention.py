"""The C++ paged prefill kernel (kernels/cpu_prefill_attention.py) against a plain PyTorch
reference (explicit masked softmax in float64), and the CPU backend that sends a step's
prefill rows to it in one call."""

from __future__ import annotations

import pytest
import torch
from streamengine.kernels.cpu_prefill_attention import PrefillPlan, paged_prefill, prefill_supported

from streamengine.models.attention import AttentionMetadata, store_and_attend

pytestmark = pytest.mark.skipif(
    not prefill_supported(4, 2, 64, 16), reason="no C++ kernels here (they need AVX-512 or AVX2, and g++)"
)


def make_case(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, seed=0):
    """Queries for every row's last query_lens[i] positions and a cache holding all seq_lens[i]
    positions, in blocks shuffled through the pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_of = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_of) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_of), dtype=torch.int32)
    for i, need in enumerate(blocks_of):
        tables[i, :need] = torch.tensor([perm.pop() for _ in range(need)], dtype=torch.int32)
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen) * 2
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def reference(query, key_cache, value_cache, tables, seq_lens, starts, rows, scale):
    """float64 causal attention of the listed rows; other rows' tokens stay NaN."""
    _, block_size, kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // kv_heads
    out = torch.full(query.shape, float("nan"), dtype=torch.float64)
    for r in rows:
        a, b, n = int(starts[r]), int(starts[r + 1]), int(seq_lens[r])
        slots = (tables[r].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        k = key_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)  # [n, heads, D]
        v = value_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[a:b].double(), k) * scale  # [heads, q_len, n]
        later = torch.arange(n)[None, :] > torch.arange(n - (b - a), n)[:, None]  # key after the query
        probs = scores.masked_fill(later, float("-inf")).softmax(-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def check(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, rows=None, dtype=torch.float32, seed=0):
    q, kc, vc, tables, lens, starts = make_case(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, seed)
    kc, vc = kc.to(dtype), vc.to(dtype)
    rows = list(range(len(query_lens))) if rows is None else rows
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, kc, vc, tables, lens, starts, torch.tensor(rows, dtype=torch.int64), scale, out)
    expected = reference(q, kc.float(), vc.float(), tables, lens, starts, rows, scale)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5, equal_nan=True)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 128), (2, 2, 64)])
@pytest.mark.parametrize("length", [1, 15, 17, 33])
def test_prompt_without_cached_prefix(block_size, heads, kv_heads, head_dim, length):
    check([length], [length], heads, kv_heads, head_dim, block_size)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128)])
@pytest.mark.parametrize("query_len,seq_len", [(17, 50), (33, 33 + 97), (15, 16), (2, 200)])
def test_chunk_after_a_cached_prefix(block_size, heads, kv_heads, head_dim, query_len, seq_len):
    check([query_len], [seq_len], heads, kv_heads, head_dim, block_size, seed=1)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_rows_of_different_lengths_in_one_call_leave_the_other_rows_alone(block_size):
    # Rows 1 and 4 are decode rows of the same step: not listed, so not written.
    query_lens, seq_lens = [15, 1, 33, 17, 1, 64], [15, 90, 70, 17, 5, 300]
    check(query_lens, seq_lens, 9, 3, 64, block_size, rows=[0, 2, 3, 5], seed=2)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128)])
def test_float16_cache_matches_reference_on_the_same_values(heads, kv_heads, head_dim):
    check([17, 33, 1], [17, 100, 40], heads, kv_heads, head_dim, 16, dtype=torch.float16, seed=3)


@pytest.mark.parametrize("heads,kv_heads,query_len", [
    (1, 1, 15), (2, 2, 17), (16, 1, 20), (40, 2, 5), (64, 1, 3),  # 1 to 4 lane vectors per item
])
def test_every_lane_width_and_long_contexts(heads, kv_heads, query_len):
    # Small head_dim keeps the reference quick; contexts span many 64-key tiles.
    check([query_len, 130], [query_len + 500, 260], heads, kv_heads, 16, 16, seed=4)


def test_strided_queries_are_read():
    q, kc, vc, tables, lens, starts = make_case([20, 7], [20, 40], 6, 2, 32, 16, seed=5)
    wide = torch.randn(q.shape[0], 8, 32)  # queries live in the first 6 heads of a wider tensor
    wide[:, :6] = q
    out = torch.empty_like(q)
    paged_prefill(wide[:, :6], kc, vc, tables, lens, starts, torch.tensor([0, 1]), 0.2, out)
    expected = reference(q, kc, vc, tables, lens, starts, [0, 1], 0.2)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


def test_large_scores_do_not_overflow():
    q, kc, vc, tables, lens, starts = make_case([40], [90], 2, 1, 16, 16, seed=6)
    q *= 100  # logits in the thousands: the running max keeps exp() in range
    out = torch.empty_like(q)
    paged_prefill(q, kc, vc, tables, lens, starts, torch.tensor([0]), 1.0, out)
    assert torch.isfinite(out).all()
    expected = reference(q, kc, vc, tables, lens, starts, [0], 1.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise_clear_errors():
    q, kc, vc, tables, lens, starts = make_case([5], [5], 4, 2, 24, 16)  # head_dim 24: unsupported
    assert not PrefillPlan.takes(q, kc)
    with pytest.raises(ValueError, match="head_dim=24"):
        paged_prefill(q, kc, vc, tables, lens, starts, torch.tensor([0]), 1.0, torch.empty_like(q))
    q, kc, vc, tables, lens, starts = make_case([5], [5], 4, 2, 32, 16)
    with pytest.raises(ValueError, match="block_tables must be a CPU torch.int32"):
        paged_prefill(q, kc, vc, tables.long(), lens, starts, torch.tensor([0]), 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="more query tokens"):
        paged_prefill(q, kc, vc, tables, lens - 1, starts, torch.tensor([0]), 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="float32 or float16 caches"):
        paged_prefill(q, kc.bfloat16(), vc.bfloat16(), tables, lens, starts, torch.tensor([0]), 1.0,
                      torch.empty_like(q))
    # What the C++ side would read or write out of bounds for.
    with pytest.raises(ValueError, match="rows must index"):
        paged_prefill(q, kc, vc, tables, lens, starts, torch.tensor([1]), 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="query and out must both be"):
        paged_prefill(q, kc, vc, tables, lens, starts, torch.tensor([0]), 1.0, torch.empty_like(q[:3]))
    with pytest.raises(ValueError, match="point past the cache"):
        paged_prefill(q, kc[:1], vc[:1], tables + 1, lens, starts, torch.tensor([0]), 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="cannot hold the longest context"):
        paged_prefill(q, kc, vc, tables, lens + 16, starts, torch.tensor([0]), 1.0, torch.empty_like(q))


def mixed_step(block_size: int, cache_dtype: torch.dtype = torch.float32):
    """A step of decode rows, a fresh prompt (row 1) and chunks after cached prefixes, K/V of
    the step not yet stored: (metadata, q, k, v, float64 reference output)."""
    query_lens, seq_lens = [1, 17, 1, 33, 15, 1], [40, 17, 7, 33 + 64, 15 + 100, 300]
    q, kc, vc, tables, lens, starts = make_case(query_lens, seq_lens, 9, 3, 64, block_size, seed=7)
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size
             for i, (n, s) in enumerate(zip(query_lens, seq_lens, strict=True)) for p in range(s - n, s)]
    k, v = torch.randn(q.shape[0], 3, 64), torch.randn(q.shape[0], 3, 64)  # [T, kv_heads, D]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=starts, seq_lens=lens, block_tables=tables,
        query_lens_host=query_lens, seq_lens_host=seq_lens, max_query_len=max(query_lens),
        kv_caches=[(kc.clone(), vc.clone())],
    )
    kc, vc = kc.float(), vc.float()  # the reference sees the cache's values...
    kc.view(-1, 3, 64)[meta.slot_mapping] = k.to(cache_dtype).float()
    vc.view(-1, 3, 64)[meta.slot_mapping] = v.to(cache_dtype).float()
    expected = reference(q, kc, vc, tables, lens, starts, range(len(query_lens)), 0.125)
    fresh_slots = meta.slot_mapping[1:18]  # ...but the fresh prompt's own K/V as computed
    kc.view(-1, 3, 64)[fresh_slots], vc.view(-1, 3, 64)[fresh_slots] = k[1:18], v[1:18]
    expected[1:18] = reference(q, kc, vc, tables, lens, starts, [1], 0.125)[1:18]
    return meta, q, k, v, expected


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_cpu_backend_sends_all_prefill_rows_to_one_kernel_call(block_size, monkeypatch):
    from streamengine.models import cpu_backend

    meta, q, k, v, expected = mixed_step(block_size)
    plan = cpu_backend.CpuPagedAttention().plan(meta)
    assert plan.other_rows == [1, 3, 4] and plan.prefill is not None
    monkeypatch.setattr(cpu_backend, "prefill_row", lambda *a: pytest.fail("SDPA ran for a prefill row"))
    out = store_and_attend(plan, 0, q, k, v, 0.125)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


def test_float16_cache_keeps_sdpa_for_prompts_without_cached_context(monkeypatch):
    from streamengine.models import cpu_backend

    meta, q, k, v, expected = mixed_step(16, torch.float16)
    plan = cpu_backend.CpuPagedAttention().plan(meta)
    assert plan.other_rows == [1, 3, 4] and plan.sdpa_rows == [1]
    sdpa_ran = []
    real_prefill_row = cpu_backend.prefill_row

    def prefill_row(meta, layer_idx, i, *args):
        sdpa_ran.append(i)
        real_prefill_row(meta, layer_idx, i, *args)

    monkeypatch.setattr(cpu_backend, "prefill_row", prefill_row)
    out = store_and_attend(plan, 0, q, k, v, 0.125)
    assert sdpa_ran == [1]
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


def test_cpu_backend_keeps_sdpa_for_shapes_the_kernel_refuses(monkeypatch):
    from streamengine.models import cpu_backend

    meta, q, k, v, expected = mixed_step(16)
    plan = cpu_backend.CpuPagedAttention().plan(meta)
    monkeypatch.setattr(type(plan.prefill), "takes", staticmethod(lambda query, key_cache: False))
    monkeypatch.setattr(type(plan.prefill), "run", lambda *a: pytest.fail("the refused kernel ran"))
    out = store_and_attend(plan, 0, q, k, v, 0.125)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)
