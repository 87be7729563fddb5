"""CLI: `python -m streamengine generate ...` and `python -m streamengine serve ...`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from streamengine.config import DTYPES, KV_CACHE_DTYPES, EngineConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=DTYPES)
    g.add_argument("--device", default="auto")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-bytes", type=int, default=None, help="KV pool budget in bytes (default 512 MiB)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache element type (auto: the model's dtype)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides bytes)")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"])
    g.add_argument("--preemption-mode", default="recompute", choices=["auto", "recompute", "swap"])
    g.add_argument("--swap-space-bytes", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", type=int, default=None)


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, dtype=a.dtype, device=a.device, block_size=a.block_size,
        kv_cache_bytes=a.kv_cache_bytes, kv_cache_dtype=a.kv_cache_dtype, num_gpu_blocks=a.num_blocks,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching, attention_backend=a.attention_backend,
        preemption_mode=a.preemption_mode, swap_space_bytes=a.swap_space_bytes, seed=a.seed,
        num_threads=a.num_threads,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _engine_args(gen)

    serve = sub.add_parser("serve", help="start the HTTP/WebSocket server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)))
    serve.add_argument("--api-key", default=os.environ.get("STREAMENGINE_API_KEY"))
    serve.add_argument("--allowed-origin", action="append", default=[], help="repeatable")
    serve.add_argument("--max-prompt-tokens", type=int, default=None)
    _engine_args(serve)
    return parser


async def _generate(a: argparse.Namespace) -> None:
    from streamengine.engine import AsyncEngine
    from streamengine.sampling import SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.sample_seed)
    async with AsyncEngine(config_from_args(a)) as engine:
        prompt = engine.apply_chat_template([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
        shown = 0
        async for out in engine.generate(prompt, params):
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
        sys.stdout.write("\n")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if a.command == "generate":
            _run(_generate(a))
        else:
            from streamengine.server import run_server

            run_server(
                config_from_args(a), host=a.host, port=a.port, api_key=a.api_key,
                allowed_origins=a.allowed_origin, max_prompt_tokens=a.max_prompt_tokens,
            )
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
