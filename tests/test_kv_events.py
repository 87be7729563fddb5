"""KV cache events: exact BlockStored / BlockRemoved / AllBlocksCleared batches from the engine
(prefill runs, shared prefixes, chunked prefill, eviction in a tiny pool, a failed step's reset,
a core restart), overflow and its resync batch, salts never on the wire, vLLM's wire layout,
subscriptions that end, and a random walk of the block manager whose events always rebuild its
cached set."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from test_prefix_isolation import PinningMachine

from streamengine import AsyncEngine, EngineConfig, RequestFailedError, SamplingParams
from streamengine.kv.block_hash import hash_block, prompt_block_hashes
from streamengine.kv.block_manager import BlockManager
from streamengine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSubscription,
    decode,
    encode,
)
from streamengine.sequence import Sequence
from streamengine.tenancy.tenants import TenantConfig

BS = 16
SALT_A, SALT_B, USER_SALT = "s3cret-of-tenant-a", "s3cret-of-tenant-b", "alice-private-salt"
SYSTEM = list(range(5000, 5064))  # 4 blocks
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def tokens(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def medium(engine: AsyncEngine) -> str:
    return "GPU" if engine.core.device.type == "cuda" else "CPU"


def stored(engine: AsyncEngine, hashes: list[bytes], parent: bytes | None, token_ids: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, token_ids, BS, None, medium(engine))


async def run(engine: AsyncEngine, prompt: list[int], **kw) -> None:
    async for _ in engine.generate(prompt, PARAMS, **kw):
        pass


async def next_batch(sub: KVEventSubscription) -> EventBatch:
    return await asyncio.wait_for(anext(sub), 10)


async def pending(sub: KVEventSubscription) -> list[list]:
    """The events of every batch buffered now (a step publishes before its outputs go out)."""
    return [(await next_batch(sub)).events for _ in range(sub.num_pending)]


def apply(view: set[bytes], events) -> set[bytes]:
    """A consumer's view of the cached hashes."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            view.clear()
        elif isinstance(event, BlockStored):
            view.update(event.block_hashes)
        else:
            view.difference_update(event.block_hashes)
    return view


@pytest.fixture
async def engine(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir), num_gpu_blocks=64, block_size=BS, max_pinned_fraction=0.5,
        tenants=(TenantConfig("a", cache_salt=SALT_A), TenantConfig("b", cache_salt=SALT_B)),
    )
    async with AsyncEngine(config) as eng:
        yield eng


# -- what a step publishes -------------------------------------------------------------------


async def test_a_prompt_is_stored_as_one_run_and_nothing_is_recorded_without_subscribers(engine):
    await run(engine, tokens(40, 100))
    assert engine.core.block_manager.pool.kv_events is None  # nobody subscribed: nothing recorded
    sub = engine.kv_events()
    assert (await next_batch(sub)).events[0] == AllBlocksCleared()  # the snapshot of what was cached
    prompt = tokens(3 * BS + 5, 1000)
    await run(engine, prompt)
    hashes = engine.block_hashes(prompt)
    assert len(hashes) == 3
    assert await pending(sub) == [[stored(engine, hashes, None, prompt[:48])]]
    await run(engine, prompt)  # every full block a hit: no batch
    await run(engine, prompt[:48])  # the hit cap recomputes block 3, a duplicate: no batch either
    assert sub.num_pending == 0
    sub.close()
    assert engine.core.block_manager.pool.kv_events is None


async def test_a_shared_prefix_then_new_blocks_gives_their_run_with_the_shared_parent(engine):
    sub = engine.kv_events()
    first = tokens(3 * BS + 5, 1000)
    await run(engine, first)
    second = first[:2 * BS] + tokens(BS + 5, 9000)
    await run(engine, second)
    h1, h2 = engine.block_hashes(first), engine.block_hashes(second)
    assert h2[:2] == h1[:2] and h2[2] != h1[2]
    assert await pending(sub) == [
        [stored(engine, h1, None, first[:48])],
        [stored(engine, h2[2:], h1[1], second[32:48])],
    ]


async def test_chunked_prefill_continues_the_run_from_the_last_block_of_the_chunk_before(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir), num_gpu_blocks=16, block_size=BS, max_prefill_chunk=64, scheduling_policy="fcfs",
    )
    async with AsyncEngine(config) as engine:
        sub = engine.kv_events()
        prompt = tokens(5 * BS + 5, 2000)  # 64 tokens a step: 4 blocks, then the fifth
        await run(engine, prompt)
        h = engine.block_hashes(prompt)
        assert await pending(sub) == [
            [stored(engine, h[:4], None, prompt[:64])],
            [stored(engine, h[4:], h[3], prompt[64:80])],
        ]


async def test_eviction_in_a_tiny_pool_removes_exactly_the_evicted_hashes(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=8, block_size=BS, max_prefill_chunk=None)
    async with AsyncEngine(config) as engine:
        sub = engine.kv_events()
        a, b = tokens(3 * BS + 5, 1000), tokens(6 * BS + 4, 3000)
        await run(engine, a)
        before = set(engine.core.block_manager.pool.cached)
        await run(engine, b)  # 7 blocks of 8: a's free tail block, then its blocks 2 and 1 (tail first)
        ha, hb = engine.block_hashes(a), engine.block_hashes(b)
        assert await pending(sub) == [
            [stored(engine, ha, None, a[:48])],
            [BlockRemoved([ha[2], ha[1]], medium(engine)), stored(engine, hb, None, b[:96])],
        ]
        assert before - set(engine.core.block_manager.pool.cached) == {ha[2], ha[1]}


async def test_a_failed_step_clears_everything_but_the_pinned_blocks(engine, monkeypatch):
    sub = engine.kv_events()
    await engine.pin_prefix(SYSTEM, tenant="a")
    pinned = engine.block_hashes(SYSTEM, tenant="a")
    assert await pending(sub) == [[stored(engine, pinned, None, SYSTEM)]]
    execute = engine.core.execute

    def failing(step):
        monkeypatch.setattr(engine.core, "execute", execute)  # once
        raise RuntimeError("injected forward fault")

    monkeypatch.setattr(engine.core, "execute", failing)
    await run(engine, tokens(3 * BS + 5, 1000))  # ends with finish_reason "error"
    # the failed step's own blocks were registered, then forgotten with the reset: only the
    # clear and the pinned blocks, which keep their hashes, reach the consumer
    assert await pending(sub) == [[AllBlocksCleared(), stored(engine, pinned, None, SYSTEM)]]
    assert set(engine.core.block_manager.pool.cached) == set(pinned)


async def test_a_core_restart_clears_everything_and_events_go_on(engine, monkeypatch):
    sub = engine.kv_events()
    first = tokens(3 * BS + 5, 1000)
    await run(engine, first)

    def broken() -> None:
        raise RuntimeError("injected scheduler fault")

    monkeypatch.setattr(engine.core.scheduler, "schedule", broken)  # a restart replaces it
    with pytest.raises(RequestFailedError, match="engine restarted"):
        await run(engine, tokens(20, 4000))
    assert await pending(sub) == [[stored(engine, engine.block_hashes(first), None, first[:48])], [AllBlocksCleared()]]
    await run(engine, first)  # the fresh block manager records too
    assert await pending(sub) == [[stored(engine, engine.block_hashes(first), None, first[:48])]]


# -- overflow and snapshots ------------------------------------------------------------------


async def test_overflow_counts_drops_and_its_resync_batch_is_the_exact_cached_set(engine):
    slow, fast = engine.kv_events(max_batches=1), engine.kv_events()
    prompts = [tokens(3 * BS + 5, start) for start in (1000, 2000, 3000)]
    for prompt in prompts:
        await run(engine, prompt)
    # the first batch was buffered; the second overflowed (both dropped), the third came while
    # the resync was owed (dropped: the resync covers it)
    assert (slow.dropped, slow.num_pending, fast.dropped, fast.num_pending) == (3, 1, 0, 3)
    resync = (await next_batch(slow)).events
    cached = engine.core.block_manager.pool.cached
    assert resync == [AllBlocksCleared()] + [stored(engine, engine.block_hashes(p), None, p[:48]) for p in prompts]
    assert apply(set(), resync) == set(cached) and len(cached) == 9
    assert apply(set(), [e for events in await pending(fast) for e in events]) == set(cached)
    extra = tokens(3 * BS + 5, 6000)
    await run(engine, extra)  # past the resync, batches flow again
    assert await pending(slow) == [[stored(engine, engine.block_hashes(extra), None, extra[:48])]]
    assert slow.dropped == 3


async def test_a_late_subscriber_starts_from_a_snapshot_parents_first(engine):
    first = tokens(3 * BS + 5, 1000)
    branch = first[:BS] + tokens(2 * BS + 3, 7000)
    await run(engine, first)
    await run(engine, branch)
    h1, h2 = engine.block_hashes(first), engine.block_hashes(branch)
    sub = engine.kv_events()
    assert await pending(sub) == [
        [AllBlocksCleared(), stored(engine, h1, None, first[:48]), stored(engine, h2[1:], h1[0], branch[16:48])],
    ]


def test_max_batches_is_validated():
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_batches"):
            KVEventSubscription(bad, list)


# -- salts ------------------------------------------------------------------------------------


async def test_salts_never_reach_the_wire_and_tenants_hashes_are_disjoint(engine):
    sub = engine.kv_events()
    await engine.pin_prefix(SYSTEM, tenant="a")
    prompt = SYSTEM + tokens(2 * BS + 3, 8000)
    await run(engine, prompt, tenant="a", cache_salt="alice")
    await run(engine, prompt, tenant="b")
    batches = [await next_batch(sub) for _ in range(sub.num_pending)]
    wire = b"".join(encode(batch) for batch in batches)
    for secret in (SALT_A, SALT_B, "alice", "tenant:", "user:"):
        assert secret.encode() not in wire
    got = [set(e.block_hashes) for batch in batches for e in batch.events]
    a_pin, a_user, *b_chunks = got  # b computes its whole prompt, in two chunks
    b_all = set().union(*b_chunks)
    assert a_pin == set(engine.block_hashes(SYSTEM, tenant="a"))
    # alice's request hit the pinned system prompt; her blocks after it carry her salt too
    assert a_user == set(engine.block_hashes(prompt, tenant="a", cache_salt="alice")[4:])
    assert b_all == set(engine.block_hashes(prompt, tenant="b")) and len(b_all) == 6
    assert not b_all & (a_pin | a_user)


# -- the wire ---------------------------------------------------------------------------------


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):  # vLLM's fields, none with a default
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


def test_encode_decode_round_trip_in_vllms_layout():
    h = [bytes([i]) * 16 for i in range(3)]
    batch = EventBatch(
        12.5, [AllBlocksCleared(), BlockStored(h[:2], None, list(range(8)), 4), BlockRemoved([h[2]], "GPU")],
    )
    data = encode(batch)
    assert decode(data) == batch
    assert msgspec.msgpack.decode(data) == [
        12.5,
        [["AllBlocksCleared"], ["BlockStored", h[:2], None, list(range(8)), 4, None, "CPU"], ["BlockRemoved", [h[2]], "GPU"]],
        None,
    ]
    theirs = msgspec.msgpack.decode(data, type=VllmKVEventBatch)  # a consumer written for vLLM
    stored_ = theirs.events[1]
    assert (stored_.block_hashes, stored_.parent_block_hash, stored_.block_size, stored_.medium) == (h[:2], None, 4, "CPU")
    assert theirs.events[2].block_hashes == [h[2]] and isinstance(theirs.events[0], VllmAllBlocksCleared)
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode([1.0, [["BlockStored", "not a list"]]]))


# -- ending -----------------------------------------------------------------------------------


async def test_close_ends_a_waiting_consumer_and_stop_ends_every_subscription(engine):
    closed, ended = engine.kv_events(), engine.kv_events()

    async def consume(sub: KVEventSubscription) -> list[EventBatch]:
        return [batch async for batch in sub]

    waiting = asyncio.create_task(consume(closed))
    await asyncio.sleep(0.05)
    closed.close()
    assert await asyncio.wait_for(waiting, 5) == []
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(closed), 5)
    draining = asyncio.create_task(consume(ended))
    await run(engine, tokens(BS + 1, 1000))
    await engine.stop()
    batches = await asyncio.wait_for(draining, 5)  # what it had buffered, then the end
    assert [b.events for b in batches] == [[stored(engine, engine.block_hashes(tokens(BS + 1, 1000)), None, tokens(BS, 1000))]]
    assert engine.core.block_manager.pool.kv_events is None
    late = engine.kv_events()  # on a stopped engine: it lives until the next stop
    await engine.start()
    await engine.stop()
    assert [b.events async for b in late] == [engine.core.kv_snapshot()]  # its snapshot, then the end


# -- the block manager --------------------------------------------------------------------------


def test_prompt_block_hashes_equal_the_block_managers():
    bm = BlockManager(8, 4)
    ids = list(range(30, 45))  # 3 full blocks and 3 tokens
    segments = ((0, None), (4, "tenant"), (8, "tenant\x00user:u"))
    seq = Sequence(0, "r0", ids, cache_salt="tenant\x00user:u", salt_segments=segments)
    expected = bm.compute_block_hashes(seq)
    assert prompt_block_hashes(ids, 4, segments, "tenant\x00user:u") == expected
    assert expected[0] == hash_block(None, ids[:4], None) and expected[1] == hash_block(expected[0], ids[4:8], "tenant")
    assert prompt_block_hashes(ids, 4) == prompt_block_hashes(ids, 4, (), None) != expected
    assert bm.pool.take_kv_events() == [] and bm.pool.kv_events is None


class KVEventsMachine(PinningMachine):
    """Pins, resets, swaps, forks and evictions at random, with a consumer applying every
    event: its view equals the cached set after each step, every BlockStored names the tokens
    and parent its hashes were computed from, and a snapshot rebuilds the set parents first."""

    view: set[bytes] | None = None

    @invariant()
    def events_rebuild_the_cached_set(self) -> None:
        bm = self.bm
        if bm is None:
            return
        if self.view is None:  # right after setup: the pool is empty
            bm.pool.record_kv_events("CPU")
            self.view = set()
        events = bm.pool.take_kv_events()
        for event in events:
            if isinstance(event, BlockStored):
                check_chain(event, bm.block_size)
        assert apply(self.view, events) == set(bm.pool.cached)

    @invariant()
    def a_snapshot_rebuilds_the_set_parents_first(self) -> None:
        if self.bm is None:
            return
        snapshot = self.bm.pool.kv_snapshot()
        assert snapshot[0] == AllBlocksCleared()
        seen: set[bytes] = set()
        for event in snapshot[1:]:
            check_chain(event, self.bm.block_size)
            assert event.parent_block_hash is None or event.parent_block_hash in seen or (
                event.parent_block_hash not in self.bm.pool.cached
            )
            seen.update(event.block_hashes)
        assert seen == set(self.bm.pool.cached) and sum(len(e.block_hashes) for e in snapshot[1:]) == len(seen)


def check_chain(event: BlockStored, block_size: int) -> None:
    """Each hash is the hash of its tokens after its parent, under one of the machine's salts."""
    assert len(event.token_ids) == block_size * len(event.block_hashes) and event.block_size == block_size
    parent = event.parent_block_hash
    for k, block_hash in enumerate(event.block_hashes):
        block = event.token_ids[k * block_size:(k + 1) * block_size]
        assert block_hash in {hash_block(parent, block, salt) for salt in (None, "a")}
        parent = block_hash


KVEventsMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
test_kv_events_machine = KVEventsMachine.TestCase
