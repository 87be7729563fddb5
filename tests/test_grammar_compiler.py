"""The grammar compiler shared fairly by tenants: a cache per (tenant, spec) bounded in bytes,
a compile queue per tenant served round robin with bounds that answer 429, a timeout counted
from a compile's start, and grammars that give out while decoding failing as the client's error.

Most tests replace the compile itself (`_build`) with a fake whose order and duration the test
controls, so queue order and timeouts are exact, not raced; the sizes and the engine-level cases
use llguidance itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
import uuid

import pytest

import streamengine.structured.compiler
from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.errors import EngineDeadError, GrammarError, GrammarOverloadedError
from streamengine.server.config import ServerConfig
from streamengine.server.failures import classify
from streamengine.server.openai.errors import failure_error
from streamengine.structured.cache import ByteLRU, heap_bytes
from streamengine.structured.compiler import GrammarCompiler
from streamengine.structured.grammar import CompiledGrammar
from streamengine.structured.params import JsonSchema, Regex, structured_key
from streamengine.structured.queue import TenantQueues

MiB = 2**20
VOCAB = 49152
# A schema no finite value matches: `x` must hold another such object. llguidance compiles it and
# masks its first token, then refuses that very token ("Too many items").
ENDLESS = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
           "$ref": "#/$defs/a"}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


class FakeBuilds:
    """Stands in for GrammarCompiler._build: records which patterns compile in which order,
    holds a pattern until its gate opens, grows the fake heap by the pattern's size, and fails
    patterns starting with "bad". With `real`, the grammar is that build's (usable by an engine)."""

    def __init__(self, heap: list[int] | None = None, sizes: dict[str, int] | None = None, real=None) -> None:
        self.order: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.heap, self.sizes, self.real = heap, sizes or {}, real

    def gate(self, pattern: str) -> threading.Event:
        self.gates[pattern] = threading.Event()
        return self.gates[pattern]

    def __call__(self, spec: Regex) -> CompiledGrammar | str:
        self.order.append(spec.pattern)
        gate = self.gates.get(spec.pattern)
        if gate is not None:
            assert gate.wait(30), f"gate {spec.pattern} never opened"
        if self.heap is not None:
            self.heap[0] += self.sizes.get(spec.pattern, 0)
        if spec.pattern.startswith("bad"):
            return f"invalid structured-output spec: {spec.pattern}"
        return self.real(spec) if self.real is not None else CompiledGrammar(spec.pattern)


def fake_compiler(monkeypatch, builds: FakeBuilds | None = None, **kw) -> tuple[GrammarCompiler, FakeBuilds]:
    options = {"timeout_s": 30.0, "cache_bytes": 64 * MiB, **kw}
    compiler = GrammarCompiler(None, VOCAB, options.pop("timeout_s"), options.pop("cache_bytes"), **options)
    builds = builds or FakeBuilds()
    monkeypatch.setattr(compiler, "_tokenizer", lambda: None)
    monkeypatch.setattr(compiler, "_build", builds)
    return compiler, builds


def spawn(compiler: GrammarCompiler, pattern: str, tenant: str) -> asyncio.Task:
    return asyncio.create_task(compiler.compile_async(Regex(pattern), tenant))


async def until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)


async def hold_the_thread(compiler: GrammarCompiler, builds: FakeBuilds, tenant: str = "X") -> tuple[asyncio.Task, threading.Event]:
    """A compile of `tenant` that holds the (one) compile thread until the event is set."""
    gate = builds.gate("gate")
    task = spawn(compiler, "gate", tenant)
    await until(lambda: builds.order == ["gate"], "the gate compile started")
    return task, gate


def waiting(compiler: GrammarCompiler) -> int:
    return compiler.stats()["grammar_compiles_waiting"]


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
async def test_compile_threads_yield_the_cpu_to_decode_steps(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch)
    seen: list[int] = []
    builds.real = lambda spec: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())) or CompiledGrammar(spec.pattern)
    await compiler.compile_async(Regex("s"), "A")
    assert seen == [min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)]
    compiler.shutdown()


# ---------------------------------------------------------------- the byte-bounded cache


def test_byte_lru_evicts_the_least_recent_until_the_new_entry_fits():
    cache: ByteLRU[str, str] = ByteLRU(100)
    assert cache.put("a", "A", 40) and cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # now b is the least recent
    assert cache.put("c", "C", 40)
    assert "b" not in cache and cache.get("a") == "A" and cache.get("c") == "C" and cache.nbytes == 80
    assert not cache.put("huge", "H", 101)  # larger than the budget: not kept, nothing evicted
    assert len(cache) == 2 and cache.nbytes == 80
    assert cache.put("a", "A2", 10) and cache.nbytes == 50  # replacing counts the new size only
    assert cache.pop("a") == "A2" and cache.nbytes == 40


def test_heap_bytes_sees_what_native_code_allocates():
    import ctypes

    # The heap is process-wide: threads left by other tests may free memory meanwhile, so the
    # growth is read three times and one reading must show (nearly) the whole block.
    growth = []
    for _ in range(3):
        before = heap_bytes()
        block = ctypes.create_string_buffer(64 * MiB)  # malloc'd, as llguidance's Rust allocations are
        after = heap_bytes()
        del block
        assert before is not None and after is not None
        growth.append(after - before)
    assert max(growth) >= 60 * MiB, growth


# ---------------------------------------------------------------- the queue itself


def test_tenant_queues_take_round_robin_fewest_running_first():
    q: TenantQueues[str] = TenantQueues(max_per_tenant=3, max_total=5)
    for item in ("a1", "a2", "a3"):
        q.put("A", item)
    q.put("B", "b1")
    assert q.full("A") == "per_tenant" and q.full("C") is None
    q.put("C", "c1")
    assert q.full("D") == "total"
    assert [q.take() for _ in range(3)] == [("A", "a1"), ("B", "b1"), ("C", "c1")]
    q.finished("B")
    q.finished("C")
    assert q.take() == ("A", "a2")  # the only tenant with anything waiting
    assert q.remove("A", "a3") and not q.remove("A", "a3") and len(q) == 0 and q.take() is None


# ---------------------------------------------------------------- cache per tenant, in bytes


async def test_the_cache_is_per_tenant(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch)
    for _ in range(3):
        await compiler.compile_async(Regex("s"), "A")
    assert builds.order == ["s"]  # a spec a tenant sends again compiles once
    grammar_b = await compiler.compile_async(Regex("s"), "B")
    assert builds.order == ["s", "s"]  # A's entry is a miss for B: B cannot time A's specs
    assert compiler.compile(Regex("s"), "B") is grammar_b and compiler.compile(Regex("s"), "A") is not grammar_b
    assert builds.order == ["s", "s"] and compiler.stats()["grammar_cache_entries"] == 2
    compiler.shutdown()


async def test_the_cache_is_bounded_by_the_measured_bytes(monkeypatch):
    heap = [0]
    monkeypatch.setattr(streamengine.structured.compiler, "heap_bytes", lambda: heap[0])
    sizes = {"big1": 10 * MiB, "big2": 10 * MiB, "big3": 10 * MiB, "huge": 30 * MiB}
    compiler, builds = fake_compiler(monkeypatch, FakeBuilds(heap, sizes), cache_bytes=25 * MiB)

    def entry(pattern: str) -> int:
        return sizes[pattern] + len(structured_key(Regex(pattern)))

    for pattern in ("big1", "big2", "big1"):
        await compiler.compile_async(Regex(pattern), "A")
    assert builds.order == ["big1", "big2"]
    assert compiler.stats()["grammar_cache_bytes"] == entry("big1") + entry("big2")
    await compiler.compile_async(Regex("big3"), "A")  # 30 MiB > 25: the least recent (big2) goes
    assert compiler.stats()["grammar_cache_bytes"] == entry("big1") + entry("big3")
    for _ in range(2):
        await compiler.compile_async(Regex("huge"), "A")  # alone larger than the budget: never kept
    assert builds.order == ["big1", "big2", "big3", "huge", "huge"]
    assert compiler.stats()["grammar_cache_entries"] == 2  # and it evicted nothing
    await compiler.compile_async(Regex("big1"), "A")
    await compiler.compile_async(Regex("big2"), "A")
    assert builds.order[-1:] == ["big2"] and builds.order.count("big1") == 1
    compiler.shutdown()


async def test_failed_compiles_keep_only_their_message_per_tenant(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch)
    for _ in range(2):
        with pytest.raises(GrammarError, match="bad1"):
            await compiler.compile_async(Regex("bad1"), "A")
    assert builds.order == ["bad1"]  # a known-bad spec fails fast for its tenant
    with pytest.raises(GrammarError, match="bad1"):
        await compiler.compile_async(Regex("bad1"), "B")
    assert builds.order == ["bad1", "bad1"]  # and tells nothing about another's
    assert compiler.stats()["grammar_cache_entries"] == 0 and compiler.stats()["grammar_cache_bytes"] == 0
    compiler.shutdown()


async def test_a_timed_out_compile_is_not_kept(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch, timeout_s=0.2)
    gate = builds.gate("slow")
    with pytest.raises(GrammarError, match=r"did not compile within 0\.2 s"):
        await compiler.compile_async(Regex("slow"), "A")
    gate.set()
    await until(lambda: compiler.stats()["grammar_compiles_running"] == 0, "the late compile ended")
    assert compiler.stats()["grammar_cache_entries"] == 0
    builds.gates.clear()
    await compiler.compile_async(Regex("slow"), "A")
    assert builds.order == ["slow", "slow"]  # compiled again: the late result was dropped
    compiler.shutdown()


async def test_a_grammar_sizes_as_llguidance_keeps_it(smollm_dir):
    """With llguidance itself: a regex whose lexer keeps tens of MB counts for that much, one
    larger than the budget is not kept, and the next big one evicts the least recent."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    compiler = GrammarCompiler(tokenizer, VOCAB, 60.0, 32 * MiB)
    small = compiler.compile(Regex("[a-z]+"), "A")
    small_bytes = compiler.stats()["grammar_cache_bytes"]
    assert small_bytes < 2 * MiB
    big = compiler.compile(Regex("(a{200}){200}"), "A")
    big_bytes = compiler.stats()["grammar_cache_bytes"] - small_bytes
    assert 8 * MiB < big_bytes < 32 * MiB, big_bytes  # about 19 MB of lexer states
    compiler.compile(Regex("(a{300}){300}"), "A")  # about 39 MB: over the whole budget
    assert compiler.stats()["grammar_cache_entries"] == 2
    assert compiler.compile(Regex("[a-z]+"), "A") is small  # a hit: now the most recent
    compiler.compile(Regex("(b{200}){200}"), "A")  # 2 x 19 MB > 32 MiB: the least recent goes
    assert compiler.stats()["grammar_cache_entries"] == 2 and compiler.stats()["grammar_cache_bytes"] < 32 * MiB
    assert compiler.compile(Regex("[a-z]+"), "A") is small
    assert compiler.compile(Regex("(a{200}){200}"), "A") is not big  # evicted: compiled anew
    compiler.shutdown()


# ---------------------------------------------------------------- the queue, through the compiler


async def test_compiles_are_served_round_robin_across_tenants(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch, threads=1)
    gate_task, gate = await hold_the_thread(compiler, builds)
    tasks = []
    for pattern, tenant in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", "C")]:
        tasks.append(spawn(compiler, pattern, tenant))
        await until(lambda: waiting(compiler) == len(tasks), f"{pattern} queued")
    gate.set()
    await asyncio.gather(gate_task, *tasks)
    assert builds.order == ["gate", "a1", "b1", "c1", "a2", "a3"]  # first come first served: a1 a2 a3 b1 c1
    compiler.shutdown()


async def test_a_tenant_holding_a_thread_leaves_the_next_one_to_another(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch, threads=2)
    gates = {p: builds.gate(p) for p in ("a1", "b1")}
    tasks = [spawn(compiler, "a1", "A")]
    await until(lambda: builds.order == ["a1"], "a1 started")
    tasks.append(spawn(compiler, "b1", "B"))  # B is now the tenant served last
    await until(lambda: builds.order == ["a1", "b1"], "b1 started")
    tasks += [spawn(compiler, "a2", "A"), spawn(compiler, "b2", "B")]
    await until(lambda: waiting(compiler) == 2, "a2 and b2 queued")
    gates["b1"].set()  # the free thread goes to B (none running) before A (one running)
    await until(lambda: len(builds.order) == 4, "b2 and a2 compiled")
    assert builds.order == ["a1", "b1", "b2", "a2"]
    gates["a1"].set()
    await asyncio.gather(*tasks)
    compiler.shutdown()


async def test_a_full_queue_is_an_overload_error_with_retry_after(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch, threads=1, max_queued_per_tenant=2, max_queued=3)
    gate_task, gate = await hold_the_thread(compiler, builds)
    tasks = [spawn(compiler, "a1", "A"), spawn(compiler, "a2", "A")]
    await until(lambda: waiting(compiler) == 2, "A's two specs queued")
    with pytest.raises(GrammarOverloadedError) as per_tenant:
        await compiler.compile_async(Regex("a3"), "A")
    assert per_tenant.value.limit == "grammar_max_queued_per_tenant" and per_tenant.value.retry_after >= 1
    tasks.append(spawn(compiler, "b1", "B"))  # another tenant still gets in
    await until(lambda: waiting(compiler) == 3, "b1 queued")
    with pytest.raises(GrammarOverloadedError) as total:
        await compiler.compile_async(Regex("c1"), "C")
    assert total.value.limit == "grammar_max_queued"
    failure = classify(per_tenant.value)  # what HTTP and the WebSocket answer: 429, never 500
    assert (failure.status, failure.code, failure.limit) == (429, "overloaded", "grammar_max_queued_per_tenant")
    assert failure_error(failure).headers["Retry-After"] == str(int(per_tenant.value.retry_after))
    gate.set()
    await asyncio.gather(gate_task, *tasks)
    assert "a3" not in builds.order and "c1" not in builds.order
    compiler.shutdown()


async def test_the_timeout_counts_from_the_compiles_start(monkeypatch):
    """B's spec waits behind a compile that times out, longer than a compile may take, and
    still compiles: only its own compile's time counts."""
    compiler, builds = fake_compiler(monkeypatch, threads=1, timeout_s=0.3)
    slow_task, gate = await hold_the_thread(compiler, builds)
    queued_at = time.monotonic()
    b = spawn(compiler, "b", "B")
    await until(lambda: waiting(compiler) == 1, "b queued")
    with pytest.raises(GrammarError, match=r"did not compile within 0\.3 s"):
        await slow_task
    await asyncio.sleep(0.3)  # B has now waited longer than the timeout
    gate.set()
    assert isinstance(await b, CompiledGrammar)
    assert time.monotonic() - queued_at > 0.3 and builds.order == ["gate", "b"]
    compiler.shutdown()


async def test_the_wait_for_a_thread_is_bounded_and_gives_up_its_place(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch, threads=1, queue_timeout_s=0.2)
    gate_task, gate = await hold_the_thread(compiler, builds)
    with pytest.raises(GrammarOverloadedError) as failure:
        await compiler.compile_async(Regex("b"), "B")
    assert failure.value.limit == "grammar_queue_timeout_s" and waiting(compiler) == 0
    gate.set()
    await gate_task
    assert builds.order == ["gate"]  # the spec that gave up never compiled
    compiler.shutdown()


async def test_a_cancelled_caller_leaves_the_queue_and_callers_of_one_spec_share_its_compile(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch, threads=1)
    gate_task, gate = await hold_the_thread(compiler, builds)
    cancelled = spawn(compiler, "gone", "B")
    shared = [spawn(compiler, "same", "C") for _ in range(3)]
    await until(lambda: waiting(compiler) == 2, "gone and same queued")
    cancelled.cancel()
    await until(lambda: waiting(compiler) == 1, "gone dropped")
    gate.set()
    grammars = await asyncio.gather(gate_task, *shared)
    assert builds.order == ["gate", "same"] and grammars[1] is grammars[2] is grammars[3]
    compiler.shutdown()


async def test_shutdown_fails_waiting_specs_and_a_later_compile_starts_new_threads(monkeypatch):
    compiler, builds = fake_compiler(monkeypatch, threads=1)
    gate_task, gate = await hold_the_thread(compiler, builds)
    queued = spawn(compiler, "queued", "B")
    await until(lambda: waiting(compiler) == 1, "queued")
    compiler.shutdown()
    with pytest.raises(EngineDeadError):
        await queued
    gate.set()
    assert isinstance(await gate_task, CompiledGrammar)  # a compile running at shutdown ends normally
    assert isinstance(await compiler.compile_async(Regex("after"), "B"), CompiledGrammar)
    compiler.shutdown()


async def test_compile_threads_stay_bounded_and_exit_when_idle(monkeypatch):
    monkeypatch.setattr(streamengine.structured.compiler, "_IDLE_EXIT_S", 0.1)
    compiler, builds = fake_compiler(monkeypatch)
    await asyncio.gather(*(spawn(compiler, f"s{i}", f"T{i % 5}") for i in range(20)))
    assert len(builds.order) == 20 and compiler.stats()["grammar_compile_threads"] == 2
    await until(lambda: compiler.stats()["grammar_compile_threads"] == 0, "idle threads exited")
    assert isinstance(compiler.compile(Regex("again"), "A"), CompiledGrammar)
    compiler.shutdown()


# ---------------------------------------------------------------- through the engine


@pytest.fixture
async def engine(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128)
    async with AsyncEngine(config) as engine:
        yield engine


async def final_text(engine: AsyncEngine, params: SamplingParams, tenant: str | None = None) -> str:
    outputs = [out async for out in engine.generate("JSON:", params, tenant=tenant)]
    return outputs[-1].outputs[0].text


async def test_a_grammar_that_gives_out_while_decoding_is_the_clients_error(engine, caplog):
    """ENDLESS compiles, then its grammar refuses a token its own mask allowed: the request
    fails alone with GrammarError (400 invalid_grammar), logs no traceback as an engine fault,
    and its grammar leaves the cache."""
    plain = asyncio.create_task(final_text(engine, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    with caplog.at_level(logging.WARNING, logger="streamengine"), pytest.raises(GrammarError) as failure:
        await final_text(engine, SamplingParams(temperature=1.0, max_tokens=20, structured=JsonSchema(ENDLESS)))
    assert "refused" in str(failure.value)
    assert classify(failure.value).status == 400 and classify(failure.value).openai_code == "invalid_grammar"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
    assert len(await plain) > 0
    assert engine.core.grammars.stats()["grammar_cache_entries"] == 0
    assert engine.core.requests == {}


async def test_over_http_a_grammar_that_gives_out_is_400_and_a_full_queue_429(tiny_llama_dir, monkeypatch):
    from aiohttp.test_utils import TestClient, TestServer

    from streamengine.server import create_app

    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128, grammar_max_queued_per_tenant=1)
    async with AsyncEngine(config) as engine, TestClient(TestServer(create_app(engine, ServerConfig(model_name="tiny")))) as http:
        async def complete(structured: dict) -> tuple[int, dict, str | None]:
            body = {"model": "tiny", "prompt": "JSON:", "max_tokens": 20, "structured": structured}
            response = await http.post("/v1/completions", json=body)
            return response.status, await response.json(), response.headers.get("Retry-After")

        status, body, _ = await complete({"type": "json_schema", "schema": ENDLESS})
        assert status == 400 and body["error"]["code"] == "invalid_grammar", body

        grammars = engine.core.grammars
        builds = FakeBuilds(real=grammars._build)
        gates = [builds.gate(f"held{i}") for i in range(2)]
        monkeypatch.setattr(grammars, "_build", builds)
        held = []
        for i, (compiling, queued) in enumerate([(1, 0), (2, 0), (2, 1)]):  # one at a time: the bound is 1
            held.append(asyncio.create_task(complete({"type": "regex", "pattern": f"held{i}"})))
            now = (compiling, queued)
            await until(lambda now=now: (len(builds.order), waiting(grammars)) == now, f"held{i} taken")
        status, body, retry_after = await complete({"type": "regex", "pattern": "one too many"})
        assert status == 429 and body["error"]["code"] == "overloaded", body
        assert body["error"]["param"] == "grammar_max_queued_per_tenant" and int(retry_after) >= 1
        for gate in gates:
            gate.set()
        assert [status for status, _, _ in await asyncio.gather(*held)] == [200, 200, 200]


async def test_one_tenants_flood_of_slow_specs_delays_only_that_tenant(engine, monkeypatch):
    """Tenant A sends 20 distinct specs that each take 0.5 s to compile; tenant B then sends an
    ordinary schema. B's spec compiles next (round robin: A holds both threads, B none) and B's
    request completes while A's flood is still compiling; A itself gets only 200s, 400s and
    429s (its queue holds 16), never a 500."""
    grammars = engine.core.grammars
    build, order = grammars._build, []

    def slow_for_a(spec):
        order.append(spec)
        if isinstance(spec, Regex) and spec.pattern.startswith("flood"):
            time.sleep(0.5)
        return build(spec)

    monkeypatch.setattr(grammars, "_build", slow_for_a)
    monkeypatch.setattr(grammars, "_max_queued", (16, 256))  # a queue of 16 per tenant: 20 overflow it
    flood = [Regex(f"flood{i}[a-z]+") for i in range(20)]
    a_tasks = [asyncio.create_task(final_text(engine, SamplingParams(max_tokens=4, structured=spec), tenant="A"))
               for spec in flood]
    await until(lambda: grammars.stats()["grammar_compiles_waiting"] > 0, "A's flood queued")
    b_spec = JsonSchema({**SMALL, "title": uuid.uuid4().hex})
    b_text = await final_text(engine, SamplingParams(temperature=1.0, seed=1, max_tokens=32, structured=b_spec), "B")
    assert json.loads(b_text) in ({"ok": True}, {"ok": False}), b_text
    a_compiled = sum(1 for spec in order if spec in flood)
    assert order.index(b_spec) <= 3, order  # next after the two of A's running (one more at most)
    a_results = await asyncio.gather(*a_tasks, return_exceptions=True)
    accepted = [r for r in a_results if not isinstance(r, Exception)]
    assert a_compiled < len(accepted), (a_compiled, len(accepted))  # B finished before A's flood drained
    statuses = {classify(r).status if classify(r) is not None else 500 for r in a_results if isinstance(r, Exception)}
    assert statuses <= {400, 429} and 429 in statuses, a_results
