"""The C++ paged decode kernel (kernels/cpu_attention.py) on its own, against the PyTorch
reference. The backends built on it are tested in test_attention_backends.py."""

from __future__ import annotations

import pytest
import torch
from streamengine.kernels import ref_paged_attention
from streamengine.kernels.cpu_attention import decode_supported, paged_decode

pytestmark = pytest.mark.skipif(
    not decode_supported(4, 2, 64, 16), reason="no C++ kernels here (they need AVX-512 or AVX2, and g++)"
)


def make_case(lens, heads, kv_heads, head_dim, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # blocks anywhere in the pool
    max_blocks = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        tables[i, :need] = torch.tensor([perm.pop() for _ in range(need)], dtype=torch.int32)
    query = torch.randn(len(lens), heads, head_dim, generator=gen) * 2  # one token per sequence
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32), qsl


@pytest.mark.parametrize("num_seqs", [7, 40])  # few: a work item per KV head; many: per sequence
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (16, 1, 32), (20, 10, 16)])
def test_decode_matches_reference(block_size, heads, kv_heads, head_dim, num_seqs):
    lens = ([1, 7, 16, 17, 33, 100, 257] * 6)[:num_seqs]
    q, kc, vc, tables, seq_lens, qsl = make_case(lens, heads, kv_heads, head_dim, block_size)
    expected = ref_paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=head_dim**-0.5)
    out = torch.full_like(q, float("nan"))
    rows = torch.arange(len(lens), dtype=torch.int64)
    paged_decode(q, kc, vc, tables, seq_lens, qsl, rows, head_dim**-0.5, out)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_only_listed_rows_are_written_and_strided_queries_are_read():
    lens = [5, 40, 19]
    q, kc, vc, tables, seq_lens, qsl = make_case(lens, 6, 2, 32, 16, seed=3)
    wide = torch.randn(3, 8, 32)  # queries live in the first 6 heads of a wider tensor
    wide[:, :6] = q
    out = torch.zeros_like(q)
    paged_decode(wide[:, :6], kc, vc, tables, seq_lens, qsl, torch.tensor([0, 2]), 0.2, out)
    expected = ref_paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=0.2)
    torch.testing.assert_close(out[[0, 2]], expected[[0, 2]], rtol=2e-5, atol=2e-5)
    assert torch.equal(out[1], torch.zeros(6, 32))


def test_large_scores_do_not_overflow():
    q, kc, vc, tables, seq_lens, qsl = make_case([50], 2, 1, 16, 16, seed=1)
    q *= 100  # logits in the thousands: the running max keeps exp() in range
    expected = ref_paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=1.0)
    out = torch.empty_like(q)
    paged_decode(q, kc, vc, tables, seq_lens, qsl, torch.tensor([0]), 1.0, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise_clear_errors():
    q, kc, vc, tables, seq_lens, qsl = make_case([5], 4, 2, 24, 16)  # head_dim 24: unsupported
    with pytest.raises(ValueError, match="head_dim=24"):
        paged_decode(q, kc, vc, tables, seq_lens, qsl, torch.tensor([0]), 1.0, torch.empty_like(q))
    q, kc, vc, tables, seq_lens, qsl = make_case([5], 4, 2, 32, 16)
    with pytest.raises(ValueError, match="block_tables must be a CPU torch.int32"):
        paged_decode(q, kc, vc, tables.long(), seq_lens, qsl, torch.tensor([0]), 1.0, torch.empty_like(q))


@pytest.mark.parametrize("num_seqs", [3, 40])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (20, 10, 16)])
def test_float16_cache_matches_reference_on_the_same_values(heads, kv_heads, head_dim, num_seqs):
    # The kernel widens each half to float32 exactly, so it must match the float32 reference
    # run on the widened cache as closely as a float32 cache does.
    lens = ([1, 7, 16, 17, 33, 100, 257] * 6)[:num_seqs]
    q, kc, vc, tables, seq_lens, qsl = make_case(lens, heads, kv_heads, head_dim, 16, seed=5)
    kc16, vc16 = kc.half(), vc.half()
    expected = ref_paged_attention(q, kc16.float(), vc16.float(), tables, seq_lens, qsl, scale=head_dim**-0.5)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, kc16, vc16, tables, seq_lens, qsl, torch.arange(len(lens)), head_dim**-0.5, out)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_cache_dtypes_the_kernel_does_not_take_are_refused():
    q, kc, vc, tables, seq_lens, qsl = make_case([5], 4, 2, 32, 16)
    rows, out = torch.tensor([0]), torch.empty_like(q)
    for k, v in ((kc.bfloat16(), vc.bfloat16()), (kc.half(), vc), (kc.double(), vc.double())):
        with pytest.raises(ValueError, match="float32 or float16 caches"):
            paged_decode(q, k, v, tables, seq_lens, qsl, rows, 1.0, out)
