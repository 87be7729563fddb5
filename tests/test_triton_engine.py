"""The engine's greedy output with the Triton backend (interpreted on CPU) equals the torch
backend's, with speculative decoding too. Runs in a subprocess: TRITON_INTERPRET must be set
before triton is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from streamengine import AsyncEngine, EngineConfig

SCRIPT = r"""
import asyncio, json, sys
from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.config import SpeculativeConfig

class FixedBar:  # a StepCost stand-in: every draft as long as lookup gives
    def threshold(self, batch_size):
        return 0.0

    def observe(self, rows, seconds):
        pass

async def run(backend, speculative=None):
    cfg = EngineConfig(model=sys.argv[1], attention_backend=backend, num_gpu_blocks=24,
                       max_num_batched_tokens=24, speculative=speculative)
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    async with AsyncEngine(cfg) as eng:
        # Drafts as long as lookup gives, whatever the interpreter's step times teach the
        # draft-length rule (its fit is timing, so on a loaded machine it might propose nothing).
        eng.core.step_cost = FixedBar()
        async def one(prompt):
            async for out in eng.generate(prompt, p):
                pass
            return out.outputs[0].token_ids
        # A shared 2-block prefix: the second request prefills after a cache hit; 24 tokens of
        # budget chunk the first prompt; decode rows and prefill rows share steps.
        prefix = list(range(100, 132))
        first = await one(prefix + [7, 8, 9])
        rest = await asyncio.gather(one(prefix + [10, 11]), one([5, 6, 7]))
        if speculative is not None:
            rest.append(eng.stats()["spec_decode_num_accepted_tokens"])
        return [first, *rest]

# Speculation's proposal rows are decode rows over the same blocks: the Triton kernels too.
spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
out = {b: asyncio.run(run(b)) for b in ("torch", "triton")}
out["triton_speculative"] = asyncio.run(run("triton", spec))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_triton_backend_matches_torch_backend(tiny_llama_dir):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama_dir)], env=env, capture_output=True,
        text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["torch"]
    *tokens, accepted = result["triton_speculative"]
    assert tokens == result["torch"] and accepted > 0


def test_triton_backend_refused_on_cpu_without_interpreter(tiny_llama_dir, monkeypatch):
    """Without the interpreter, Triton's kernels cannot take CPU tensors: the engine refuses the
    backend up front. The tests run with the interpreter on, so it is switched off here where
    the backend asks for it."""
    from streamengine.models import triton_backend

    monkeypatch.setattr(triton_backend, "triton_interpreted", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        AsyncEngine(EngineConfig(model=str(tiny_llama_dir), attention_backend="triton", num_gpu_blocks=8,
                                 device="cpu"))
