"""The CLI: options generated from EngineConfig, key resolution, the open-bind refusal, one
event-loop runner."""

from __future__ import annotations

import dataclasses

import pytest

from streamengine import __main__ as cli
from streamengine.config import FIELD_TYPES, EngineConfig, SpeculativeConfig
from streamengine.server.tenants_file import load_tenants_file


def serve_args(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


def test_api_key_is_repeatable():
    a = serve_args("--api-key", "a", "--api-key", "b")
    assert cli.resolve_keys(a.api_key, None) == ["a", "b"]


def test_key_variables_are_comma_lists_and_the_cli_wins():
    assert cli.resolve_keys(None, "k1,k2") == ["k1", "k2"]
    assert cli.resolve_keys(None, " k1 , ,k2 ") == ["k1", "k2"]
    assert cli.resolve_keys(None, "") == [] and cli.resolve_keys(None, None) == []
    assert cli.resolve_keys(["c"], "k1,k2") == ["c"]


def test_server_config_reads_the_environment(monkeypatch):
    monkeypatch.setenv("STREAMENGINE_API_KEY", "k1,k2")
    monkeypatch.setenv("STREAMENGINE_ADMIN_KEY", "adm")
    opts = cli.server_config(serve_args("--allowed-host", "chat.example.com", "--allowed-host", "*"))
    assert opts.api_key == ["k1", "k2"] and opts.admin_keys == ["adm"]
    assert opts.allowed_hosts == ["chat.example.com", "*"]
    opts = cli.server_config(serve_args("--admin-key", "x", "--admin-key", "y"))
    assert opts.admin_keys == ["x", "y"]


def test_server_option_defaults():
    opts = cli.server_config(serve_args())
    assert opts.host == "127.0.0.1" and opts.allow_unauthenticated is False
    assert opts.stall_timeout == 120.0 and opts.shutdown_timeout == 30.0
    assert opts.request_timeout is None and opts.max_connections >= 1
    opts = cli.server_config(serve_args("--stall-timeout", "5", "--shutdown-timeout", "1.5",
                                         "--request-timeout", "60", "--max-connections", "7"))
    assert (opts.stall_timeout, opts.shutdown_timeout, opts.request_timeout, opts.max_connections) == (5, 1.5, 60, 7)


def test_tool_parser_option_names_a_registered_parser():
    assert cli.server_config(serve_args()).tool_parser == "hermes"
    assert cli.server_config(serve_args("--tool-parser", "llama3_json")).tool_parser == "llama3_json"
    with pytest.raises(SystemExit):
        serve_args("--tool-parser", "nonesuch")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.7", "example.com"])
def test_open_bind_without_a_key_is_refused(host):
    from streamengine.server.security import check_exposure

    with pytest.raises(ValueError, match="--allow-unauthenticated") as info:
        check_exposure(host, has_keys=False, allow_unauthenticated=False)
    assert "--api-key" in str(info.value)
    check_exposure(host, has_keys=True, allow_unauthenticated=False)
    check_exposure(host, has_keys=False, allow_unauthenticated=True)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "app.localhost"])
def test_loopback_bind_needs_no_key(host):
    from streamengine.server.security import check_exposure

    check_exposure(host, has_keys=False, allow_unauthenticated=False)


def test_main_refuses_open_bind_with_exit_code_2_before_loading(monkeypatch, capsys):
    monkeypatch.delenv("STREAMENGINE_API_KEY", raising=False)
    monkeypatch.delenv("STREAMENGINE_ADMIN_KEY", raising=False)

    def no_engine(*_a, **_k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr("streamengine.engine.async_engine.AsyncEngine", no_engine)
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "--allow-unauthenticated" in err


def test_attention_backend_choices_come_from_config():
    a = serve_args("--attention-backend", "cpu")
    assert cli.config_from_args(a).attention_backend == "cpu"


def test_limit_options_take_a_number_or_none():
    present = ["max_waiting", "max_prefill_chunk", "max_tokens_cap"]
    argv = []
    for name in present:
        argv += [f"--{name.replace('_', '-')}", "64"]
    config = cli.config_from_args(serve_args(*argv))
    assert all(getattr(config, n) == 64 for n in present)
    default = cli.config_from_args(serve_args())
    assert all(getattr(default, n) == getattr(EngineConfig(), n) for n in present)
    assert cli.config_from_args(serve_args("--max-tokens-cap", "none")).max_tokens_cap is None


def option_of(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_config_field_is_an_option_with_its_help(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping: a field's help reads as one line
    argv = [command, "--help"] if command == "serve" else [command, "prompt", "--help"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(argv)
    out = one_line(capsys.readouterr().out)
    for f in dataclasses.fields(EngineConfig):
        assert f" {option_of(f.name)}" in out, f.name
        assert one_line(f.metadata["help"]) in out, f.name
    assert "--no-prefix-caching" in out and "--num-blocks" in out  # spellings kept from before


TENANTS_TOML = """
[[tenants]]
name = "bot-a"
api_key = "key-a"
weight = 2.0
"""


def non_default_argv(tmp_path) -> tuple[list[str], dict]:
    """An option for every field with a value other than its default, and the values expected."""
    argv, expected = [], {}
    for f in dataclasses.fields(EngineConfig):
        default, choices = f.default, f.metadata["choices"]
        if isinstance(default, bool):
            argv.append(option_of(f.name) if not default else f"--no-{option_of(f.name)[2:]}")
            expected[f.name] = not default
            continue
        if f.name == "kv_cache_dtype":
            value = "fp8"  # k_scale and v_scale scale an fp8 cache only
        elif choices:
            value = next(c for c in choices if c != default)
        elif FIELD_TYPES[f.name] in (int, int | None):
            value = 7 if default != 7 else 8
        elif FIELD_TYPES[f.name] is float:
            value = default + 0.25
        elif FIELD_TYPES[f.name] == float | None:
            value = 0.5
        elif f.name == "tenants":
            path = tmp_path / "tenants.toml"
            path.write_text(TENANTS_TOML)
            argv += [option_of(f.name), str(path)]
            expected[f.name] = load_tenants_file(path).tenants
            continue
        elif f.name == "speculative":
            argv += [option_of(f.name), '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}']
            expected[f.name] = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
            continue
        elif f.name == "lora_modules":  # name=folder, or vLLM's JSON form
            argv += [option_of(f.name), "a=/tmp/a", '{"name": "b", "path": "/tmp/b"}']
            expected[f.name] = (("a", "/tmp/a"), ("b", "/tmp/b"))
            continue
        else:
            value = "some-value"
        argv += [option_of(f.name), str(value)]
        expected[f.name] = value
    return argv, expected


def test_options_build_the_config_they_name(tmp_path):
    assert cli.config_from_args(serve_args()) == EngineConfig()
    assert cli.config_from_args(cli.build_parser().parse_args(["generate", "hi"])) == EngineConfig()
    argv, expected = non_default_argv(tmp_path)
    assert len(expected) == len(dataclasses.fields(EngineConfig))
    assert cli.config_from_args(serve_args(*argv)) == EngineConfig(**expected)
    assert cli.config_from_args(serve_args("--num-blocks", "9", "--no-prefix-caching")) == EngineConfig(
        num_gpu_blocks=9, enable_prefix_caching=False)


def test_speculative_config_is_vllms_json_and_bad_json_is_a_usage_error(capsys):
    assert cli.config_from_args(serve_args("--speculative-config", "none")).speculative is None
    for bad, why in (('{"method": "eagle"}', "method"), ('{"k": 2}', "'k'"), ("[1]", "JSON object"), ("{", "Expecting")):
        with pytest.raises(SystemExit):
            serve_args("--speculative-config", bad)
        assert why in capsys.readouterr().err


def test_serve_help_in_a_real_process_lists_every_field():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "streamengine", "serve", "--help"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    missing = [f.name for f in dataclasses.fields(EngineConfig) if option_of(f.name) not in done.stdout]
    assert missing == []


def test_config_choices_are_the_exported_lists():
    from streamengine import config

    meta = {f.name: f.metadata for f in dataclasses.fields(EngineConfig)}
    assert meta["attention_backend"]["choices"] == config.ATTENTION_BACKENDS
    assert meta["preemption_mode"]["choices"] == config.PREEMPTION_MODES
    assert meta["dtype"]["choices"] == config.DTYPES
    assert meta["kv_cache_dtype"]["choices"] == config.KV_CACHE_DTYPES
    assert meta["model_impl"]["choices"] == config.MODEL_IMPLS
    with pytest.raises(ValueError, match="EngineConfig.block_size must be one of"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match=r"EngineConfig.max_waiting must be >= 1 or None, got 0"):
        EngineConfig(max_waiting=0)
    with pytest.raises(ValueError, match=r"EngineConfig.max_num_seqs must be >= 1, got 0"):
        EngineConfig(max_num_seqs=0)


def test_one_runner_and_an_import_error_inside_is_not_rerun():
    calls = []

    async def app() -> None:
        calls.append(1)
        raise ImportError("raised by the app itself")

    with pytest.raises(ImportError, match="by the app itself"):
        cli._run(app())
    assert calls == [1]
    from streamengine import server

    assert cli._run is server._run


def test_serve_drains_and_exits_cleanly_on_sigterm(tiny_llama_dir, tmp_path):
    """The real CLI process: serves, turns unready on SIGTERM, finishes and exits 0."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMENGINE_")}
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamengine", "serve", "--model", str(tiny_llama_dir), "--port", str(port),
         "--num-blocks", "32", "--shutdown-timeout", "5"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while "serving" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=10) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "serve.log").read_text()
    assert "draining" in out and "Traceback" not in out, out


# ---- the tenants file ---------------------------------------------------------------------------

TWO_TENANTS = """
shared_prefix = "Platform rules:"
[[tenants]]
name = "bot-a"
api_key = "key-a"
weight = 2.0
max_running = 3
system_prompt = "You are bot A."
[[tenants]]
name = "bot-b"
api_key_sha256 = "{sha_b}"
tokens_per_minute = 500
max_kv_fraction = 0.25
[[tenants]]
name = "default"
weight = 0.5
"""


def test_tenants_file_builds_the_config_and_the_server_config(tmp_path):
    import hashlib

    path = tmp_path / "tenants.toml"
    path.write_text(TWO_TENANTS.format(sha_b=hashlib.sha256(b"key-b").hexdigest()))
    a = serve_args("--tenants", str(path))
    config = cli.config_from_args(a)
    by_name = {t.name: t for t in config.tenants}
    assert list(by_name) == ["bot-a", "bot-b", "default"]
    assert (by_name["bot-a"].weight, by_name["bot-a"].max_running) == (2.0, 3)
    assert (by_name["bot-b"].tokens_per_minute, by_name["bot-b"].max_kv_fraction) == (500, 0.25)
    assert by_name["default"].weight == 0.5
    # salts come from the keys: secret, distinct, not the guessable name-derived default
    assert by_name["bot-a"].salt != by_name["bot-b"].salt
    assert "bot-a" not in by_name["bot-a"].salt and "key-a" not in by_name["bot-a"].salt
    tenants = cli.server_config(a).tenants
    assert tenants.shared_prefix == "Platform rules:" and dict(tenants.system_prompts) == {"bot-a": "You are bot A."}
    assert [k.tenant for k in tenants.keys] == ["bot-a", "bot-b"]
    assert [k.digest for k in tenants.keys] == [hashlib.sha256(b"key-a").digest(), hashlib.sha256(b"key-b").digest()]
    assert cli.server_config(serve_args()).tenants is None
    config = cli.config_from_args(cli.build_parser().parse_args(["generate", "hi", "--tenants", str(path)]))
    assert [t.name for t in config.tenants] == ["bot-a", "bot-b", "default"]


_ENTRY = '[[tenants]]\nname = "a"\napi_key = "k"\n'


@pytest.mark.parametrize(("text", "expected"), [
    (_ENTRY + "weight = -1\n", ["tenants[0] ('a')", "weight"]),
    (_ENTRY + '[[tenants]]\nname = "b"\napi_key = "k2"\nmax_running = "4"\n', ["tenants[1] ('b')", "max_running"]),
    (_ENTRY + "max_kv_fraction = 1.5\n", ["tenants[0] ('a')", "max_kv_fraction"]),
    ('[[tenants]]\nname = "a"\n', ["tenants[0] ('a')", "api_key"]),
    (_ENTRY + "wieght = 2\n", ["tenants[0] ('a')", "'wieght'"]),
    ('[[tenants]]\nname = "a"\napi_key_sha256 = "abc"\n', ["tenants[0] ('a')", "api_key_sha256", "64 hex"]),
    (_ENTRY + _ENTRY.replace('"k"', '"k2"'), ["tenants[1] ('a')", "name"]),
    (_ENTRY + _ENTRY.replace('"a"', '"b"'), ["tenants[1] ('b')", "api_key", "'a'"]),
    ('[[tenants]]\napi_key = "k"\n', ["tenants[0]", "name"]),
    ("shared_prefix = 3\n" + _ENTRY, ["shared_prefix"]),
    ("tenant = []\n", ["'tenant'"]),
    ("[[tenants]\n", ["not valid TOML"]),
])
def test_a_bad_tenants_file_exits_2_naming_the_entry_before_loading(text, expected, tmp_path, monkeypatch, capsys):
    def no_engine(*_a, **_k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr("streamengine.engine.async_engine.AsyncEngine", no_engine)
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--tenants", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--tenants" in err and str(path) in err
    for part in expected:
        assert part in err, (part, err)


def test_a_missing_tenants_file_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "hi", "--tenants", str(tmp_path / "nope.toml")])
    assert info.value.code == 2 and "cannot read it" in capsys.readouterr().err


def test_tenant_keys_count_as_keys_for_an_open_bind(tmp_path):
    from streamengine.server import run_server

    path = tmp_path / "tenants.toml"
    path.write_text(_ENTRY)
    options = cli.server_config(serve_args("--host", "0.0.0.0", "--tenants", str(path)))
    # with no key at all this is refused before loading; with the tenant's key it gets past
    # the check and fails later, on the missing model
    with pytest.raises(Exception) as info:
        run_server(EngineConfig(model=str(tmp_path / "no-model")), options)
    assert "--allow-unauthenticated" not in str(info.value)
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        run_server(EngineConfig(model=str(tmp_path / "no-model")), dataclasses.replace(options, tenants=None))


def test_cluster_options_default_to_one_process():
    a = serve_args()
    assert a.replicas == 0 and a.ray_address is None and a.router == "cached" and a.replica_cpus == 1.0
    a = serve_args("--replicas", "3", "--router", "pow2", "--ray-address", "10.0.0.1:6379")
    assert (a.replicas, a.router, a.ray_address) == (3, "pow2", "10.0.0.1:6379")


def test_cluster_serve_refuses_bad_options_before_starting_ray(monkeypatch, capsys):
    monkeypatch.delenv("STREAMENGINE_API_KEY", raising=False)
    monkeypatch.delenv("STREAMENGINE_ADMIN_KEY", raising=False)

    def no_cluster(*_a, **_k):
        raise AssertionError("Ray must not be started")

    monkeypatch.setattr("streamengine.ray.app.serve_cluster", no_cluster)
    assert cli.main(["serve", "--replicas", "-1"]) == 2
    assert "--replicas must be >= 0" in capsys.readouterr().err
    assert cli.main(["serve", "--replicas", "2", "--host", "0.0.0.0"]) == 2
    assert "--allow-unauthenticated" in capsys.readouterr().err


def test_cluster_serve_passes_the_server_options_to_the_ingress(monkeypatch):
    seen = {}

    def fake_serve_cluster(config, options, *, ray_address):
        seen.update(config=config, options=options, ray_address=ray_address)

    monkeypatch.setattr("streamengine.ray.app.serve_cluster", fake_serve_cluster)
    assert cli.main(["serve", "--replicas", "2", "--api-key", "k1", "--max-prompt-tokens", "100",
                     "--router", "ray_prefix", "--block-size", "32", "--shutdown-timeout", "7"]) == 0
    options = seen["options"]
    assert options.replicas == 2 and options.router == "ray_prefix" and options.graceful_shutdown_timeout_s == 7
    assert options.server.api_key == ["k1"] and options.server.max_prompt_tokens == 100
    assert options.server.answered_hosts() == [] and seen["config"].block_size == 32  # loopback only
