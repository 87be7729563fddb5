"""The CLI: options generated from EngineConfig, key resolution, the open-bind refusal, one
event-loop runner."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from streamengine import __main__ as cli
from streamengine.config import FIELD_TYPES, EngineConfig


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


def test_server_options_reads_the_environment(monkeypatch):
    monkeypatch.setenv("STREAMENGINE_API_KEY", "k1,k2")
    monkeypatch.setenv("STREAMENGINE_ADMIN_KEY", "adm")
    opts = cli.server_options(serve_args("--allowed-host", "chat.example.com", "--allowed-host", "*"))
    assert opts["api_key"] == ["k1", "k2"] and opts["admin_keys"] == ["adm"]
    assert opts["allowed_hosts"] == ["chat.example.com", "*"]
    opts = cli.server_options(serve_args("--admin-key", "x", "--admin-key", "y"))
    assert opts["admin_keys"] == ["x", "y"]


def test_server_option_defaults():
    opts = cli.server_options(serve_args())
    assert opts["host"] == "127.0.0.1" and opts["allow_unauthenticated"] is False
    assert opts["stall_timeout"] == 120.0 and opts["shutdown_timeout"] == 30.0
    assert opts["request_timeout"] is None and opts["max_connections"] >= 1
    opts = cli.server_options(serve_args("--stall-timeout", "5", "--shutdown-timeout", "1.5",
                                         "--request-timeout", "60", "--max-connections", "7"))
    assert (opts["stall_timeout"], opts["shutdown_timeout"], opts["request_timeout"], opts["max_connections"]) == (5, 1.5, 60, 7)
    params = inspect.signature(__import__("streamengine.server", fromlist=["run_server"]).run_server).parameters
    assert set(opts) <= set(params)


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

    monkeypatch.setattr("streamengine.engine.AsyncEngine", no_engine)
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


def non_default_argv() -> tuple[list[str], dict]:
    """An option for every field with a value other than its default, and the values expected."""
    argv, expected = [], {}
    for f in dataclasses.fields(EngineConfig):
        default, choices = f.default, f.metadata["choices"]
        if isinstance(default, bool):
            argv.append(option_of(f.name) if not default else f"--no-{option_of(f.name)[2:]}")
            expected[f.name] = not default
            continue
        if choices:
            value = next(c for c in choices if c != default)
        elif FIELD_TYPES[f.name] in (int, int | None):
            value = 7 if default != 7 else 8
        else:
            value = "some-value"
        argv += [option_of(f.name), str(value)]
        expected[f.name] = value
    return argv, expected


def test_options_build_the_config_they_name():
    assert cli.config_from_args(serve_args()) == EngineConfig()
    assert cli.config_from_args(cli.build_parser().parse_args(["generate", "hi"])) == EngineConfig()
    argv, expected = non_default_argv()
    assert len(expected) == len(dataclasses.fields(EngineConfig))
    assert cli.config_from_args(serve_args(*argv)) == EngineConfig(**expected)
    assert cli.config_from_args(serve_args("--num-blocks", "9", "--no-prefix-caching")) == EngineConfig(
        num_gpu_blocks=9, enable_prefix_caching=False)


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
