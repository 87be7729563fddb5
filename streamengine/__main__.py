"""CLI: `python -m streamengine generate ...` and `python -m streamengine serve ...`.

API and admin keys come from repeatable options, else from STREAMENGINE_API_KEY /
STREAMENGINE_ADMIN_KEY (comma-separated lists); `--tenants FILE` (TOML) adds tenants with their
own keys, shares, limits and pinned system prompts. Usage errors, including a refused open
bind and a bad tenants file, exit with code 2 before the model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from streamengine.config import FIELD_TYPES, EngineConfig, SpeculativeConfig
from streamengine.server import _run  # the one event-loop runner (uvloop when installed)
from streamengine.server.config import (
    DEFAULT_AUTH_TIMEOUT_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_UNAUTHENTICATED,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    DEFAULT_WRITE_TIMEOUT_S,
    ServerConfig,
)
from streamengine.server.tenants_file import TenantsFile, TenantsFileError, load_tenants_file
from streamengine.structured.tool_calls import TOOL_PARSERS
from streamengine.tenancy.tenants import TenantConfig

# Spellings the CLI had before its options were generated; the field's own name works too.
_OPTION_NAMES = {
    "num_gpu_blocks": ("--num-blocks", "--num-gpu-blocks"),
    "enable_prefix_caching": ("--prefix-caching", "--enable-prefix-caching"),  # and --no-...
    "speculative": ("--speculative", "--speculative-config"),
}


def _int_or_none(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def _float_or_none(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _speculative_config(text: str) -> SpeculativeConfig | None:
    """vLLM's --speculative-config: a JSON object of SpeculativeConfig's fields, or 'none'."""
    if text.strip().lower() == "none":
        return None
    try:
        values = json.loads(text)
        if not isinstance(values, dict):
            raise ValueError(f"expected a JSON object, got {text!r}")
        return SpeculativeConfig.from_mapping(values)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"--speculative: {exc}") from None


def _lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry: name=folder, or vLLM's JSON {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
            return str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"--lora-modules: expected {{\"name\": ..., \"path\": ...}}, got {text!r}") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=folder, got {text!r}")
    return name, path


def _tenants_file(path: str) -> TenantsFile:
    """Parsed while the command line is: a bad file is a usage error (exit 2) naming the entry."""
    try:
        return load_tenants_file(path)
    except TenantsFileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_PARSERS: dict[Any, Any] = {
    int: int, int | None: _int_or_none, float: float, float | None: _float_or_none, str: str, str | None: str,
    tuple[TenantConfig, ...]: _tenants_file,
    SpeculativeConfig | None: _speculative_config,
}
_METAVARS: dict[Any, str] = {int: "N", int | None: "N", float: "X", float | None: "X", tuple[TenantConfig, ...]: "FILE",
                             SpeculativeConfig | None: "JSON"}
_MORE_HELP = {
    "tenants": "; FILE is TOML: [[tenants]] tables of name, api_key or api_key_sha256, weight, max_running, "
               "max_kv_fraction, tokens_per_minute, max_n, max_best_of, system_prompt (pinned at start), and an optional "
               "top-level shared_prefix (pinned for every tenant)",
    "speculative": '; JSON as vLLM\'s --speculative-config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\', or none',
}


def _engine_args(p: argparse.ArgumentParser) -> None:
    """One option per EngineConfig field: default, choices and help come from the field."""
    g = p.add_argument_group("engine", "EngineConfig's fields; an integer option takes 'none' for None")
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        default = getattr(defaults, f.name)
        names = _OPTION_NAMES.get(f.name, (f"--{f.name.replace('_', '-')}",))
        help_text = f"{f.metadata['help']}{_MORE_HELP.get(f.name, '')} (default: {_shown(default)})"
        help_text = help_text.replace("%", "%%")
        g.add_argument(*names, dest=f.name, default=default, help=help_text, **_value_kind(f))
    g.add_argument("--enforce-eager", dest="cuda_graphs", action="store_const", const="off",
                   help="vLLM's spelling of --cuda-graphs off: every step eager")


def _value_kind(f: dataclasses.Field) -> dict[str, Any]:
    hint = FIELD_TYPES[f.name]
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if hint == tuple[tuple[str, str], ...]:  # --lora-modules a=/x b=/y
        return {"type": _lora_module, "nargs": "*", "metavar": "NAME=FOLDER"}
    if hint not in _PARSERS:
        raise TypeError(f"EngineConfig.{f.name}: the CLI has no parser for {hint}")
    kind: dict[str, Any] = {"type": _PARSERS[hint]}
    if f.metadata["choices"]:
        kind["choices"] = f.metadata["choices"]
    elif hint in _METAVARS:
        kind["metavar"] = _METAVARS[hint]
    return kind


def _shown(value: object) -> str:
    if value == ():
        return "none"
    return str(value).lower() if value is None or isinstance(value, bool) else str(value)


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(a, f.name) for f in dataclasses.fields(EngineConfig)}
    if isinstance(values["tenants"], TenantsFile):  # the option holds the whole file: keys and prompts too
        values["tenants"] = values["tenants"].tenants
    return EngineConfig(**values)


def tenants_of(a: argparse.Namespace) -> TenantsFile | None:
    return a.tenants if isinstance(a.tenants, TenantsFile) else None


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
    _serve_args(serve)
    _engine_args(serve)
    return parser


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1); any other needs a key or --allow-unauthenticated")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)))
    # Repeatable options start from None, not from the environment: argparse would append
    # to an environment default instead of replacing it.
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="repeatable; default: $STREAMENGINE_API_KEY, a comma-separated list")
    p.add_argument("--admin-key", action="append", default=None, metavar="KEY",
                   help="repeatable; an API key that may also read /metrics and /v1/kv_state; "
                        "default: $STREAMENGINE_ADMIN_KEY, a comma-separated list")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback address without any key (trusted networks only)")
    p.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="repeatable; browser origin allowed to call the API (* = any)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="repeatable; Host name to answer besides the loopback ones (*.example.com, * = any)")
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--tool-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from the model's output (default hermes: "
                        "<tool_call>{...}</tool_call>, the format tools are rendered in for "
                        "templates that cannot render them)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help=f"authenticated WebSockets at once; more get 503 (default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--max-unauthenticated", type=int, default=DEFAULT_MAX_UNAUTHENTICATED, metavar="N",
                   help="WebSockets still to authenticate at once, apart from --max-connections; more get "
                        f"503 (default {DEFAULT_MAX_UNAUTHENTICATED})")
    p.add_argument("--auth-timeout", type=float, default=DEFAULT_AUTH_TIMEOUT_S, metavar="SECONDS",
                   help="close a WebSocket that has not authenticated this long after its handshake "
                        f"(default {DEFAULT_AUTH_TIMEOUT_S:g})")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S, metavar="SECONDS",
                   help="close an HTTP connection that has not sent a whole request head this long after "
                        f"opening or after its last response (default {DEFAULT_IDLE_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                   help=f"answer 408 to a POST whose body is not whole this long after its head "
                        f"(default {DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT_S, metavar="SECONDS",
                   help="drop a streamed response whose client takes no bytes this long, aborting its "
                        f"request (default {DEFAULT_WRITE_TIMEOUT_S:g})")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="end a request this long after it arrived (default: no limit)")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="SECONDS",
                   help=f"/ready is 503 once the engine has work but no progress for this long "
                        f"(default {DEFAULT_STALL_TIMEOUT_S:g})")
    g = p.add_argument_group("cluster", "scale out on Ray Serve (pip install -e '.[ray]')")
    g.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="serve N engine replicas on Ray Serve behind one ingress, routed by cached "
                        "blocks (default 0: one engine in this process, no Ray)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (default: start a local one)")
    g.add_argument("--router", default="cached", choices=("cached", "pow2", "ray_prefix"),
                   help="how requests are placed on replicas (default cached: the replica holding the "
                        "longest chain of the prompt's blocks)")
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="X",
                   help="Ray CPUs per replica, also its torch threads unless --num-threads (default 1)")
    g.add_argument("--replica-gpus", type=float, default=0.0, metavar="X",
                   help="Ray GPUs per replica (default 0; 1 gives each replica a GPU of its own)")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                   help=f"on SIGTERM/SIGINT, how long requests in flight may finish before they are "
                        f"aborted (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")


def resolve_keys(cli: list[str] | None, env: str | None) -> list[str]:
    """The keys given on the command line, else those of the variable (a comma list)."""
    if cli:
        return list(cli)
    return [key.strip() for key in (env or "").split(",") if key.strip()]


def server_config(a: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The server's options from parsed `serve` options, the environment and the tenants file."""
    env = os.environ if environ is None else environ
    return ServerConfig(
        host=a.host, port=a.port,
        api_key=resolve_keys(a.api_key, env.get("STREAMENGINE_API_KEY")),
        admin_keys=resolve_keys(a.admin_key, env.get("STREAMENGINE_ADMIN_KEY")),
        allow_unauthenticated=a.allow_unauthenticated,
        allowed_origins=list(a.allowed_origin), allowed_hosts=list(a.allowed_host),
        max_prompt_tokens=a.max_prompt_tokens, max_connections=a.max_connections,
        request_timeout=a.request_timeout, stall_timeout=a.stall_timeout,
        shutdown_timeout=a.shutdown_timeout, tenants=tenants_of(a),
        tool_parser=a.tool_parser, max_unauthenticated=a.max_unauthenticated,
        auth_timeout=a.auth_timeout, idle_timeout=a.idle_timeout, body_timeout=a.body_timeout,
        write_timeout=a.write_timeout,
    )


async def _generate(a: argparse.Namespace) -> None:
    from streamengine.engine.async_engine import AsyncEngine
    from streamengine.sample.sampling_params import SamplingParams

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


def _serve_cluster(a: argparse.Namespace) -> None:
    """`serve --replicas N`: the same server options, on Ray Serve."""
    from streamengine.server import check_tenant_pins
    from streamengine.server.security import check_exposure

    server = server_config(a)
    check_exposure(server.host, has_keys=server.has_keys, allow_unauthenticated=server.allow_unauthenticated)
    if server.tenants is not None:
        check_tenant_pins(config_from_args(a), server.tenants)
    try:
        from streamengine.ray.app import ClusterOptions, serve_cluster
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    options = ClusterOptions(
        replicas=a.replicas, router=a.router, host=a.host, port=a.port, replica_cpus=a.replica_cpus,
        replica_gpus=a.replica_gpus, graceful_shutdown_timeout_s=a.shutdown_timeout,
        server=dataclasses.replace(server, tenants=None), tenants_file=server.tenants,
    )
    serve_cluster(config_from_args(a), options, ray_address=a.ray_address)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if a.command == "generate":
            _run(_generate(a))
        else:
            if a.replicas < 0:
                raise ValueError(f"--replicas must be >= 0, got {a.replicas}")
            if a.replicas:
                _serve_cluster(a)
            else:
                from streamengine.server import run_server

                run_server(config_from_args(a), server_config(a))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
