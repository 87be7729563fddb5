"""The packed CPU GEMM (kernels/cpu_gemm.cpp) and the native Llama/Qwen2 forward built on it.

The engine-level proof (greedy tokens equal transformers' generate, native and transformers
paths) is in test_engine_parity.py; here each part is checked on its own against PyTorch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from streamengine.kernels import cpu_build, cpu_linear, cpu_ops
from streamengine.kernels.cpu_linear import PackedLinear, TorchLinear, make_linear, pack_panels
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from streamengine import EngineConfig
from streamengine.models.attention import (
    ATTN_IMPLEMENTATION,
    AttentionMetadata,
    register_paged_attention,
)
from streamengine.models.loader import LoadedModel
from streamengine.models.model_runner import select_native
from streamengine.models.native import NativeDecoder, unsupported_reason
from streamengine.models.torch_backend import TorchPagedAttention

needs_kernel = pytest.mark.skipif(cpu_linear.load_library() is None, reason="no C++ kernels here (they need AVX-512 or AVX2, and g++)")


def test_pack_panels_layout():
    w = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)  # [N=5, K=3]
    panels = pack_panels(w, 4)  # [2, 3, 4]
    assert panels.shape == (2, 3, 4)
    assert torch.equal(panels[0], w[:4].T)
    assert torch.equal(panels[1, :, 0], w[4])
    assert torch.equal(panels[1, :, 1:], torch.zeros(3, 3))  # padding past N


@needs_kernel
@pytest.mark.parametrize("n,k", [(64, 64), (100, 37), (960, 576), (48, 1536)])
@pytest.mark.parametrize("m", [0, 1, 7, 8, 9, 23, cpu_linear.SMALL_M_MAX, cpu_linear.SMALL_M_MAX + 5])
def test_packed_linear_matches_torch(n, k, m):
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    lin = make_linear(w, b)
    assert isinstance(lin, PackedLinear)
    y = lin(x)
    assert y.shape == (m, n)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_packed_linear_rejects_wrong_width():
    lin = make_linear(torch.randn(48, 16))
    with pytest.raises(ValueError, match=r"\[M, 16\]"):
        lin(torch.randn(2, 17))


@needs_kernel
def test_packed_linear_reads_non_contiguous_input():
    w = torch.randn(96, 32)
    x = torch.randn(32, 10).T  # [10, 32], column-major
    torch.testing.assert_close(make_linear(w)(x), x @ w.T, rtol=1e-5, atol=1e-4)


def test_fallbacks_to_torch_linear(monkeypatch):
    w = torch.randn(8, 4, dtype=torch.float64)
    assert isinstance(make_linear(w), TorchLinear)  # only float32 is packed
    cpu_linear.load_library.cache_clear()
    cpu_build.load.cache_clear()
    monkeypatch.setenv("STREAMENGINE_CPU_KERNELS", "0")
    try:
        lin = make_linear(torch.randn(8, 4))
        assert isinstance(lin, TorchLinear)
        x = torch.randn(3, 4)
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    finally:
        cpu_linear.load_library.cache_clear()
        cpu_build.load.cache_clear()


@needs_kernel
def test_library_is_built_once_per_key(tmp_path):
    source = cpu_build.SOURCES
    first = cpu_build.build(source, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_build.build(source, tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_fused_ops_match_transformers(monkeypatch, kernels):
    """RoPE, add + RMSNorm and SiLU-times-up, through the C++ library and through the PyTorch
    fallback, against transformers' own modules."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    if kernels == "torch":
        monkeypatch.setattr(cpu_ops, "load_library", lambda: None)
    elif cpu_ops.load_library() is None:
        pytest.skip("no C++ kernels here (they need AVX-512 or AVX2, and g++)")
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 7 * 16, generator=gen)  # [T, (4 q + 1 k + 2 v heads) * D=16]
    angles = torch.randn(5, 8, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [T, D]
    heads = qkv[:, : 5 * 16].view(5, 5, 16)
    expected, _ = apply_rotary_pos_emb(heads, heads, cos, sin, unsqueeze_dim=1)
    untouched = qkv[:, 5 * 16:].clone()
    cpu_ops.rope_(qkv, 5, 16, angles.cos(), angles.sin())
    torch.testing.assert_close(qkv[:, : 5 * 16].view(5, 5, 16), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 5 * 16:], untouched)

    norm = LlamaRMSNorm(40, eps=1e-5)
    norm.weight.data = torch.randn(40, generator=gen)
    h, delta = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen)
    h_expected = h + delta
    out = cpu_ops.add_rms_norm(h, delta, norm.weight.data, 1e-5)
    torch.testing.assert_close(h, h_expected)  # residual updated in place
    torch.testing.assert_close(out, norm(h_expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_ops.add_rms_norm(h, None, norm.weight.data, 1e-5), norm(h), rtol=1e-5, atol=1e-5)

    gate_up = torch.randn(4, 2 * 37, generator=gen) * 6
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), F.silu(gate_up[:, :37]) * gate_up[:, 37:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 40])  # width below one vector; two vectors and a tail
@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_store_kv_writes_slots(monkeypatch, kernels, head_dim, cache_dtype):
    if kernels == "torch":
        monkeypatch.setattr(cpu_ops, "load_library", lambda: None)
    d = head_dim
    qkv = torch.randn(3, 4 * d) * 3  # k and v: one head each, after two q heads
    qkv[0, 2 * d : 2 * d + 3] = torch.tensor([1e5, 3e-7, -2.5e-6])  # overflow and subnormals in half
    k, v = qkv[:, 2 * d : 3 * d].view(3, 1, d), qkv[:, 3 * d :].view(3, 1, d)
    key_cache, value_cache = torch.zeros(2, 4, 1, d, dtype=cache_dtype), torch.zeros(2, 4, 1, d, dtype=cache_dtype)
    cpu_ops.store_kv(k, v, torch.tensor([5, 0, 7]), key_cache, value_cache)
    flat_k, flat_v = key_cache.view(8, d), value_cache.view(8, d)
    # Bit for bit what torch's conversion gives (round to nearest even).
    assert torch.equal(flat_k[[5, 0, 7]], k[:, 0].to(cache_dtype))
    assert torch.equal(flat_v[[5, 0, 7]], v[:, 0].to(cache_dtype))
    assert torch.equal(flat_k[[1, 2, 3, 4, 6]], torch.zeros(5, d, dtype=cache_dtype))


def test_unsupported_models_keep_the_transformers_path():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert "gpt2" in unsupported_reason(gpt2)
    loaded = LoadedModel(gpt2, None, "gpt2", Path("."))
    assert select_native(EngineConfig(model_impl="auto"), loaded, torch.device("cpu"), TorchPagedAttention()) is None
    with pytest.raises(ValueError, match="model_impl='native'"):
        select_native(EngineConfig(model_impl="native"), loaded, torch.device("cpu"), TorchPagedAttention())


def test_model_impl_is_validated():
    with pytest.raises(ValueError, match="EngineConfig.model_impl"):
        EngineConfig(model_impl="fast")


@pytest.mark.parametrize("folder_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_native_hidden_states_match_transformers(request, folder_fixture):
    """Two prompts packed in one varlen batch: the native forward's final hidden states equal
    transformers' decoder run on each prompt alone."""
    folder = request.getfixturevalue(folder_fixture)
    register_paged_attention()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION).eval()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    native = NativeDecoder(model, TorchPagedAttention())
    lens = [11, 20]
    ids = torch.randint(3, 1000, (sum(lens),), generator=torch.Generator().manual_seed(1))
    cfg = model.config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    caches = [(torch.zeros(4, 16, kv_heads, head_dim), torch.zeros(4, 16, kv_heads, head_dim))
              for _ in range(cfg.num_hidden_layers)]
    slots = list(range(11)) + list(range(32, 52))  # blocks 0 and 2-3
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, 11, 31], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor([[0, 0], [2, 3]], dtype=torch.int32),
        query_lens_host=lens, seq_lens_host=lens, max_query_len=20, kv_caches=caches,
    )
    plan = TorchPagedAttention().plan(meta)
    positions = torch.tensor(list(range(11)) + list(range(20)))
    with torch.inference_mode():
        got = native.forward(ids, positions, plan)
        for start, n in ((0, 11), (11, 20)):
            out = reference.model(input_ids=ids[None, start:start + n]).last_hidden_state[0]
            torch.testing.assert_close(got[start:start + n], out, rtol=1e-4, atol=1e-4)
        logits = native.logits(got[[10, 30]])
        torch.testing.assert_close(logits, reference.lm_head(got[[10, 30]]), rtol=1e-4, atol=1e-4)


def _packed_plan(model, lens, cached, backend, cache_dtype=torch.float32):
    """The backend's plan for one step: sequence i has `cached[i]` tokens already in the cache and
    `lens[i]` new ones (1 = a decode row), blocks laid out back to back from block 1."""
    cfg = model.config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    shape = (16, 16, kv_heads, head_dim)
    caches = [(torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype))
              for _ in range(cfg.num_hidden_layers)]
    tables, slots, positions, start = [], [], [], 1
    for n, c in zip(lens, cached, strict=True):
        blocks = list(range(start, start + -(-(n + c) // 16)))
        start += len(blocks)
        tables.append(blocks + [0] * (4 - len(blocks)))
        slots += [blocks[p // 16] * 16 + p % 16 for p in range(c, c + n)]
        positions += list(range(c, c + n))
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [n + c for n, c in zip(lens, cached, strict=True)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_host=list(lens), seq_lens_host=seq_lens, max_query_len=max(lens), kv_caches=caches,
    )
    return backend.plan(meta), torch.tensor(positions)


@needs_kernel
def test_fused_layers_match_the_op_by_op_path(tiny_qwen2_dir):
    """Qwen2 (q/k/v biases, hidden 96 padded to the panel width): a prefill step then a mixed
    step (decode rows and a chunk after cached context) give the same hidden states and the
    same cache contents through the fused two-call layers as through op-by-op calls."""
    from streamengine.models.cpu_backend import CpuPagedAttention

    register_paged_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION).eval()
    native = NativeDecoder(model, CpuPagedAttention())
    assert native.fused is not None
    fused = native.fused
    gen = torch.Generator().manual_seed(2)
    results = []
    for layers in (fused, None):
        native.fused = layers
        first, pos1 = _packed_plan(model, [20, 5, 33], [0, 0, 0], CpuPagedAttention())
        ids1 = torch.randint(3, 1000, (58,), generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            h1 = native.forward(ids1, pos1, first)
            second, pos2 = _packed_plan(model, [1, 1, 7], [20, 5, 33], CpuPagedAttention())
            second.meta.kv_caches = first.meta.kv_caches  # the same pool: the second step reads the first's K/V
            h2 = native.forward(torch.randint(3, 1000, (9,), generator=gen.manual_seed(6)), pos2, second)
        results.append((h1, h2, [k.clone() for k, _ in first.meta.kv_caches]))
    (a1, a2, ka), (b1, b2, kb) = results
    torch.testing.assert_close(a1, b1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a2, b2, rtol=1e-5, atol=1e-5)
    for x, y in zip(ka, kb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("folder_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_decode_stack_matches_the_per_layer_path(request, folder_fixture, cache_dtype):
    """A decode-only step (contexts of 21, 6 and 34 tokens, one on a block boundary) through
    the one-call DecodeStack gives the hidden states and caches of the per-layer fused calls,
    and of the PyTorch backend (SDPA over the gathered cache, index_copy_ stores)."""
    from streamengine.models.cpu_backend import CpuPagedAttention

    register_paged_attention()
    folder = request.getfixturevalue(folder_fixture)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION).eval()
    cpu_native = NativeDecoder(model, CpuPagedAttention())
    assert cpu_native.stack is not None
    stack = cpu_native.stack
    results = []
    for decode_stack, backend in ((stack, CpuPagedAttention), (None, CpuPagedAttention), (None, TorchPagedAttention)):
        # Built for the PyTorch backend, the native model runs op-by-op layers around its store.
        native = cpu_native if backend is CpuPagedAttention else NativeDecoder(model, backend())
        native.stack = decode_stack
        first, pos1 = _packed_plan(model, [20, 5, 33], [0, 0, 0], backend(), cache_dtype)
        ids1 = torch.randint(3, 1000, (58,), generator=torch.Generator().manual_seed(5))
        second, pos2 = _packed_plan(model, [1, 1, 1], [20, 5, 33], backend(), cache_dtype)
        second.meta.kv_caches = first.meta.kv_caches
        if decode_stack is not None:
            assert second.decode_kernel is not None
        with torch.inference_mode():
            native.forward(ids1, pos1, first)
            h = native.forward(torch.tensor([7, 70, 700]), pos2, second)
        results.append((h, [c.clone() for pair in first.meta.kv_caches for c in pair]))
    (a, ca), *others = results
    for b, cb in others:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for x, y in zip(ca, cb, strict=True):
            assert x.dtype == cache_dtype
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_decode_stack_rejects_mismatched_inputs(tiny_llama_dir):
    from streamengine.models.cpu_backend import CpuPagedAttention

    register_paged_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION).eval()
    native = NativeDecoder(model, CpuPagedAttention())
    step, positions = _packed_plan(model, [1, 1], [3, 9], CpuPagedAttention())
    meta, plan = step.meta, step.decode_kernel
    hidden = model.config.hidden_size
    h, x = torch.zeros(2, hidden), torch.zeros(2, hidden)
    cos, sin = native._rope_tables(h, positions)
    with pytest.raises(ValueError, match="caches for"):
        native.stack.run(h, x, cos, sin, meta.slot_mapping, meta.kv_caches[:-1], plan, native.scale)
    with pytest.raises(ValueError, match="one query token per row"):
        native.stack.run(torch.zeros(3, hidden), torch.zeros(3, hidden), cos, sin, meta.slot_mapping,
                         meta.kv_caches, plan, native.scale)
    for caches in ([(k.half(), v) for k, v in meta.kv_caches], [(k.bfloat16(), v.bfloat16()) for k, v in meta.kv_caches]):
        with pytest.raises(ValueError, match="float32 or float16 caches"):
            native.stack.run(h, x, cos, sin, meta.slot_mapping, caches, plan, native.scale)
    first_half = [(k.half(), v.half()) if i == 0 else (k, v) for i, (k, v) in enumerate(meta.kv_caches)]
    with pytest.raises(ValueError, match="all alike"):
        native.stack.run(h, x, cos, sin, meta.slot_mapping, first_half, plan, native.scale)
    with pytest.raises(ValueError, match="contiguous"):
        strided = [(k.transpose(1, 2).contiguous().transpose(1, 2), v) for k, v in meta.kv_caches]
        native.stack.run(h, x, cos, sin, meta.slot_mapping, strided, plan, native.scale)
    mixed, _ = _packed_plan(model, [1, 4], [3, 0], CpuPagedAttention())
    assert mixed.decode_kernel is None  # a prefill row: the per-layer path runs


async def test_engine_without_cpu_kernels_matches_transformers(tiny_llama_dir, monkeypatch):
    """STREAMENGINE_CPU_KERNELS=0 (or a machine with neither AVX-512 nor AVX2, or no compiler): the native
    model runs on PyTorch ops and still equals transformers' greedy output."""
    from streamengine.kernels import cpu_attention, cpu_layer
    from test_engine_parity import engine_greedy, hf_greedy, tokenize

    for lib in (cpu_build.load, cpu_linear.load_library, cpu_ops.load_library, cpu_layer.load_library,
                cpu_attention.load_library):
        lib.cache_clear()
    monkeypatch.setenv("STREAMENGINE_CPU_KERNELS", "0")
    try:
        prompts = tokenize(tiny_llama_dir, ["The capital of France is", "List three colors:"], repeat=3)
        expected = hf_greedy(tiny_llama_dir, prompts, 24)
        got, _ = await engine_greedy(tiny_llama_dir, prompts, 24, model_impl="native")
        assert got == expected
    finally:
        for lib in (cpu_build.load, cpu_linear.load_library, cpu_ops.load_library, cpu_layer.load_library,
                    cpu_attention.load_library):
            lib.cache_clear()

