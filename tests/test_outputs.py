"""Delta and cumulative outputs: what a request's stream yields, and how a slow consumer's
missed outputs are folded (output_processor.py, output_stream.py)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import slow_down_steps

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.engine.output_stream import RequestStream, merge_deltas
from streamengine.sample.outputs import CompletionOutput, RequestMetrics, RequestOutput


@pytest.fixture
async def engine(tiny_llama_dir):
    async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64)) as eng:
        yield eng


async def collect(engine, prompt, params, **kw) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, **kw)]


def joined(outs: list[RequestOutput]) -> dict[int, CompletionOutput]:
    """Every sample's deltas concatenated, as a client would rebuild them."""
    return {c.index: c for c in merge_deltas(outs).outputs}


SEEDED = dict(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, logprobs=2)


async def test_deltas_add_up_to_the_cumulative_output(engine):
    cumulative = await collect(engine, "Once upon a time", SamplingParams(n=3, **SEEDED))
    deltas = await collect(engine, "Once upon a time", SamplingParams(n=3, output_kind="delta", **SEEDED))
    final = {c.index: c for c in cumulative[-1].outputs}
    rebuilt = joined(deltas)
    assert sorted(rebuilt) == [0, 1, 2]
    for i, whole in final.items():
        assert rebuilt[i].token_ids == whole.token_ids and len(whole.token_ids) == 20
        assert rebuilt[i].text == whole.text
        assert rebuilt[i].logprobs == whole.logprobs
        assert rebuilt[i].finish_reason == whole.finish_reason == "length"
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])


async def test_each_delta_carries_only_news(engine):
    outs = await collect(engine, "Count", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind="delta"))
    seen = 0
    for out in outs:
        for c in out.outputs:
            assert len(c.logprobs or ()) <= len(c.token_ids)
            seen += len(c.token_ids)
    assert seen == 12  # no token is sent twice
    assert len(outs) > 1


async def test_stop_string_text_is_held_back_then_cut(engine):
    """Deltas never show text that a stop string later removes."""
    probe = await collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    text = probe[-1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if len(stop) < 3 or not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], output_kind="delta")
    outs = await collect(engine, "Hello", params)
    rebuilt = joined(outs)[0]
    assert rebuilt.text == text[: text.index(stop)]
    assert rebuilt.finish_reason == "stop" and rebuilt.stop_reason == stop


async def test_a_slow_consumer_gets_merged_deltas_and_loses_nothing(engine, monkeypatch):
    slow_down_steps(monkeypatch, engine, 0.02)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind="delta")
    fast = await collect(engine, "Slow reader", params)
    outs = []
    async for out in engine.generate("Slow reader", params, request_id="slow"):
        outs.append(out)
        while "slow" in engine.core.requests:  # the reader stalls until the request has ended,
            await asyncio.sleep(0.01)  # however fast or slow the machine runs the steps
    assert len(outs) < len(fast)  # steps were folded together
    assert joined(outs)[0].token_ids == joined(fast)[0].token_ids
    assert joined(outs)[0].text == joined(fast)[0].text


async def test_aborted_delta_stream_ends_with_the_abort_reason(engine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind="delta")
    outs = []
    async for out in engine.generate("Go on", params, request_id="a"):
        outs.append(out)
        if len(outs) == 2:
            await engine.abort("a")
    assert outs[-1].finished
    assert joined(outs)[0].finish_reason == "abort"


async def test_beam_search_delta_is_its_whole_result(engine):
    params = dict(beam_width=3, n=2, max_tokens=6, temperature=0)
    cumulative = await collect(engine, "Beams", SamplingParams(**params))
    deltas = await collect(engine, "Beams", SamplingParams(output_kind="delta", **params))
    assert len(deltas) == 1 and deltas[0].finished
    assert [(c.token_ids, c.text) for c in deltas[0].outputs] == [(c.token_ids, c.text) for c in cumulative[-1].outputs]


def out(text: str, tokens: list[int], finished: bool = False, reason: str | None = None, index: int = 0) -> RequestOutput:
    return RequestOutput("r", [1, 2], [CompletionOutput(index, text, tokens, reason, [{t: -1.0} for t in tokens])], finished)


async def test_stream_concatenates_unread_deltas():
    stream = RequestStream(delta=True)
    stream.put(out("a", [1]))
    stream.put(out("b", [2], index=1))
    stream.put(out("c", [3], finished=True, reason="stop"))
    stream.put(out("late", [4]))  # nothing may follow a final output
    got = await asyncio.wait_for(stream.get(), 5)
    assert got.finished
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in got.outputs] == [(0, "ac", [1, 3], "stop"), (1, "b", [2], None)]
    assert got.outputs[0].logprobs == [{1: -1.0}, {3: -1.0}]


def test_coalesced_deltas_carry_the_newest_stage_times():
    early, late = out("a", [1]), out("b", [2], finished=True, reason="stop")
    early.metrics = RequestMetrics(1.0, 2.0, 3.0)
    late.metrics = RequestMetrics(1.0, 2.0, 3.0, finished_time=4.0)
    assert merge_deltas([early, late]).metrics == late.metrics


async def test_cumulative_stream_keeps_only_the_newest():
    stream = RequestStream()
    stream.put(out("a", [1]))
    stream.put(out("ab", [1, 2]))
    got = await asyncio.wait_for(stream.get(), 5)
    assert got.outputs[0].text == "ab" and got.outputs[0].token_ids == [1, 2]
