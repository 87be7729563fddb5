"""llama.cpp's own prompt-lookup speculation, as a peer row for bench/speculative.py.

The tool is llama-server from the llama.cpp tree vendored in the llama-cpp-python sdist that
bench/peers.py builds (LLAMACPP_PYPI_VERSION), built here with the server and examples on into
its own cached folder (`default_llamacpp_dir()` + "-lookup"; peers.py's build is left as it is;
~10.5 min on 2 cores). The server rather than the `llama-lookup` example (also built) because
the server is the only llama.cpp front end that speculates for several sequences at once (`-np 8`
slots share each decode) and under a JSON-schema grammar (its own json_schema -> GBNF
conversion); `llama-lookup` is single-sequence and prints text, not token ids.

Its n-gram speculation (`--spec-type ngram-simple`): the last `size_n` tokens (the sampled one
included) are searched backwards in the sequence's tokens (prompt and output), and the
`size_m` tokens that followed the latest match are the draft, `size_m` = k here. It drafts
nothing when fewer than `size_n` tokens follow the match, or while the sequence holds fewer
than size_n + k + 1 tokens. The engine's "ngram" looks for the longest n in [2, 4] instead;
`ngram` (size_n) defaults to 3, between the two (and is cut to k).

Greedy: temperature 0, top_k 1. The prompt is the chat-templated text, sent as a string: the
server tokenizes it with special tokens parsed and add_special on; `special_tokens_added` checks
that this adds nothing (no BOS for the default SmolLM2 file), and `prompt_tokens` in the row lets
the caller compare the ids with the engine's tokenizer (equal on the quote and json prompts).

Things to know when reading its rows:
- `-nr` (no extra weight buffers): without it the AMX Q4_1 matmul that GGML_NATIVE picks on an
  AMX CPU segfaults at startup (seen on this host); Q4_1 has no other repacked CPU layout, so
  `-nr` only leaves the ordinary Q4_1 kernels.
- llama.cpp is not batch-invariant: the verify batch's shape can flip a near-tie, so `tokens`
  (lookup) and `tokens_plain` may differ at batch > 1 (seen once in 8 quote prompts).
- its JSON grammar lets the model pretty-print (`{\n  "name": ...`), the engine's does not, so
  json answers differ from the engine's from the first token: compare tok/s, not tokens, there.

    from llamacpp_lookup import llamacpp_lookup_rows, PeerUnavailable
    python bench/llamacpp_lookup.py --workload quote --requests 2 --max-tokens 32   # check by hand
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package

from peers import CMAKE_FLAGS, LLAMACPP_PYPI_VERSION, build_llamacpp, default_llamacpp_dir  # noqa: E402

SERVER = "llama-server"
TARGETS = (SERVER, "llama-lookup")
FLAGS = tuple(f for f in CMAKE_FLAGS if not f.startswith(("-DLLAMA_BUILD_EXAMPLES=", "-DLLAMA_BUILD_SERVER="))) + (
    "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # no web UI: it would be fetched from the network
)
SPEC_TYPE = "ngram-simple"
MAX_BATCH = 64


class PeerUnavailable(RuntimeError):
    """This combination cannot run with llama.cpp (the reason is the message): the caller
    records the row as missing instead of failing the whole benchmark."""


# -- build -------------------------------------------------------------------------------------


def lookup_dir(version: str = LLAMACPP_PYPI_VERSION) -> Path:
    """Its own folder: other cmake flags than peers.py's cached build."""
    base = default_llamacpp_dir(version)
    return base.with_name(base.name + "-lookup")


def ensure_server(version: str = LLAMACPP_PYPI_VERSION, jobs: int = 2, build: bool = True) -> Path:
    """The llama-server binary, built (niced, ~15 min on 2 cores) on first use."""
    folder = lookup_dir(version)
    binary = folder / "build" / "bin" / SERVER
    if binary.is_file():
        return binary
    if not build:
        raise PeerUnavailable(f"{binary} is not built (ensure_server(build=True) builds it)")
    print(f"building llama.cpp {version} {', '.join(TARGETS)} in {folder} ...", file=sys.stderr)
    try:
        build_llamacpp(folder, version, jobs, targets=TARGETS, flags=FLAGS, niceness=19)
    except (subprocess.CalledProcessError, OSError) as e:
        raise PeerUnavailable(f"llama.cpp build failed ({e}); see {folder / 'build.log'}") from e
    return binary


def default_gguf() -> Path:
    """The engine's default file: the same Q4_1 weights bench/speculative.py runs."""
    from streamengine.models.loader import resolve_default_model

    return resolve_default_model()


# -- server ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """One llama-server launch: k = 0 is the plain server (no speculation)."""

    slots: int
    ctx_per_slot: int
    threads: int
    k: int
    ngram: int

    def args(self, binary: Path, gguf: Path, port: int) -> list[str]:
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.slots),
               "-c", str(self.slots * self.ctx_per_slot), "--no-webui", "--cache-prompt",
               "-nr"]  # no AMX weight buffers: its Q4_1 matmul segfaults at startup on this host's CPU
        if self.k > 0:
            cmd += ["--spec-type", SPEC_TYPE, "--spec-ngram-simple-size-n", str(self.ngram),
                    "--spec-ngram-simple-size-m", str(self.k), "--spec-ngram-simple-min-hits", "1"]
        return cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Until /health answers 200 (the model is loaded): load time stays out of every timing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerUnavailable(f"llama-server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    raise PeerUnavailable(f"llama-server did not start in {timeout:.0f} s: {log.read_text()[-2000:]}")


@contextmanager
def server(binary: Path, gguf: Path, spec: ServerSpec, log: Path) -> Iterator[int]:
    """A running llama-server (its port), stopped on exit; its output goes to `log`."""
    port = _free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(spec.args(binary, gguf, port), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(port, proc, log)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- requests ----------------------------------------------------------------------------------


def completion_body(text: str, max_tokens: int, json_schema: dict | None) -> dict:
    """Greedy, exactly max_tokens unless EOS, token ids returned; the schema as the server's
    own json_schema -> grammar conversion."""
    body = {"prompt": text, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "seed": 0,
            "cache_prompt": True, "return_tokens": True, "stream": False}
    if json_schema is not None:
        body["json_schema"] = json_schema
    return body


@dataclass
class Group:
    """One batch of concurrent requests: its token ids and the server's timings."""

    tokens: list[list[int]]
    seconds_tool: float  # max over requests of prompt_ms + predicted_ms (the server's clock)
    seconds_wall: float  # client: first submission to last answer
    drafted: int
    accepted: int


def run_group(port: int, texts: list[str], max_tokens: int, json_schema: dict | None) -> Group:
    """The texts at once (one thread each: the server batches its slots in every decode)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        outs = list(pool.map(lambda t: _post(port, "/completion", completion_body(t, max_tokens, json_schema)), texts))
    wall = time.perf_counter() - start
    timings = [o["timings"] for o in outs]
    return Group(
        tokens=[list(o["tokens"]) for o in outs],
        seconds_tool=max(t["prompt_ms"] + t["predicted_ms"] for t in timings) / 1e3,
        seconds_wall=wall,
        drafted=sum(t.get("draft_n", 0) for t in timings),
        accepted=sum(t.get("draft_n_accepted", 0) for t in timings),
    )


def warm(port: int, texts: list[str], json_schema: dict | None) -> None:
    """Each prompt computed once, untimed, as bench/speculative.py does for the engine (its
    prefix cache): the server keeps a slot's prompt and picks the slot by similarity."""
    with ThreadPoolExecutor(len(texts)) as pool:
        list(pool.map(lambda t: _post(port, "/completion", completion_body(t, 1, json_schema)), texts))


@dataclass
class Pass:
    """All texts once, `batch` at a time."""

    tokens: list[list[int]]
    seconds_tool: float
    seconds_wall: float
    drafted: int
    accepted: int

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


def run_pass(port: int, texts: list[str], max_tokens: int, batch: int, json_schema: dict | None) -> Pass:
    groups = []
    for i in range(0, len(texts), batch):
        chunk = texts[i:i + batch]
        warm(port, chunk, json_schema)
        groups.append(run_group(port, chunk, max_tokens, json_schema))
    return Pass([t for g in groups for t in g.tokens], sum(g.seconds_tool for g in groups),
                sum(g.seconds_wall for g in groups), sum(g.drafted for g in groups),
                sum(g.accepted for g in groups))


def server_tokens(port: int, text: str, add_special: bool = True) -> list[int]:
    """The prompt's token ids as /completion makes them (add_special and parse_special on)."""
    return _post(port, "/tokenize", {"content": text, "add_special": add_special, "parse_special": True})["tokens"]


def special_tokens_added(port: int, text: str) -> str:
    """What the server's completion tokenization (add_special on) changes in the bare text's
    tokens: 'none' when nothing (no BOS), else both lists' ends."""
    with_special, bare = server_tokens(port, text), server_tokens(port, text, add_special=False)
    return "none" if with_special == bare else f"{with_special[:3]}...{with_special[-2:]} vs {bare[:3]}...{bare[-2:]}"


# -- the row -----------------------------------------------------------------------------------


def _check(batch: int, k: int, max_tokens: int, texts: list[str]) -> None:
    if not texts:
        raise PeerUnavailable("no prompts")
    if not 1 <= batch <= MAX_BATCH:
        raise PeerUnavailable(f"batch {batch} outside 1..{MAX_BATCH} server slots")
    if k < 1:
        raise PeerUnavailable(f"draft length k={k} < 1")
    if max_tokens < 1:
        raise PeerUnavailable(f"max_tokens={max_tokens} < 1")


def llamacpp_lookup_rows(texts: list[str], max_tokens: int, batch: int, k: int, repeats: int,
                         json_schema: dict | None, threads: int = 2, *, ngram: int = 3,
                         gguf: Path | None = None, build: bool = True) -> dict:
    """llama-server on the default GGUF with n-gram speculation (draft length k) and without,
    on the same prompts, `batch` requests at a time; the two servers run side by side and take
    turns per repeat (one is idle while the other is timed). tok/s is the median over repeats of
    generated tokens / the server's own generation seconds (per group of `batch` concurrent
    requests: the longest prompt_ms + predicted_ms, prompts already cached, so model load and
    HTTP are out); `tok_s_wall*` is the same over client wall seconds. Raises PeerUnavailable."""
    _check(batch, k, max_tokens, texts)
    ngram = min(ngram, k)  # ngram-simple drafts nothing when fewer than size_n tokens can follow
    binary = ensure_server(build=build)
    gguf = default_gguf() if gguf is None else Path(gguf)
    if not gguf.is_file():
        raise PeerUnavailable(f"GGUF file not found: {gguf}")
    ctx = -(-(max_tokens + max(len(t) for t in texts) + 64) // 256) * 256  # a token is >= 1 char
    specs = {"lookup": ServerSpec(batch, ctx, threads, k, ngram), "plain": ServerSpec(batch, ctx, threads, 0, ngram)}
    logs = {name: lookup_dir() / f"server-{name}.log" for name in specs}  # the last run's, for a post-mortem
    passes: dict[str, list[Pass]] = {name: [] for name in specs}
    with server(binary, gguf, specs["lookup"], logs["lookup"]) as p_spec, \
            server(binary, gguf, specs["plain"], logs["plain"]) as p_plain:
        ports = {"lookup": p_spec, "plain": p_plain}
        added = special_tokens_added(p_spec, texts[0])
        prompt_tokens = [server_tokens(p_spec, t) for t in texts]
        try:
            for r in range(max(1, repeats)):
                for name in (("lookup", "plain") if r % 2 == 0 else ("plain", "lookup")):
                    passes[name].append(run_pass(ports[name], texts, max_tokens, batch, json_schema))
        except urllib.error.HTTPError as e:  # e.g. a schema its grammar conversion refuses
            raise PeerUnavailable(f"llama-server refused the request ({e.code}): {e.read()[:500]!r}") from e
    look, plain = passes["lookup"], passes["plain"]
    drafted, accepted = sum(p.drafted for p in look), sum(p.accepted for p in look)
    how = (f"llama-server ({LLAMACPP_PYPI_VERSION} sdist's llama.cpp) -m {gguf.name} -np {batch} -c {batch * ctx} "
           f"-t {threads} -tb {threads} -nr --spec-type {SPEC_TYPE} --spec-ngram-simple-size-n {ngram} "
           f"--spec-ngram-simple-size-m {k} (plain: same, no --spec-type); POST /completion prompt=<chat text> "
           f"temperature=0 top_k=1 n_predict={max_tokens}{' json_schema' if json_schema else ''}, {batch} at a "
           f"time; tok/s = tokens / server timings (per group max prompt_ms+predicted_ms, warm prompt cache), "
           f"median of {len(look)}; special tokens added to the prompt: {added}")
    return {
        "tok_s": statistics.median(p.generated / p.seconds_tool for p in look),
        "tok_s_plain": statistics.median(p.generated / p.seconds_tool for p in plain),
        "tok_s_wall": statistics.median(p.generated / p.seconds_wall for p in look),
        "tok_s_wall_plain": statistics.median(p.generated / p.seconds_wall for p in plain),
        "acceptance": accepted / drafted if drafted else None,
        "drafted": drafted,
        "accepted": accepted,
        "tokens": look[-1].tokens,
        "tokens_plain": plain[-1].tokens,  # llama.cpp is not batch-invariant: may differ at batch > 1
        "prompt_tokens": prompt_tokens,
        "identical": all(p.tokens == plain[0].tokens for p in look + plain),
        "how": how,
    }


# -- a check by hand ---------------------------------------------------------------------------


def engine_tokens(texts: list[str], workload: str, max_tokens: int) -> list[list[int]]:
    """The engine's greedy tokens (no speculation), one request at a time, to compare with."""
    from speculative import params, run_batch

    from streamengine.config import EngineConfig
    from streamengine.engine.core import EngineCore

    core = EngineCore(EngineConfig())
    return [list(run_batch(core, [t], params(workload, max_tokens))[1][0]) for t in texts]


def prefix_agreement(ours: list[int], theirs: list[int]) -> float:
    """Leading tokens in common over the longer answer's length: 1.0 is the same answer."""
    if not ours and not theirs:
        return 1.0
    n = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        n += 1
    return n / max(len(ours), len(theirs), 1)


def main() -> None:
    """A small run on bench/speculative.py's prompts: the row, and the engine's agreement."""
    import argparse

    from speculative import SCHEMA, prompts

    from streamengine.models.loader import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("quote", "json", "chat"), default="quote")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-engine", action="store_true", help="skip the engine's tokens")
    args = p.parse_args()
    tokenizer, _ = load_tokenizer(None)
    texts = prompts(tokenizer, args.workload, args.requests)
    schema = SCHEMA if args.workload == "json" else None
    try:
        row = llamacpp_lookup_rows(texts, args.max_tokens, args.batch, args.k, args.repeats, schema, args.threads)
    except PeerUnavailable as e:
        print(f"unavailable: {e}")
        return
    print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "tokens_plain", "prompt_tokens")}, indent=2))
    engine = None if args.no_engine else engine_tokens(texts, args.workload, args.max_tokens)
    for i, toks in enumerate(row["tokens"]):
        plain = row["tokens_plain"][i]
        print(f"prompt {i}: llama.cpp {len(toks)} tokens {toks}")
        print(f"  same as without speculation: {toks == plain} (matching prefix {prefix_agreement(toks, plain):.3f})")
        print(f"  text: {tokenizer.decode(toks)!r}")
        if engine is not None:
            print(f"  engine  {len(engine[i])} tokens {engine[i]}")
            print(f"  prompt token ids equal: {tokenizer.encode(texts[i]) == row['prompt_tokens'][i]}; "
                  f"matching prefix: {prefix_agreement(toks, engine[i]):.3f}")


if __name__ == "__main__":
    main()
