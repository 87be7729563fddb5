"""The default model run from its GGUF file's blocks (weight_format="packed"): greedy tokens
equal transformers' on the dequantized weights and the dequantized engine's, with logprobs
equal up to float32 rounding (the packed kernels compute the same float32 GEMM, decode-sized
batches with each block's scale factored out of its sum). Where the kernels cannot run,
"auto" falls back to the dequantized weights with the same tokens and "packed" says why it
cannot run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch
from streamengine.kernels import cpu_quant_linear
from transformers import AutoModelForCausalLM

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.models import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In 1492, Columbus sailed across the Atlantic Ocean and",
    "Write a short poem about the sea. " * 12,  # 100+ tokens: several blocks, a longer prefill
]
MAX_TOKENS = 12

needs_kernels = pytest.mark.skipif(cpu_quant_linear.load_library() is None, reason="no C++ kernels here (they need AVX-512 or AVX2, and g++)")


@pytest.fixture(scope="module")
def gguf_model(smollm_dir):
    return load_model(None, "float32", "cpu")  # the default GGUF file (its converted copy is cached)


async def generate(engine: AsyncEngine, prompts: list[str], **params) -> list[tuple[list[int], list[float]]]:
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, **params)

    async def one(prompt: str):
        final = None
        async for out in engine.generate(prompt, sampling):
            final = out
        sample = final.outputs[0]
        return sample.token_ids, [entry[tok] for entry, tok in zip(sample.logprobs, sample.token_ids, strict=True)]

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def run(loaded, prompts: list[str], **config) -> tuple[str, list]:
    async with AsyncEngine(EngineConfig(num_threads=2, **config), loaded=loaded) as engine:
        return engine.weight_format, await generate(engine, prompts)


@pytest.fixture(scope="module")
def packed_outputs(gguf_model):
    """The default engine's greedy outputs on the GGUF model: packed, chosen by "auto"."""
    fmt, outs = asyncio.run(run(gguf_model, PROMPTS))
    assert fmt == "packed"
    return outs


@needs_kernels
async def test_packed_equals_dequantized_and_transformers(gguf_model, packed_outputs):
    fmt, dequantized = await run(gguf_model, PROMPTS, weight_format="dequantized")
    assert fmt == "dequantized"
    assert [tokens for tokens, _ in packed_outputs] == [tokens for tokens, _ in dequantized]
    for (_, packed_lp), (_, float_lp) in zip(packed_outputs, dequantized, strict=True):
        torch.testing.assert_close(torch.tensor(packed_lp), torch.tensor(float_lp), rtol=0, atol=1e-3)
    reference = AutoModelForCausalLM.from_pretrained(gguf_model.source, dtype=torch.float32).eval()
    tok = gguf_model.tokenizer
    with torch.inference_mode():
        for prompt, (tokens, _) in zip(PROMPTS, packed_outputs, strict=True):
            ids = torch.tensor([tok.encode(prompt)])
            out = reference.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                     attention_mask=torch.ones_like(ids))
            assert tokens == out[0, ids.shape[1]:].tolist(), prompt


@needs_kernels
async def test_packed_only_where_it_can_run(gguf_model, smollm_dir):
    folder = load_model(str(smollm_dir), "float32", "cpu")
    fmt, _ = await run(folder, PROMPTS[:1])
    assert fmt == "dequantized"  # "auto" on a folder of float weights
    with pytest.raises(ValueError, match="weight_format='packed' cannot run: the model is not a GGUF file"):
        await run(folder, PROMPTS[:1], weight_format="packed")
    with pytest.raises(ValueError, match="weight_format='packed' cannot run: the native decoder does not run"):
        await run(gguf_model, PROMPTS[:1], weight_format="packed", model_impl="transformers")


FALLBACK = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
from test_packed_weights import PROMPTS, run
from streamengine.models import load_model
loaded = load_model(None, "float32", "cpu")
fmt, outs = asyncio.run(run(loaded, PROMPTS))
try:
    asyncio.run(run(loaded, PROMPTS[:1], weight_format="packed"))
    refused = ""
except ValueError as exc:
    refused = str(exc)
print(json.dumps({"format": fmt, "tokens": [t for t, _ in outs], "refused": refused}))
"""


@needs_kernels
def test_without_the_kernels_auto_falls_back_with_the_same_tokens(packed_outputs):
    """STREAMENGINE_CPU_KERNELS=0 stands for a CPU without the kernels: the PyTorch path runs."""
    env = {**os.environ, "STREAMENGINE_CPU_KERNELS": "0", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", FALLBACK, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["format"] == "dequantized"
    assert "the C++ kernels do not run here" in result["refused"]
    assert result["tokens"] == [t for t, _ in packed_outputs]


@needs_kernels
async def test_int8_weight_only_mode_is_close_to_the_float_model(smollm_dir):
    """Opt-in and not exact: every weight matrix quantized to Q8_0 at load. A regression guard
    on how close it stays (greedy, deterministic): every first token agrees with the float
    model's, and at least half the prompts agree on all their tokens."""
    folder = load_model(str(smollm_dir), "float32", "cpu")
    fmt, int8 = await run(folder, PROMPTS, weight_format="int8")
    assert fmt == "int8"
    _, exact = await run(folder, PROMPTS, weight_format="dequantized")
    assert [lp for _, lp in int8] != [lp for _, lp in exact]  # the weights really were quantized
    assert all(a[0] == b[0] for (a, _), (b, _) in zip(int8, exact, strict=True))
    assert sum(a == b for (a, _), (b, _) in zip(int8, exact, strict=True)) >= len(PROMPTS) / 2


@needs_kernels
async def test_int8_activations_stay_close_to_the_exact_weights(gguf_model, packed_outputs):
    """Opt-in and not exact: the packed Q4_1/Q8_0 weights multiply int8-quantized inputs. A
    regression guard on how close it stays (greedy, deterministic): every first token agrees
    with the exact packed engine's, and at least half the prompts agree on all their tokens."""
    fmt, int8 = await run(gguf_model, PROMPTS, int8_activations=True)
    assert fmt == "packed"
    assert [lp for _, lp in int8] != [lp for _, lp in packed_outputs]  # the inputs really were quantized
    assert all(a[0] == b[0] for (a, _), (b, _) in zip(int8, packed_outputs, strict=True))
    assert sum(a == b for (a, _), (b, _) in zip(int8, packed_outputs, strict=True)) >= len(PROMPTS) / 2


@needs_kernels
async def test_int8_activations_without_packed_weights_say_why(gguf_model):
    with pytest.raises(ValueError, match="int8_activations needs a GGUF model's Q4 weights running packed, "
                                         "not here: weight_format='dequantized'"):
        await run(gguf_model, PROMPTS, int8_activations=True, weight_format="dequantized")


@needs_kernels
async def test_a_bfloat16_checkpoint_runs_as_bfloat16_bit_for_bit(tiny_llama_dir):
    """Float weights that are all bfloat16 values (a bfloat16 checkpoint loaded as float32) are
    kept as bfloat16 under "auto", half the bytes, with the float32 results exactly."""
    loaded = load_model(str(tiny_llama_dir), "float32", "cpu")
    loaded.model.to(torch.bfloat16).to(torch.float32)  # every weight now a bfloat16 value
    fmt, halves = await run(loaded, PROMPTS)
    assert fmt == "packed"
    fmt, floats = await run(loaded, PROMPTS, weight_format="dequantized")
    assert fmt == "dequantized"
    assert halves == floats
    unrounded = load_model(str(tiny_llama_dir), "float32", "cpu")
    fmt, _ = await run(unrounded, PROMPTS[:1])
    assert fmt == "dequantized"  # float32 values that are not bfloat16 stay float32
