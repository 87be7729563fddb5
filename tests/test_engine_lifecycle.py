"""Engine API and request lifecycle edge cases: streams closed or cancelled at every stage,
reused request ids, stop() while compiling or cancelled, params edited by the caller,
min_tokens, prompts that tokenize to nothing or past the vocabulary."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from conftest import slow_down_steps

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.errors import EngineDeadError


@pytest.fixture
async def engine(tiny_llama_dir):
    async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64)) as eng:
        yield eng


def all_blocks_free(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return (
        s["num_free_blocks"] == s["num_total_blocks"]
        and s["num_running"] == s["num_waiting"] == s["num_swapped"] == s["num_requests"] == 0
    )


async def drain(agen) -> list:
    return [out async for out in agen]


async def wait_for(predicate, timeout: float = 30.0) -> None:
    """Polls `predicate` (a hang becomes a failure, never a timing assertion)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def _engine_with_held_steps(tiny_llama_dir, monkeypatch):
    """A started engine whose forward passes wait (in the worker thread) for `release`;
    `entered` is set once one is in flight."""
    import threading

    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=32))
    await eng.start()
    entered, release = threading.Event(), threading.Event()
    execute = eng.core.execute

    def held(step):
        entered.set()
        release.wait(30)
        return execute(step)

    monkeypatch.setattr(eng.core, "execute", held)
    return eng, entered, release


@pytest.mark.parametrize("leave", ["read_to_end", "break"])
async def test_request_id_reused_while_the_finished_stream_is_unread(engine, leave, monkeypatch):
    """An id is free again once its request finished in the engine (as in vLLM), even if its
    consumer has not read the final output yet. The old consumer leaving must then neither
    unregister the new request's stream (which would hang it) nor abort the new request."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = engine.generate([5, 6, 7], params, request_id="same")
    await first.__anext__()
    await wait_for(lambda: engine.stats()["num_requests"] == 0)  # finished, final output unread
    slow_down_steps(
        monkeypatch, engine
    )  # the second request is still running when the first leaves
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    second = asyncio.create_task(drain(engine.generate([5, 6, 7], long, request_id="same")))
    await wait_for(lambda: engine.stats()["num_requests"] == 1 or second.done())
    if leave == "read_to_end":
        rest = await drain(first)
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "length"
    else:
        await first.aclose()
    outs = await asyncio.wait_for(second, 30)
    assert (
        outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 30
    )
    assert all_blocks_free(engine)


async def test_stop_ends_open_streams_with_engine_dead(engine, monkeypatch):
    slow_down_steps(monkeypatch, engine)
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    tasks = [asyncio.create_task(drain(engine.generate([5, 6, 7, i], params))) for i in range(3)]
    await wait_for(lambda: engine.stats()["num_running"] == 3)
    await engine.stop()
    for t in tasks:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(t, 30)


async def test_max_tokens_1_with_n_samples(engine):
    for n in (1, 3):
        for kind in ("cumulative", "delta"):
            params = SamplingParams(
                temperature=0.7, seed=1, max_tokens=1, n=n, output_kind=kind, logprobs=2
            )
            outs = await drain(engine.generate(list(range(3, 3 + 16)), params))
            assert outs[-1].finished
            got = {}
            for o in outs:
                for c in o.outputs:
                    got.setdefault(c.index, []).extend(c.token_ids)
            assert sorted(got) == list(range(n)), (n, kind, outs)
            assert all(len(v) == 1 for v in got.values()) or kind == "cumulative"
    assert all_blocks_free(engine)


@pytest.mark.parametrize("plen", [1, 15, 16, 17, 31, 32, 33])
async def test_prompts_at_block_boundaries_free_every_block(engine, plen):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    outs = await drain(engine.generate(list(range(3, 3 + plen)), params))
    assert outs[-1].finished
    assert all(len(c.token_ids) == 20 for c in outs[-1].outputs)
    assert all_blocks_free(engine), engine.stats()


async def test_prompts_at_max_model_len(tiny_llama_dir):
    async with AsyncEngine(
        EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_model_len=48)
    ) as eng:
        outs = await drain(
            eng.generate(list(range(3, 3 + 47)), SamplingParams(max_tokens=None, ignore_eos=True))
        )
        assert outs[-1].outputs[0].finish_reason == "length"
        assert len(outs[-1].outputs[0].token_ids) == 1
        with pytest.raises(ValueError):
            await drain(eng.generate(list(range(3, 3 + 48)), SamplingParams(max_tokens=None)))
        outs = await drain(
            eng.generate(
                list(range(3, 3 + 20)), SamplingParams(max_tokens=None, ignore_eos=True, n=2)
            )
        )
        assert all(len(c.token_ids) == 28 for c in outs[-1].outputs)
        outs = await drain(
            eng.generate(
                list(range(3, 3 + 20)),
                SamplingParams(max_tokens=None, ignore_eos=True, beam_width=2),
            )
        )
        assert outs[-1].finished
        assert all_blocks_free(eng), eng.stats()


async def test_cancel_before_the_first_token_frees_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=2)
    for delay in (0, 0.001, 0.01):
        agen = engine.generate(list(range(3, 40)), params)
        task = asyncio.create_task(agen.__anext__())
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # or it got its first output first
            await task
        await agen.aclose()
    await wait_for(lambda: all_blocks_free(engine))


async def test_cancel_mid_beam_search_frees_every_beam(engine, monkeypatch):
    slow_down_steps(monkeypatch, engine)
    params = SamplingParams(max_tokens=40, ignore_eos=True, beam_width=3, n=2)
    task = asyncio.create_task(drain(engine.generate(list(range(3, 40)), params)))
    await wait_for(lambda: engine.stats()["num_running"] >= 2)  # the search has forked its beams
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: all_blocks_free(engine))


async def test_abort_of_unknown_and_finished_ids_is_a_no_op(engine):
    await engine.abort("nope")
    outs = await drain(engine.generate([4, 5], SamplingParams(max_tokens=2), request_id="x"))
    await engine.abort("x")
    assert outs[-1].finished
    assert all_blocks_free(engine)


async def _greedy(eng, prompts, max_tokens, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)

    async def one(p):
        outs = await drain(eng.generate(p, params))
        return [c.token_ids for c in outs[-1].outputs]

    return await asyncio.gather(*(one(p) for p in prompts))


LONG = [[(7 * i + j) % 4000 + 10 for j in range(40 + 9 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def long_alone(tiny_llama_dir) -> list:
    """Each of LONG's greedy outputs, run alone on a roomy pool."""

    async def run():
        async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128)) as eng:
            return [(await _greedy(eng, [p], 30))[0] for p in LONG]

    return asyncio.run(run())


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_long_prompts_under_a_small_pool_match_running_alone(
    tiny_llama_dir, long_alone, mode
):
    from test_preemption import swap_bytes

    async with AsyncEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            num_gpu_blocks=12,
            preemption_mode=mode,
            swap_space_bytes=swap_bytes(tiny_llama_dir, 64),
            max_prefill_chunk=16,
        )
    ) as eng:
        got = await _greedy(eng, LONG, 30)
        s = eng.stats()
        assert s["num_preemptions"] > 0
        assert got == long_alone
        assert all_blocks_free(eng), eng.stats()
        assert eng.stats()["num_swap_blocks_free"] == eng.stats()["num_swap_blocks"]


async def test_stop_strings_with_n_samples_both_output_kinds(engine):
    prompt = "Hello there my friend"
    base = await drain(
        engine.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    )
    text = base[-1].outputs[0].text
    stop = "nd fr"
    assert stop in text
    for kind in ("cumulative", "delta"):
        for incl in (False, True):
            params = SamplingParams(
                temperature=0,
                max_tokens=20,
                ignore_eos=True,
                n=3,
                stop=[stop],
                output_kind=kind,
                include_stop_str_in_output=incl,
                logprobs=1,
            )
            outs = await drain(engine.generate(prompt, params))
            if kind == "delta":
                texts, toks, lps = {}, {}, {}
                for o in outs:
                    for c in o.outputs:
                        texts[c.index] = texts.get(c.index, "") + c.text
                        toks.setdefault(c.index, []).extend(c.token_ids)
                        lps.setdefault(c.index, []).extend(c.logprobs)
                finals = {c.index: c for o in outs for c in o.outputs if c.finish_reason}
            else:
                texts = {c.index: c.text for c in outs[-1].outputs}
                toks = {c.index: c.token_ids for c in outs[-1].outputs}
                lps = {c.index: c.logprobs for c in outs[-1].outputs}
                finals = {c.index: c for c in outs[-1].outputs}
            for i in range(3):
                expected = text[: text.index(stop) + (len(stop) if incl else 0)]
                assert texts[i] == expected, (kind, incl, texts[i], expected)
                assert finals[i].finish_reason == "stop" and finals[i].stop_reason == stop
                assert len(lps[i]) == len(toks[i])
    assert all_blocks_free(engine)


async def test_empty_and_out_of_vocabulary_prompts_are_refused(engine):
    for bad in ([], "", [engine.core.vocab_size], [-1], [1.0], None):
        with pytest.raises((ValueError, TypeError)):
            await drain(engine.generate(bad, SamplingParams(max_tokens=2)))
    outs = await drain(engine.generate([engine.core.vocab_size - 1], SamplingParams(max_tokens=2)))
    assert outs[-1].finished
    assert all_blocks_free(engine)


async def test_one_engine_object_stops_and_starts_again(tiny_llama_dir):
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=32))
    async with eng:
        a = await _greedy(eng, [[5, 6, 7]], 5)
    async with eng:
        b = await _greedy(eng, [[5, 6, 7]], 5)
    assert a == b
    await eng.stop()


async def test_cancel_and_abort_of_waiting_requests(tiny_llama_dir, monkeypatch):
    async with AsyncEngine(
        EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_num_seqs=1)
    ) as eng:
        alone = await _greedy(eng, [LONG[0]], 20)
        slow_down_steps(monkeypatch, eng)
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        first = asyncio.create_task(drain(eng.generate(LONG[0], params)))
        waiting = [
            asyncio.create_task(
                drain(eng.generate(LONG[i], SamplingParams(max_tokens=20, n=2), request_id=f"w{i}"))
            )
            for i in range(1, 4)
        ]
        await wait_for(lambda: eng.stats()["num_waiting"] >= 2)
        waiting[0].cancel()
        await eng.abort("w2")
        res = await asyncio.wait_for(first, 30)
        assert [c.token_ids for c in res[-1].outputs] == alone[0]
        w2 = await asyncio.wait_for(waiting[1], 30)
        assert w2[-1].finished and {c.finish_reason for c in w2[-1].outputs} == {"abort"}
        await asyncio.wait_for(waiting[2], 30)
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        await wait_for(lambda: all_blocks_free(eng))


async def test_stop_while_requests_are_swapped_frees_both_pools(tiny_llama_dir, monkeypatch):
    from test_preemption import swap_bytes

    eng = AsyncEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            num_gpu_blocks=12,
            preemption_mode="swap",
            swap_space_bytes=swap_bytes(tiny_llama_dir, 64),
            max_prefill_chunk=16,
        )
    )
    await eng.start()
    slow_down_steps(monkeypatch, eng, 0.005)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    tasks = [asyncio.create_task(drain(eng.generate(p, params))) for p in LONG]
    await wait_for(lambda: eng.stats()["num_swap_outs"] > 0)
    await eng.stop()
    for t in tasks:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(t, 30)
    s = eng.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"], s
    assert s["num_swap_blocks_free"] == s["num_swap_blocks"], s


async def test_stop_while_compiling_fails_requests_with_engine_dead(tiny_llama_dir, monkeypatch):
    """Requests whose grammar is compiling when the engine stops end with EngineDeadError, like
    streams open at shutdown: never with a CancelledError their task did not ask for (a
    queued compile is dropped by stop()), nor with "engine is not running" (one that finished)."""
    import threading

    from streamengine.structured.params import Regex

    entered = threading.Semaphore(0)
    release = threading.Event()
    async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=32)) as eng:
        await drain(
            eng.generate([5, 6], SamplingParams(max_tokens=1, structured=Regex("b+")))
        )  # tokenizer ready
        compiler = eng.core.grammars
        build = compiler._build

        def held_build(spec):
            entered.release()
            release.wait(30)
            return build(spec)

        monkeypatch.setattr(compiler, "_build", held_build)
        params = [SamplingParams(max_tokens=3, structured=Regex(f"a{i}+")) for i in range(3)]
        tasks = [asyncio.create_task(drain(eng.generate([5, 6], p))) for p in params]
        for _ in range(2):  # both compile threads busy, the third compile queued
            assert await asyncio.to_thread(entered.acquire, True, 30)
        await eng.stop()
        release.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    assert all(isinstance(r, EngineDeadError) for r in results), results


async def test_abort_of_n_samples_before_they_fork(tiny_llama_dir, monkeypatch):
    async with AsyncEngine(
        EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_prefill_chunk=16)
    ) as eng:
        slow_down_steps(monkeypatch, eng)
        params = SamplingParams(temperature=0.5, max_tokens=20, n=3, output_kind="delta")
        prompt = list(
            range(3, 603)
        )  # prefilled over several steps: the abort lands before the fork
        t = asyncio.create_task(drain(eng.generate(prompt, params, request_id="r")))
        await wait_for(lambda: eng.stats()["num_running"] >= 1)
        await eng.abort("r")
        outs = await asyncio.wait_for(t, 30)
        idx = sorted(c.index for o in outs for c in o.outputs if c.finish_reason)
        assert idx == [0, 1, 2], outs
        await wait_for(lambda: all_blocks_free(eng))


async def test_exception_in_the_consumer_aborts_the_request(engine):
    with pytest.raises(KeyError):
        async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True)):
            raise KeyError("boom")
    await wait_for(lambda: all_blocks_free(engine))


async def test_delta_n_samples_each_finish_once_and_add_up(engine):
    for seed in range(4):
        params = SamplingParams(
            temperature=1.5,
            seed=seed,
            max_tokens=30,
            n=4,
            output_kind="delta",
            stop=["a", "e", "i", "o"],
            logprobs=0,
        )
        outs = await drain(engine.generate("Hello there my friend", params))
        cum = await drain(
            engine.generate(
                "Hello there my friend",
                SamplingParams(
                    temperature=1.5,
                    seed=seed,
                    max_tokens=30,
                    n=4,
                    stop=["a", "e", "i", "o"],
                    logprobs=0,
                ),
            )
        )
        fins = {}
        toks = {}
        text = {}
        for o in outs:
            for c in o.outputs:
                toks.setdefault(c.index, []).extend(c.token_ids)
                text[c.index] = text.get(c.index, "") + c.text
                if c.finish_reason:
                    assert c.index not in fins
                    fins[c.index] = c.finish_reason
        assert sorted(fins) == [0, 1, 2, 3]
        for c in cum[-1].outputs:
            assert (
                toks[c.index] == c.token_ids
                and text[c.index] == c.text
                and fins[c.index] == c.finish_reason
            )


async def test_beam_search_at_the_context_limit_and_max_tokens_1(tiny_llama_dir):
    async with AsyncEngine(
        EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_model_len=48)
    ) as eng:
        outs = await drain(
            eng.generate(list(range(3, 50)), SamplingParams(max_tokens=1, beam_width=3, n=3))
        )
        assert outs[-1].finished and all(len(c.token_ids) == 1 for c in outs[-1].outputs), outs
        outs = await drain(
            eng.generate(
                list(range(3, 20)),
                SamplingParams(max_tokens=1, beam_width=2, n=2, output_kind="delta"),
            )
        )
        assert outs[-1].finished and all(len(c.token_ids) == 1 for c in outs[-1].outputs), outs
        outs = await drain(
            eng.generate(
                list(range(3, 20)),
                SamplingParams(max_tokens=5, beam_width=4, n=4, stop_token_ids=[8]),
            )
        )
        assert outs[-1].finished
        assert all_blocks_free(eng), eng.stats()


async def test_abort_pending_at_stop_does_not_hit_a_later_request(tiny_llama_dir, monkeypatch):
    eng, entered, release = await _engine_with_held_steps(tiny_llama_dir, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    task = asyncio.create_task(drain(eng.generate([5, 6, 7], params, request_id="r1")))
    assert await asyncio.to_thread(entered.wait, 30)
    await eng.abort("r1")  # lands while the step is in flight: applied after it
    stopping = asyncio.create_task(eng.stop())
    await asyncio.sleep(0)
    release.set()
    await stopping
    with pytest.raises(EngineDeadError):
        await task
    monkeypatch.undo()  # the plain forward pass again
    async with eng:
        outs = await asyncio.wait_for(drain(eng.generate([5, 6, 7], params, request_id="r1")), 30)
    assert outs[-1].outputs[0].finish_reason == "length", outs[-1]


@pytest.mark.parametrize("plen", [16, 17, 32])
async def test_cached_prompts_give_the_same_samples_and_beams(engine, plen):
    prompt = list(range(3, 3 + plen))
    params = SamplingParams(
        temperature=0.9, seed=7, max_tokens=12, ignore_eos=True, n=3, logprobs=1
    )
    a = await drain(engine.generate(prompt, params))
    b = await drain(engine.generate(prompt, params))
    assert b[-1].num_cached_tokens > 0 or plen < 17
    assert [c.token_ids for c in a[-1].outputs] == [c.token_ids for c in b[-1].outputs]
    g = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, beam_width=3, n=2)
    c = await drain(engine.generate(prompt, g))
    d = await drain(engine.generate(prompt, g))
    assert [x.token_ids for x in c[-1].outputs] == [x.token_ids for x in d[-1].outputs]
    assert all_blocks_free(engine)


def test_tokens_to_compute_does_not_count_samples_waiting_to_fork(tiny_llama_dir):
    """Samples 1..n-1 fork sample 0's prompt blocks: they compute none of the prompt, so a
    router must not see n times the prompt queued (nor n times each chunk still to come)."""
    from streamengine.engine.core import EngineCore

    core = EngineCore(
        EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_prefill_chunk=16)
    )
    params = SamplingParams(temperature=0.5, max_tokens=4, ignore_eos=True, n=3)
    core.add_request("a", list(range(3, 3 + 200)), params)
    assert core.stats()["num_tokens_to_compute"] == 200
    core.step()  # one chunk of sample 0's prompt
    computed = core.requests["a"].samples[0].seq.num_computed_tokens
    assert 0 < computed < 200
    assert core.stats()["num_tokens_to_compute"] == 200 - computed
    while core.stats()["num_running"] < 3:
        core.step()
    assert core.stats()["num_tokens_to_compute"] == 3  # three samples decoding
    while core.has_work():
        core.step()
    assert core.stats()["num_tokens_to_compute"] == 0


COMBOS = [
    dict(temperature=0),
    dict(temperature=0, repetition_penalty=1.3, logprobs=3),
    dict(temperature=0.8, seed=1, top_k=5, n=2),
    dict(temperature=1.0, seed=2, top_p=0.5, presence_penalty=1.0),
    dict(temperature=0.7, seed=3, min_p=0.2, frequency_penalty=0.5, logprobs=0),
    dict(temperature=1.2, seed=4, n=3, stop=["e"], logprobs=2),
    dict(temperature=0, beam_width=2, n=2),
    dict(temperature=0.9, seed=5, min_tokens=5, max_tokens=7),
]


async def test_mixed_parameters_in_one_batch_match_running_alone(tiny_llama_dir):
    async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128)) as eng:

        async def one(i, kw):
            kw = dict(kw)
            params = SamplingParams(max_tokens=kw.pop("max_tokens", 12), **kw)
            outs = await drain(eng.generate(f"Hello there number {i} my friend", params))
            return [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in outs[-1].outputs]

        alone = [await one(i, kw) for i, kw in enumerate(COMBOS)]
        together = await asyncio.gather(*(one(i, kw) for i, kw in enumerate(COMBOS)))
        for a, b in zip(alone, together, strict=True):
            assert [x[:3] for x in a] == [x[:3] for x in b]
        assert all_blocks_free(eng)


async def test_text_prompt_tokenized_past_the_models_vocabulary_is_refused(
    tiny_llama_dir, tmp_path
):
    """A tokenizer may know more ids than the model has embeddings. A text prompt that
    tokenizes past the model's vocabulary is refused up front, like such token ids given
    directly; it must not reach the forward pass, where it failed every request batched with it
    (and on CUDA, an out-of-range embedding index is a device-side assert)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(tmp_path)
    async with AsyncEngine(EngineConfig(model=str(tmp_path), num_gpu_blocks=32)) as eng:
        assert max(eng.tokenizer.encode("Hello there my friend")) >= 300
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        other = asyncio.create_task(drain(eng.generate([5, 6, 7], params)))
        with pytest.raises(ValueError, match="vocabulary|out of range"):
            await drain(eng.generate("Hello there my friend", params))
        outs = await asyncio.wait_for(other, 30)
        assert outs[-1].outputs[0].finish_reason == "length"
        assert all_blocks_free(eng)


async def test_text_prompt_that_tokenizes_to_nothing_is_refused(engine, monkeypatch):
    """Some tokenizers (no BOS, a normalizer that drops characters) turn a non-empty text into
    no tokens. That is a bad request, refused like an empty prompt, and harms no other."""
    encode = engine.tokenizer.encode
    monkeypatch.setattr(
        engine.tokenizer,
        "encode",
        lambda text, **kw: [] if text == "\u200b" else encode(text, **kw),
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    other = asyncio.create_task(drain(engine.generate([5, 6, 7], params)))
    with pytest.raises(ValueError, match="no tokens"):
        await asyncio.wait_for(drain(engine.generate("\u200b", params)), 30)
    outs = await asyncio.wait_for(other, 30)
    assert outs[-1].outputs[0].finish_reason == "length"
    assert engine.health()["num_restarts"] == 0
    assert all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kind", ["n", "beam"])
async def test_samples_and_beams_wider_than_the_pool_finish(tiny_llama_dir, mode, kind):
    from test_preemption import swap_bytes

    async with AsyncEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            num_gpu_blocks=6,
            preemption_mode=mode,
            swap_space_bytes=swap_bytes(tiny_llama_dir, 64),
        )
    ) as eng:
        kw = dict(n=4) if kind == "n" else dict(beam_width=4, n=2)
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, **kw)
        outs = await asyncio.wait_for(drain(eng.generate(list(range(3, 3 + 40)), params)), 60)
        assert [(c.finish_reason, len(c.token_ids)) for c in outs[-1].outputs] == [
            ("length", 50)
        ] * params.n
        other = await asyncio.wait_for(
            drain(eng.generate([5, 6, 7], SamplingParams(max_tokens=5))), 60
        )
        assert other[-1].finished
        await wait_for(lambda: all_blocks_free(eng))
        s = eng.stats()
        assert s["num_swap_blocks_free"] == s["num_swap_blocks"]


async def test_streams_end_even_if_stop_is_cancelled(tiny_llama_dir, monkeypatch):
    """stop() waits for the forward pass in flight; a caller that gives up on that wait
    (asyncio.wait_for, a cancelled shutdown task) must still leave every open stream ended with
    EngineDeadError, not waiting forever for a step loop that is gone."""
    eng, entered, release = await _engine_with_held_steps(tiny_llama_dir, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    task = asyncio.create_task(drain(eng.generate([5, 6, 7], params)))
    assert await asyncio.to_thread(entered.wait, 30)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(eng.stop(), 0.2)  # the forward pass is still held
    try:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 30)
    finally:
        release.set()
    await eng.stop()  # waits for the thread this time
    s = eng.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["num_requests"] == 0


@pytest.mark.parametrize("kw", [dict(n=4, temperature=0.8, seed=3), dict(beam_width=4, n=2)])
async def test_samples_and_beams_wider_than_max_num_seqs(tiny_llama_dir, kw):
    params = SamplingParams(max_tokens=20, ignore_eos=True, **kw)
    res = []
    for seqs in (8, 2, 1):
        async with AsyncEngine(
            EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_num_seqs=seqs)
        ) as eng:
            outs = await asyncio.gather(
                *(
                    asyncio.wait_for(drain(eng.generate(list(range(3 + i, 30)), params)), 60)
                    for i in range(3)
                )
            )
            res.append([[c.token_ids for c in o[-1].outputs] for o in outs])
            assert all_blocks_free(eng)
    assert res[0] == res[1] == res[2]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_consumers_leaving_at_every_stage_under_pressure(tiny_llama_dir, long_alone, mode):
    import random

    from test_preemption import swap_bytes

    rng = random.Random(0)
    async with AsyncEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            num_gpu_blocks=14,
            preemption_mode=mode,
            swap_space_bytes=swap_bytes(tiny_llama_dir, 32),
            max_prefill_chunk=16,
        )
    ) as eng:

        async def one(i, p, kw, leave_after):
            params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **kw)
            k = 0
            last = None
            async for out in eng.generate(p, params, request_id=f"r{i}"):
                last = out
                k += 1
                if k == leave_after:
                    if leave_after % 2:
                        await eng.abort(f"r{i}")
                    else:
                        return None
            return [c.token_ids for c in last.outputs], last

        jobs = []
        for i in range(24):
            p = LONG[i % len(LONG)]
            kw = rng.choice([{}, {"n": 2}, {"beam_width": 2}, {"n": 3}])
            leave = rng.choice([0, 0, 1, 2, 3, 5, 8])
            jobs.append((p, kw, leave, asyncio.create_task(one(i, p, kw, leave))))
        cancel = [j for j in jobs if j[2] == 0][:4]
        await asyncio.sleep(0.05)
        for j in cancel:
            j[3].cancel()
        for p, kw, leave, t in jobs:
            if t in [c[3] for c in cancel]:
                continue
            r = await asyncio.wait_for(t, 120)
            if r is not None and leave == 0 and not kw:
                assert r[0] == long_alone[LONG.index(p)]
        assert eng.stats()["num_preemptions"] > 0
        await wait_for(lambda: all_blocks_free(eng))
        s = eng.stats()
        assert s["num_swap_blocks_free"] == s["num_swap_blocks"]
        eng.core.audit()


@pytest.mark.parametrize(
    "kw", [dict(temperature=0), dict(temperature=0.8, seed=1, n=2, logprobs=1)]
)
async def test_min_tokens_keeps_end_tokens_from_being_drawn(engine, kw):
    """Before min_tokens, EOS and stop_token_ids are not drawn at all (vLLM masks them); the
    sample does not stop early, nor carry such a token in the middle of its output."""
    prompt = [5, 6, 7, 8]
    plain = await drain(
        engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, **kw))
    )
    stop = plain[-1].outputs[0].token_ids[0]  # the token the model draws first
    params = SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[stop, 2], **kw)
    outs = await drain(engine.generate(prompt, params))
    for c in outs[-1].outputs:
        assert len(c.token_ids) >= 4
        assert not {stop, 2} & set(c.token_ids[:4]), c.token_ids
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in (stop, 2) and c.stop_reason in (stop, 2, None)
    assert all_blocks_free(engine)


def test_one_engine_object_in_two_event_loops(tiny_llama_dir):
    """An engine built outside any loop serves one asyncio.run, then another."""
    from streamengine.structured.params import Regex

    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=32))

    async def use():
        async with eng:
            plain = await _greedy(eng, [[5, 6, 7]], 5)
            params = SamplingParams(temperature=0, max_tokens=5, structured=Regex("[ab]+"))
            constrained = await drain(eng.generate([5, 6, 7], params))
            return plain, constrained[-1].outputs[0].text

    first, second = asyncio.run(use()), asyncio.run(use())
    assert first == second
    assert set(first[1]) <= {"a", "b"}


async def test_changing_the_callers_params_does_not_touch_a_running_request(engine, monkeypatch):
    """The engine keeps its own copy of a request's SamplingParams (vLLM clones them too): a
    caller that reuses and edits its params object for the next request must not switch a
    running request to another output kind, temperature or limit mid-stream."""
    slow_down_steps(monkeypatch, engine)
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, output_kind="delta", stop=["zz"]
    )
    alone = await drain(
        engine.generate(
            "Hello there my friend", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )
    )
    expected = alone[-1].outputs[0].text
    middle = expected[len(expected) // 2:][:3]  # applied, this stop string would cut the output
    assert middle
    tokens, text = [], ""
    async for out in engine.generate("Hello there my friend", params):
        tokens += out.outputs[0].token_ids if out.outputs else []
        text += out.outputs[0].text if out.outputs else ""
        params.output_kind, params.temperature, params.max_tokens = "cumulative", 1.5, 40
        params.stop.append(middle)
    assert tokens == alone[-1].outputs[0].token_ids
    assert text == alone[-1].outputs[0].text


class _BosTokenizer:
    """Adds a BOS (id 1, text "<s>") like Llama's tokenizer; one id per character otherwise."""

    bos_token, bos_token_id = "<s>", 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        while text:
            if text.startswith(self.bos_token):
                ids.append(self.bos_token_id)
                text = text[len(self.bos_token):]
            else:
                ids.append(ord(text[0]))
                text = text[1:]
        return [self.bos_token_id, *ids] if add_special_tokens else ids


def test_a_text_that_starts_with_the_bos_gets_no_second_one():
    """A chat template's rendering starts with the BOS; encoded with the tokenizer's special
    tokens it started with two (Llama, Mistral, Gemma), which `generate(apply_chat_template(...))`
    then fed the model."""
    from streamengine.engine.intake import encode_prompt

    tokenizer = _BosTokenizer()
    assert encode_prompt(tokenizer, "<s>user: hi") == [1, *map(ord, "user: hi")]
    assert encode_prompt(tokenizer, "hi") == [1, ord("h"), ord("i")]  # a plain prompt gets its BOS
    assert encode_prompt(tokenizer, "<s><s>x") == [1, 1, ord("x")]  # two written: both kept
    assert encode_prompt(tokenizer, "<s>user: hi", chat=True) == [1, *map(ord, "user: hi")]
    assert encode_prompt(tokenizer, "user: hi", chat=True) == list(map(ord, "user: hi"))


async def test_logit_bias_bans_and_forces_tokens(engine):
    prompt = [5, 6, 7, 8]
    plain = (await drain(engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0))))[-1]
    first = plain.outputs[0].token_ids[0]
    banned = SamplingParams(max_tokens=3, temperature=0, logit_bias={first: -100.0})
    assert (await drain(engine.generate(prompt, banned)))[-1].outputs[0].token_ids[0] != first
    forced = SamplingParams(max_tokens=3, temperature=0.9, seed=1, logit_bias={1000: 100.0}, ignore_eos=True)
    assert (await drain(engine.generate(prompt, forced)))[-1].outputs[0].token_ids == [1000] * 3
    with pytest.raises(ValueError, match="logit_bias"):
        await anext(engine.generate(prompt, SamplingParams(logit_bias={10**9: 1.0})))
    assert all_blocks_free(engine)


async def test_a_cancelled_stop_is_cancelled_and_still_ends_the_streams(engine, monkeypatch):
    """stop() awaited by a caller that is cancelled while it waits raises CancelledError (it
    used to swallow it and return as if the stop had been waited for), and the open streams
    end with EngineDeadError all the same."""
    slow_down_steps(monkeypatch, engine)
    stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
    await anext(stream)
    stopping = asyncio.ensure_future(engine.stop())
    await asyncio.sleep(0)  # stop() is waiting for the step loop
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass


async def test_stop_from_a_task_that_caught_a_cancellation_still_stops_everything(tiny_llama_dir):
    """A task that caught a CancelledError keeps a cancel count; leaving `async with engine`
    from it used to make stop() re-raise at its first wait, leaving the forward-pass thread
    (and a repin task, when one was pending) running behind an engine that said "stopped"."""
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=32))
    started = asyncio.Event()
    loop_tasks = []

    async def user():
        async with eng:
            loop_tasks.append(eng._task)
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass  # handled here: the task goes on and leaves the engine

    task = asyncio.create_task(user())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    await task
    assert loop_tasks[0].done() and eng._executor is None and not eng.is_running
    assert eng.health()["state"] == "stopped"
