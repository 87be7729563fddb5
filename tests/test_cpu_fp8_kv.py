"""8-bit float KV caches in the C++ CPU kernels: the store's codes and the kernels' reads bit
for bit against torch's conversion (kernels/fp8.py), and decode and prefill attention over
such caches against a PyTorch reference that dequantizes first."""

from __future__ import annotations

import pytest
import torch
from streamengine.kernels import cpu_ops, fp8, ref_paged_attention
from streamengine.kernels.cpu_attention import decode_supported, paged_decode
from streamengine.kernels.cpu_prefill_attention import paged_prefill
from test_cpu_decode_kernel import make_case as decode_case
from test_cpu_prefill_attention import make_case as prefill_case
from test_cpu_prefill_attention import reference as prefill_reference

pytestmark = pytest.mark.skipif(
    not decode_supported(4, 2, 64, 16), reason="no C++ kernels here (they need AVX-512 or AVX2, and g++)"
)
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def hard_values(dtype: torch.dtype) -> torch.Tensor:
    """Values at every rounding edge of the format: ties between codes (even and odd), the
    subnormal range and its boundary, saturation, infinities, NaN, signed zeros; then random
    values across the whole exponent range."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2  # exact ties in float32
    limit = fp8.fp8_max(dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), limit * 1.04, -limit * 1.1,
                            limit * 2, 1e-30, -1e-30, 2.0**-10, 2.0**-17, 2.0**-18, 3 * 2.0**-18])
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-24, 20, (4096,), generator=gen).float())
    out = torch.cat([finite, mids, mids.nextafter(torch.tensor(float("inf"))),
                     mids.nextafter(torch.tensor(-float("inf"))), special, spread])
    return out[: out.numel() // 48 * 48]  # rows of 3 heads x 16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.7])
@pytest.mark.parametrize("head_dim", [16, 8])  # 8: rows of 24 values, so the scalar tail runs too
def test_store_writes_torchs_codes_bit_for_bit(dtype, scale, head_dim):
    values = hard_values(dtype).view(-1, 3, head_dim)  # [tokens, kv_heads, head_dim]
    k, v = values * scale, values.flip(0) * scale
    tokens = k.shape[0]
    key_cache = torch.zeros(tokens + 5, 1, 3, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(tokens + 5, generator=torch.Generator().manual_seed(1))[:tokens]
    cpu_ops.store_kv(k, v, slots, key_cache, value_cache, scale, scale * 2)
    assert torch.equal(bits(key_cache.view(-1, 3, head_dim)[slots]), bits(fp8.quantize(k, scale, dtype)))
    assert torch.equal(bits(value_cache.view(-1, 3, head_dim)[slots]), bits(fp8.quantize(v, scale * 2, dtype)))


@pytest.mark.parametrize("dtype", FORMATS)
def test_kernel_reads_every_code_as_torch_does(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    assert torch.equal(bits(cpu_ops.fp8_to_float(codes)), bits(codes.float()))  # NaN payloads included


def quantized_pair(kc: torch.Tensor, vc: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float):
    return fp8.quantize(kc, k_scale, dtype), fp8.quantize(vc, v_scale, dtype)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("num_seqs", [3, 40])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (20, 10, 16)])
def test_decode_over_fp8_matches_dequantized_reference(dtype, num_seqs, heads, kv_heads, head_dim):
    lens = ([1, 7, 16, 17, 33, 100, 257] * 6)[:num_seqs]
    q, kc, vc, tables, seq_lens, qsl = decode_case(lens, heads, kv_heads, head_dim, 16, seed=5)
    k_scale, v_scale = 0.02, 0.005  # values of about 1: codes around 50 and 200
    k8, v8 = quantized_pair(kc, vc, dtype, k_scale, v_scale)
    expected = ref_paged_attention(q, fp8.dequantize(k8, k_scale), fp8.dequantize(v8, v_scale), tables,
                                   seq_lens, qsl, scale=head_dim**-0.5)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, k8, v8, tables, seq_lens, qsl, torch.arange(len(lens)), head_dim**-0.5, out, k_scale, v_scale)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    # And quantization is real: the same attention over the float32 cache differs.
    exact = ref_paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=head_dim**-0.5)
    assert (out - exact).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("query_lens,seq_lens", [([17], [17]), ([33, 2, 15], [130, 200, 15])])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128)])
def test_prefill_over_fp8_matches_dequantized_reference(dtype, query_lens, seq_lens, heads, kv_heads, head_dim):
    q, kc, vc, tables, lens, starts = prefill_case(query_lens, seq_lens, heads, kv_heads, head_dim, 16, seed=2)
    k_scale, v_scale = 0.03, 0.004
    k8, v8 = quantized_pair(kc, vc, dtype, k_scale, v_scale)
    rows = list(range(len(query_lens)))
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, k8, v8, tables, lens, starts, torch.tensor(rows), scale, out, k_scale, v_scale)
    expected = prefill_reference(q, fp8.dequantize(k8, k_scale), fp8.dequantize(v8, v_scale), tables, lens,
                                 starts, rows, scale)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


def test_scales_are_checked():
    q, kc, vc, tables, seq_lens, qsl = decode_case([5], 4, 2, 32, 16)
    k8, v8 = quantized_pair(kc, vc, torch.float8_e4m3fn, 1.0, 1.0)
    rows, out = torch.tensor([0]), torch.empty_like(q)
    with pytest.raises(ValueError, match="must be > 0"):
        paged_decode(q, k8, v8, tables, seq_lens, qsl, rows, 1.0, out, 0.0, 1.0)
    with pytest.raises(ValueError, match="scales other than 1 for a torch.float16 cache"):
        paged_decode(q, kc.half(), vc.half(), tables, seq_lens, qsl, rows, 1.0, out, 2.0, 1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        cpu_ops.store_kv(q[:, :2], q[:, :2], torch.tensor([0]), k8, v8, -1.0, 1.0)
    with pytest.raises(ValueError, match="float32 or float16 caches, or float8"):
        paged_decode(q, k8, v8.half(), tables, seq_lens, qsl, rows, 1.0, out)
