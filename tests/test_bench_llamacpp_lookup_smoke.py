"""bench/llamacpp_lookup.py without building llama.cpp: the server's command line (speculation
on only with k > 0, the draft length is k), the request body, the refusals, and prefix
agreement. The real run needs the build (`python bench/llamacpp_lookup.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bench_perf_smoke import load_bench


@pytest.fixture(scope="module")
def lookup():
    return load_bench("llamacpp_lookup.py")


def test_server_args_speculate_only_with_k(lookup):
    spec = lookup.ServerSpec(slots=8, ctx_per_slot=512, threads=2, k=5, ngram=3)
    args = spec.args(Path("/bin/llama-server"), Path("m.gguf"), 1234)
    assert args[args.index("-np") + 1] == "8" and args[args.index("-c") + 1] == "4096"
    assert args[args.index("--spec-type") + 1] == "ngram-simple"
    assert args[args.index("--spec-ngram-simple-size-m") + 1] == "5"
    assert args[args.index("--spec-ngram-simple-size-n") + 1] == "3"
    plain = lookup.ServerSpec(slots=1, ctx_per_slot=512, threads=2, k=0, ngram=3).args(Path("s"), Path("m"), 1)
    assert not any(a.startswith("--spec") for a in plain)


def test_completion_body_is_greedy_and_returns_tokens(lookup):
    body = lookup.completion_body("<|im_start|>user\nhi<|im_end|>\n", 16, {"type": "object"})
    assert body["temperature"] == 0 and body["top_k"] == 1 and body["n_predict"] == 16
    assert body["return_tokens"] and body["json_schema"] == {"type": "object"}
    assert "json_schema" not in lookup.completion_body("x", 16, None)


@pytest.mark.parametrize("batch,k,max_tokens", [(0, 4, 8), (1, 0, 8), (1, 4, 0), (65, 4, 8)])
def test_refusals_are_peer_unavailable(lookup, batch, k, max_tokens):
    with pytest.raises(lookup.PeerUnavailable):
        lookup.llamacpp_lookup_rows(["x"], max_tokens, batch, k, 1, None, build=False)


def test_unbuilt_server_is_peer_unavailable(lookup):
    with pytest.raises(lookup.PeerUnavailable, match="not built"):
        lookup.ensure_server(version="0.0.0-not-built", build=False)


def test_prefix_agreement(lookup):
    assert lookup.prefix_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert lookup.prefix_agreement([1, 2], [1, 2]) == 1.0
    assert lookup.prefix_agreement([], []) == 1.0
