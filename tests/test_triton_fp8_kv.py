"""fp8 KV caches in the Triton kernels (interpreted on CPU, as tests/test_kernels.py runs
them): reshape_and_cache writes torch's codes bit for bit, paged attention over the codes
matches a reference that dequantizes first, and the engine's Triton backend over fp8 gives the
PyTorch backend's tokens."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from streamengine.kernels import fp8  # noqa: E402
from test_cpu_fp8_kv import hard_values  # noqa: E402

from streamengine import kernels as K  # noqa: E402

pytestmark = pytest.mark.skipif(not K.triton_available(), reason="triton imported in compiled mode, no CUDA")
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.0173])
def test_reshape_and_cache_writes_torchs_codes(dtype, scale):
    values = hard_values(dtype).view(-1, 3, 16)  # [tokens, kv_heads, head_dim]
    k, v = values * scale, values.flip(0) * scale * 3
    tokens = k.shape[0]
    key_cache = torch.zeros(tokens // 4 + 2, 4, 3, 16, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(key_cache.shape[0] * 4, generator=torch.Generator().manual_seed(2))[:tokens]
    K.reshape_and_cache(k, v, key_cache, value_cache, slots, scale, scale * 3)
    for cache, x, s in ((key_cache, k, scale), (value_cache, v, scale * 3)):
        stored = cache.view(-1, 3, 16)[slots].view(torch.uint8)
        assert torch.equal(stored, fp8.quantize(x, s, dtype).view(torch.uint8))


def paged_case(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, k_scale, v_scale):
    """A varlen batch over an fp8 cache in shuffled blocks, and the float32 caches it decodes to."""
    gen = torch.Generator().manual_seed(4)
    blocks_of = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_of) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k8 = fp8.quantize(torch.randn(shape, generator=gen), k_scale, dtype)
    v8 = fp8.quantize(torch.randn(shape, generator=gen), v_scale, dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_of), dtype=torch.int32)
    for i, n in enumerate(blocks_of):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    exact = (fp8.dequantize(k8, k_scale), fp8.dequantize(v8, v_scale))
    return query, (k8, v8), exact, tables, lens, starts


@pytest.mark.parametrize("dtype", FORMATS)
def test_paged_attention_over_fp8_matches_dequantized_reference(dtype):
    # Decode rows, a prompt and a chunk after a cached prefix in one launch; GQA 4:2, head_dim 32.
    k_scale, v_scale = 0.02, 0.005
    query_lens, seq_lens = [1, 9, 1, 5], [20, 9, 3, 40]
    q, (k8, v8), (kf, vf), tables, lens, starts = paged_case(query_lens, seq_lens, 4, 2, 32, 8, dtype,
                                                              k_scale, v_scale)
    out = K.paged_attention(q, k8, v8, tables, lens, starts, 32**-0.5, max_query_len=9,
                            k_scale=k_scale, v_scale=v_scale)
    expected = K.ref_paged_attention(q, kf, vf, tables, lens, starts, scale=32**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", FORMATS)
def test_one_key_returns_each_value_code_exactly(dtype):
    # With a single key the softmax weight is exactly 1: the output is the dequantized V row,
    # so every code's widening shows exactly (infinities and NaN codes included).
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)  # head_dim 256
    v8 = codes.view(1, 1, 1, 256).clone()
    k8 = torch.zeros_like(v8)
    q = torch.randn(1, 1, 256)
    one = torch.ones(1, dtype=torch.int32)
    out = K.paged_attention(q, k8, v8, one.view(1, 1) * 0, one, torch.tensor([0, 1], dtype=torch.int32), 1.0,
                            max_query_len=1, k_scale=1.0, v_scale=0.5)
    torch.testing.assert_close(out[0, 0], codes.float() * 0.5, rtol=0, atol=0, equal_nan=True)


def test_scales_are_checked():
    cache = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn)
    x = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="must be > 0"):
        K.reshape_and_cache(x, x, cache, cache.clone(), torch.tensor([0]), 0.0, 1.0)
    with pytest.raises(ValueError, match="and 1 for a torch.float32 cache"):
        K.reshape_and_cache(x, x, cache.float(), cache.float(), torch.tensor([0]), 2.0, 1.0)


ENGINE_SCRIPT = r"""
import asyncio, json, sys
from streamengine import AsyncEngine, EngineConfig, SamplingParams

async def run(backend):
    cfg = EngineConfig(model=sys.argv[1], attention_backend=backend, num_gpu_blocks=24, kv_cache_dtype="fp8",
                       max_num_batched_tokens=24)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    async with AsyncEngine(cfg) as eng:
        async def one(prompt):
            async for out in eng.generate(prompt, p):
                pass
            c = out.outputs[0]
            return c.token_ids, [e[t] for e, t in zip(c.logprobs, c.token_ids)]
        # 24 tokens of budget chunk the first prompt; the second hits its 2-block prefix.
        prefix = list(range(100, 132))
        return [await one(prefix + [7, 8, 9]), *await asyncio.gather(one(prefix + [10, 11]), one([5, 6, 7]))]

print(json.dumps({b: asyncio.run(run(b)) for b in ("torch", "triton")}))
"""


@pytest.mark.slow
def test_triton_backend_over_fp8_matches_the_pytorch_backend(untied_llama_dir):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(untied_llama_dir)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(result["triton"], result["torch"], strict=True):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
