"""Kernel tests: Triton paged attention, reshape_and_cache, copy/swap blocks, and the references.

Without CUDA the Triton kernels run in the Triton interpreter, which must be switched on
before triton is first imported; this module sets TRITON_INTERPRET=1 before importing it. If
something imported triton first in compiled mode (torch._dynamo does, through transformers),
this whole module is skipped and tests/test_kernels_subprocess.py reruns it in a fresh
interpreter-mode process instead. On a CUDA machine the same tests run natively.

Expected outputs come from a naive float64 attention over contiguous per-request K/V, built
independently of the paged cache; the kernels and ref_paged_attention are both checked
against it. Tolerances (absolute and relative, on outputs of magnitude ~1):
fp32 1e-4 (the kernel runs fp32 dots in IEEE mode, no TF32), fp16 5e-3, bf16 3e-2.
"""

from __future__ import annotations

import os

import torch

NATIVE = torch.cuda.is_available()
if not NATIVE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from streamengine import kernels as K  # noqa: E402

R = K.reference  # the module, so tests can patch its constants
DEVICE = torch.device("cuda" if NATIVE else "cpu")
RUNNABLE = K.triton_available()
TOL = {
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}
REPO = Path(__file__).resolve().parents[1]

# Everything here is skipped when the kernels cannot run in this process (no CUDA, and triton
# imported in compiled mode before this module); tests/test_kernels_subprocess.py then runs
# this file in a fresh process with TRITON_INTERPRET=1.
pytestmark = pytest.mark.skipif(
    not RUNNABLE,
    reason="no CUDA and triton was imported in compiled mode before this module; "
    "tests/test_kernels_subprocess.py runs this file in interpreter mode",
)


# ---------------------------------------------------------------------------------------------
# Batch construction


@dataclass(slots=True)
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim], contiguous
    values: list[torch.Tensor]
    scale: float
    max_query_len: int

    def args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 5,
) -> Batch:
    """Requests with their blocks scattered over a shuffled pool; unused slots hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    # NaN everywhere a kernel must not read: spare blocks and the tails of last blocks.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    keys, values = [], []
    used = 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = perm[used : used + n]
        used += n
        block_tables[i, :n] = ids.to(torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        key_cache[ids[pos // block_size], pos % block_size] = k
        value_cache[ids[pos // block_size], pos % block_size] = v
        keys.append(k)
        values.append(v)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    return Batch(
        query=query.to(DEVICE),
        key_cache=key_cache.to(DEVICE),
        value_cache=value_cache.to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        keys=keys,
        values=values,
        scale=head_dim**-0.5,
        max_query_len=max(query_lens),
    )


def naive_attention(batch: Batch) -> torch.Tensor:
    """float64 causal attention from the contiguous per-request K/V (never the paged cache)."""
    query = batch.query.cpu().double()
    out = torch.zeros_like(query)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        begin, end = starts[i], starts[i + 1]
        q = query[begin:end]  # [q_len, num_heads, head_dim]
        group = q.shape[1] // batch.keys[i].shape[1]
        k = batch.keys[i].double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = batch.values[i].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        q_pos = torch.arange(seq_len - (end - begin), seq_len)
        visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    assert not actual.isnan().any(), "NaN in output: a masked or unused slot leaked"
    tol = TOL[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.double(), atol=tol, rtol=tol)


# A mix in one packed batch: decode, prefill after a cached prefix, full prefill, a chunk in
# the middle of a prompt, and a one-token context. No length is a multiple of the block size.
MIXED_QUERY_LENS = [1, 5, 19, 7, 1]
MIXED_SEQ_LENS = [37, 23, 19, 45, 1]

# (block_size, head_dim, num_kv_heads, group): covers block sizes 8/16/32, head dims
# 64/80/96/128 and GQA ratios 1/3/4 without the full cross product (the interpreter is slow).
GEOMETRIES = [
    (8, 64, 2, 1),
    (16, 80, 1, 3),
    (32, 96, 2, 4),
    (16, 128, 1, 1),
    (8, 96, 1, 3),
    (32, 64, 1, 4),
]


# ---------------------------------------------------------------------------------------------
# Paged attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "bs{}-d{}-kv{}-g{}".format(*g))
def test_paged_attention_mixed_batch(
    geometry: tuple[int, int, int, int], dtype: torch.dtype
) -> None:
    block_size, head_dim, num_kv_heads, group = geometry
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        num_kv_heads * group,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
    )
    expected = naive_attention(batch)
    out = K.paged_attention(*batch.args(), max_query_len=batch.max_query_len)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_paged_attention_decode_batch(group: int, dtype: torch.dtype) -> None:
    # Every request decodes one token (the BLOCK_Q = 1 path); max_query_len left to the wrapper.
    batch = make_batch([1, 1, 1, 1], [9, 50, 17, 33], 2 * group, 2, 64, 16, dtype, seed=group)
    out = K.paged_attention(*batch.args())
    assert_close(out, naive_attention(batch), dtype)


@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_random_batches(seed: int) -> None:
    # Random geometry and packing: request counts, query lengths (0 included), contexts.
    rng = torch.Generator().manual_seed(100 + seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    block_size, head_dim, group = pick([8, 16, 32]), pick([64, 80, 96, 128]), pick([1, 2, 3, 4])
    num_kv_heads = pick([1, 2])
    num_seqs = int(torch.randint(1, 5, (1,), generator=rng))
    query_lens = [int(x) for x in torch.randint(0, 10, (num_seqs,), generator=rng)]
    query_lens[0] = max(query_lens[0], 1)
    seq_lens = [q + int(torch.randint(0, 70, (1,), generator=rng)) for q in query_lens]
    seq_lens = [max(s, 1) for s in seq_lens]
    dtype = torch.float32 if seed % 2 == 0 else torch.float16
    batch = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads * group,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=seed,
    )
    out = K.paged_attention(*batch.args())
    assert_close(out, naive_attention(batch), dtype)


def test_paged_attention_bf16() -> None:
    # On CPU the wrapper upcasts bf16 tiles to fp32 before tl.dot (the interpreter's bf16 dot
    # is wrong); on CUDA this runs the native bf16 dot.
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 6, 2, 64, 16, torch.bfloat16, seed=3)
    out = K.paged_attention(*batch.args(), max_query_len=batch.max_query_len)
    assert_close(out, naive_attention(batch), torch.bfloat16)


@pytest.mark.parametrize("num_kv_splits,head_dim", [(2, 64), (5, 64), (3, 80)])
def test_paged_attention_split_kv(num_kv_splits: int, head_dim: int) -> None:
    # Split-KV is chosen automatically only for CUDA decode; forcing it here also covers
    # empty splits (short requests), multi-token queries and a padded head_dim in the merge.
    batch = make_batch([1, 4, 1], [70, 40, 3], 4, 2, head_dim, 16, torch.float32, seed=7)
    out = K.paged_attention(
        *batch.args(), max_query_len=4, num_kv_splits=num_kv_splits, max_seq_len=70
    )
    assert_close(out, naive_attention(batch), torch.float32)


def test_paged_attention_rejects_bad_split_counts() -> None:
    batch = make_batch([1], [70], 4, 2, 64, 16, torch.float32, seed=7)
    for bad in (0, 257):
        with pytest.raises(ValueError, match="num_kv_splits must be in 1..256"):
            K.paged_attention(*batch.args(), max_query_len=1, num_kv_splits=bad)


def test_split_count_fills_an_idle_gpu_only() -> None:
    from streamengine.kernels.paged_attention import split_count

    sms = 132
    # A batch with 3+ programs per SM already fills the GPU; a short context is not worth the
    # merge's launch.
    assert split_count(3 * sms, sms, 16384, 64) == 1
    assert split_count(3 * sms - 1, sms, 16384, 64) == 6  # ceil(16 * 132 / 395)
    assert split_count(8, sms, 2047, 64) == 1
    # Below that, splits bring the programs to about 16 per SM...
    assert split_count(256, sms, 16384, 32) == 9  # ceil(16 * 132 / 256)
    assert 16 * sms <= 96 * split_count(96, sms, 16384, 64) < 16 * sms + 96
    # ...while each split keeps at least 2 key tiles, and there are never more than 64.
    assert split_count(8, sms, 2048, 64) == 2048 // (2 * 64)
    assert split_count(1, sms, 1 << 20, 32) == 64


def test_paged_attention_mqa_and_empty_request() -> None:
    # One KV head for 8 query heads, and a request with no new tokens in the middle.
    batch = make_batch([3, 0, 2], [20, 11, 2], 8, 1, 80, 8, torch.float16, seed=11)
    out = K.paged_attention(*batch.args(), max_query_len=3)
    assert_close(out, naive_attention(batch), torch.float16)


def test_paged_attention_writes_into_out() -> None:
    batch = make_batch([2, 1], [10, 5], 4, 2, 64, 16, torch.float32, seed=5)
    out = torch.full_like(batch.query, 7.0)
    result = K.paged_attention(*batch.args(), max_query_len=2, out=out)
    assert result is out
    assert_close(out, naive_attention(batch), torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_paged_attention_longer_sequences(dtype: torch.dtype) -> None:
    # Several query tiles per request (70 new tokens) and many key tiles (up to 300 keys).
    batch = make_batch([70, 1, 33], [300, 129, 33], 8, 2, 128, 16, dtype, seed=13)
    out = K.paged_attention(*batch.args(), max_query_len=70)
    assert_close(out, naive_attention(batch), dtype)


def test_paged_attention_rejects_bad_inputs() -> None:
    batch = make_batch([2], [5], 4, 2, 64, 16, torch.float32)
    q, kc, vc, bt, sl, qsl, scale = batch.args()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        K.paged_attention(q[:, :3], kc, vc, bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="dtypes differ"):
        K.paged_attention(q.half(), kc, vc, bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="number of requests"):
        K.paged_attention(q, kc, vc, bt, sl, qsl[:1], scale)
    with pytest.raises(ValueError, match="head_dim"):
        K.paged_attention(q[..., :32], kc, vc, bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="int32 or int64"):
        K.paged_attention(q, kc, vc, bt.float(), sl, qsl, scale)
    with pytest.raises(ValueError, match="out must match"):
        K.paged_attention(q, kc, vc, bt, sl, qsl, scale, out=q.half())


# ---------------------------------------------------------------------------------------------
# Reference implementation (the engine's CPU path)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("geometry", GEOMETRIES[:3], ids=lambda g: "bs{}-d{}-kv{}-g{}".format(*g))
def test_ref_paged_attention(geometry: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    block_size, head_dim, num_kv_heads, group = geometry
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        num_kv_heads * group,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
    )
    assert_close(R.ref_paged_attention(*batch.args()), naive_attention(batch), dtype)


def test_ref_decode_batching_splits_into_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tiny gather budget forces one decode per chunk; the result must not change.
    batch = make_batch([1, 1, 1, 2], [40, 7, 25, 9], 6, 3, 64, 8, torch.float32, seed=2)
    whole = R.ref_paged_attention(*batch.args())
    monkeypatch.setattr(R, "_DECODE_GATHER_ELEMENTS", 1)
    chunked = R.ref_paged_attention(*batch.args())
    assert_close(whole, naive_attention(batch), torch.float32)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# reshape_and_cache, copy_blocks, swap_blocks


def cache_pair(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(
        shape, dtype=dtype, device=DEVICE
    )


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "dtype"),
    [(2, 64, 16, torch.float32), (3, 80, 8, torch.float16), (1, 96, 32, torch.bfloat16)],
)
def test_reshape_and_cache(
    num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 12, 21
    # key/value as slices of a fused qkv projection: non-contiguous token and head strides.
    qkv = (
        torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    )
    key, value = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 20]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    key_cache, value_cache = cache_pair(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    K.reshape_and_cache(key, value, key_cache, value_cache, slots)
    ref_k, ref_v = cache_pair(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    R.ref_reshape_and_cache(key, value, ref_k, ref_v, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    keep = slots >= 0
    assert torch.equal(key_cache.flatten(0, 1)[slots[keep]], key[keep])
    # Exactly the non-padding tokens were written: every other slot is still zero.
    written = (key_cache.flatten(0, 1) != 0).flatten(1).any(1)
    assert int(written.sum()) == int(keep.sum())


def test_reshape_and_cache_rejects_bad_inputs() -> None:
    key_cache, value_cache = cache_pair(4, 16, 2, 64, torch.float32)
    key = torch.randn(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slots for"):
        K.reshape_and_cache(
            key, key, key_cache, value_cache, torch.zeros(2, dtype=torch.int64, device=DEVICE)
        )
    with pytest.raises(ValueError, match="one dtype"):
        K.reshape_and_cache(
            key.half(),
            key.half(),
            key_cache,
            value_cache,
            torch.zeros(3, dtype=torch.int64, device=DEVICE),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_copy_blocks(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    shape = (10, 8, 3, 80)
    key_caches = [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(3)]
    value_caches = [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(3)]
    ref_k = [c.clone() for c in key_caches]
    ref_v = [c.clone() for c in value_caches]
    mapping = torch.tensor([[1, 4], [7, 0], [2, 9]], dtype=torch.int64)
    K.copy_blocks(key_caches, value_caches, mapping)
    R.ref_copy_blocks(ref_k, ref_v, mapping)
    for got, want in zip(key_caches + value_caches, ref_k + ref_v, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(key_caches[2][4], key_caches[2][1]) and torch.equal(
        value_caches[0][0], value_caches[0][7]
    )


def test_copy_blocks_rejects_overlapping_pairs() -> None:
    key_cache, value_cache = cache_pair(4, 16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="overlap"):
        K.copy_blocks([key_cache], [value_cache], torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(ValueError, match=r"\[num_pairs, 2\]"):
        K.copy_blocks([key_cache], [value_cache], torch.tensor([0, 1]))


def test_swap_blocks_round_trip() -> None:
    gen = torch.Generator().manual_seed(6)
    device_pool = torch.randn(12, 16, 2, 64, generator=gen).to(DEVICE)
    host_pool = torch.zeros(6, 16, 2, 64, pin_memory=NATIVE)
    out_map = torch.tensor([[3, 0], [4, 1], [5, 2], [9, 5]])  # runs: 3..5 -> 0..2, then 9 -> 5
    stream = torch.cuda.Stream() if NATIVE else None
    if stream is not None:  # the swap stream must see the pools' initialisation
        stream.wait_stream(torch.cuda.current_stream())
    K.swap_blocks(device_pool, host_pool, out_map, stream=stream)
    if stream is not None:
        stream.synchronize()
    assert torch.equal(host_pool[:3], device_pool[3:6].cpu())
    assert torch.equal(host_pool[5], device_pool[9].cpu())
    assert not host_pool[3:5].any()
    restored = torch.zeros_like(device_pool)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    K.swap_blocks(
        host_pool, restored, torch.tensor([[0, 7], [1, 8], [2, 9], [5, 1]]), stream=stream
    )
    if stream is not None:
        stream.synchronize()
    assert torch.equal(restored[7:10], device_pool[3:6]) and torch.equal(
        restored[1], device_pool[9]
    )
    with pytest.raises(ValueError, match="outside pools"):
        K.swap_blocks(device_pool, host_pool, torch.tensor([[0, 6]]))


def test_swap_runs_coalesce_consecutive_pairs() -> None:
    from streamengine.kernels.copy_blocks import _runs

    assert _runs([[3, 0], [4, 1], [5, 2], [9, 5], [10, 6], [2, 7]]) == [
        (3, 0, 3),
        (9, 5, 2),
        (2, 7, 1),
    ]


# ---------------------------------------------------------------------------------------------
# Triton dispatch, int64 offsets, interpreter fallback


def test_triton_available_matches_environment() -> None:
    assert K.triton_available() == (NATIVE or K.triton_interpreted())
    if not NATIVE and RUNNABLE:
        assert K.triton_interpreted()


INT64_SCRIPT = textwrap.dedent(
    """
    import torch
    from streamengine import kernels as K

    # Two 4 GiB fp16 caches whose last blocks start past 2**31 elements. On CPU they are
    # committed lazily: only the pages of the blocks written below are ever touched.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block_size, head_dim = 16, 64
    num_blocks = (1 << 21) + 2
    shape = (num_blocks, block_size, 1, head_dim)
    key_cache = torch.empty(shape, dtype=torch.float16, device=device)
    value_cache = torch.empty(shape, dtype=torch.float16, device=device)
    assert key_cache.stride(0) * (num_blocks - 1) > 2**31
    blocks = [num_blocks - 1, 3, num_blocks - 2]
    seq_len = 40
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(seq_len, 1, head_dim, generator=gen).half().to(device)
    value = torch.randn(seq_len, 1, head_dim, generator=gen).half().to(device)
    pos = torch.arange(seq_len)
    slots = (torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size).to(device)
    K.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[num_blocks - 1, :, 0], key[:16, 0])
    assert torch.equal(value_cache[num_blocks - 2, :8, 0], value[32:, 0])
    query = torch.randn(5, 2, head_dim, generator=gen).half().to(device)
    meta = [torch.tensor(x, dtype=torch.int32, device=device) for x in ([blocks], [seq_len], [0, 5])]
    args = (key_cache, value_cache, *meta, 0.125)
    out = K.paged_attention(query, *args)
    ref = K.ref_paged_attention(query, *args)
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)
    K.copy_blocks([key_cache], [value_cache], torch.tensor([[num_blocks - 1, 5]]))
    assert torch.equal(key_cache[5], key_cache[num_blocks - 1])
    print("INT64-OK")
    """
)


@pytest.mark.slow
def test_offsets_past_int32_range() -> None:
    """Blocks past 2**31 elements are read and written at the right addresses.

    Runs in a subprocess: an int32 overflow in a kernel's address arithmetic accesses memory
    outside the cache, which can crash the interpreter process or poison the CUDA context.
    """
    env = dict(os.environ)
    if not NATIVE:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", INT64_SCRIPT],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "INT64-OK" in proc.stdout, proc.stdout + proc.stderr


COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from streamengine.kernels.copy_blocks import _copy_blocks_kernel
    from streamengine.kernels.paged_attention import _paged_attention_kernel, _tile_config
    from streamengine.kernels.reshape_and_cache import _reshape_and_cache_kernel

    TARGET = GPUTarget("cuda", 90, 32)


    def build(fn, pointers, consts, num_warps=4):
        sig = {name: "i32" for name in fn.arg_names}
        sig.update({name: "i64" for name in fn.arg_names if name.startswith("stride_")})
        sig.update(pointers)
        sig.update({name: "constexpr" for name in consts})
        idx = {(fn.arg_names.index(name),): value for name, value in consts.items()}
        src = ASTSource(fn=fn, signature=sig, constexprs=idx)
        triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": 2})


    def attention(dtype, block_size, head_dim, group, max_query_len, partial, fp8=0):
        head_dim_p = max(16, triton.next_power_of_2(head_dim))
        group_p, block_q, block_r, tile_n, num_warps = _tile_config(max_query_len, group, head_dim_p)
        cache = "*u8" if fp8 else f"*{dtype}"  # an fp8 cache is handed over as its bytes
        ptrs = {"query_ptr": f"*{dtype}", "key_cache_ptr": cache, "value_cache_ptr": cache}
        ptrs.update({p: "*i32" for p in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")})
        ptrs.update(out_ptr="*fp32" if partial else f"*{dtype}", lse_ptr="*fp32", qk_scale="fp32", v_scale="fp32")
        consts = dict(
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, GROUP=group,
            GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_R=block_r, TILE_N=tile_n, PARTIAL=partial,
            UPCAST=False, DOT_PRECISION="ieee" if dtype == "fp32" else None, FP8=fp8,
        )
        build(_paged_attention_kernel, ptrs, consts, num_warps)


    attention("fp16", 16, 64, 3, 1, True)  # split-KV decode, GQA 3
    attention("bf16", 8, 80, 4, 512, False)  # prefill, GQA 4, head_dim padded to 128
    attention("fp16", 16, 64, 3, 1, True, fp8=1)  # the same over fp8 caches: e4m3
    attention("bf16", 8, 80, 4, 512, False, fp8=2)  # e5m2
    for fp8 in (0, 1, 2):
        cache = "*u8" if fp8 else "*fp16"
        build(
            _reshape_and_cache_kernel,
            {"key_ptr": "*fp16", "value_ptr": "*fp16", "key_cache_ptr": cache, "value_cache_ptr": cache}
            | {"slot_mapping_ptr": "*i64", "k_inv_scale": "fp32", "v_inv_scale": "fp32"},
            dict(BLOCK_SIZE=16, HEAD_DIM=80, ROW=240, BLOCK_T=16, BLOCK_E=256, FP8=fp8),
        )
    build(
        _copy_blocks_kernel,
        {"key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16", "block_mapping_ptr": "*i64"},
        dict(CHUNK=4096),
    )
    print("COMPILE-OK")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(NATIVE, reason="on CUDA every kernel test compiles natively")
def test_kernels_compile_for_sm90() -> None:
    """The compiled (non-interpreted) path: each kernel builds for an H100-class GPU.

    Without a GPU the tests above only run the interpreter, which accepts code that the
    Triton compiler rejects (types, dot shapes, control flow). Triton can compile for a GPU
    target without one, using its bundled ptxas, so this checks that the kernels at least
    build, to a cubin, for representative configurations. It cannot check they run correctly.
    """
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", COMPILE_SCRIPT],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "COMPILE-OK" in proc.stdout, proc.stdout + proc.stderr[-6000:]
