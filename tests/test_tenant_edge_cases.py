"""Tenancy and pinning edge cases: pins made in any order or beside each other, tenant configs
of the wrong type, salts that could collide, unpins during a restart's repin, and requests
that pinned prefixes leave without room. Each test failed before its fix."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tenants import cached_tokens

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.errors import RequestFailedError
from streamengine.kv.block_hash import prompt_block_hashes
from streamengine.tenancy.pinning import Pin, PinnedPrefix, Pins
from streamengine.tenancy.tenants import TenantConfig

BS = 16
SYSTEM = list(range(1000, 1064))  # 4 blocks
PREAMBLE = list(range(2000, 2032))  # 2 blocks




@pytest.fixture
async def engine(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_pinned_fraction=0.5,
                          tenants=(TenantConfig("a"), TenantConfig("b", weight=2.0)))
    async with AsyncEngine(config) as eng:
        yield eng


# -- a tenant's pin keeps being hit whatever shared pins come and go -------------------------


def _pin(pin_id: str, tenant: str | None, ids: list[int]) -> Pin:
    return Pin(PinnedPrefix(pin_id, tenant, tenant is None, len(ids), len(ids) // BS), tuple(ids))


def test_a_tenant_pin_keeps_the_segments_it_was_computed_with():
    pins = Pins(BS)
    pins.add(_pin("sys", "a", PREAMBLE + SYSTEM))  # computed with no shared pin: all salted
    prompt = PREAMBLE + SYSTEM + [7] * 20
    assert pins.segments(prompt, "a", "salt-a", None) == ((0, "salt-a"),)
    pins.add(_pin("pre", None, PREAMBLE))
    # still all salted for a (its pinned blocks' hashes); another tenant shares the preamble
    assert pins.segments(prompt, "a", "salt-a", None) == ((0, "salt-a"),)
    assert pins.segments(prompt, "a", "salt-a", "u") == ((0, "salt-a"), (96, "salt-a\x00user:u"))
    assert pins.segments(prompt, "b", "salt-b", None) == ((0, None), (32, "salt-b"))
    # the other way round: computed behind the shared preamble, which is then unpinned
    pins = Pins(BS)
    pins.add(_pin("pre", None, PREAMBLE))
    pins.add(_pin("sys", "a", PREAMBLE + SYSTEM))
    pins.pop("pre")
    assert pins.segments(prompt, "a", "salt-a", "u") == ((0, None), (32, "salt-a"), (96, "salt-a\x00user:u"))
    assert pins.segments(prompt, "b", "salt-b", None) == ((0, "salt-b"),)


async def test_a_system_prompt_pinned_before_the_shared_preamble_is_still_hit(engine):
    """Before the fix: pinning the preamble after a's system prompt changed the hashes of a's
    requests over the preamble, so they hit the 2 preamble blocks and never again the 6
    blocks a had pinned (and still held)."""
    prompt = PREAMBLE + SYSTEM
    await engine.pin_prefix(prompt, tenant="a")
    assert await cached_tokens(engine, prompt + [5], tenant="a") == 96
    await engine.pin_prefix(PREAMBLE, shared=True)
    assert await cached_tokens(engine, prompt + [5, 6], tenant="a") == 96
    assert await cached_tokens(engine, prompt + [5, 6, 7], tenant="a", user="alice") == 96
    assert await cached_tokens(engine, prompt + [5, 6], tenant="b") == 32  # the preamble only


async def test_a_system_prompt_pinned_behind_the_shared_preamble_survives_its_unpin(engine):
    prompt = PREAMBLE + SYSTEM
    preamble = await engine.pin_prefix(PREAMBLE, shared=True)
    await engine.pin_prefix(prompt, tenant="a")
    assert await cached_tokens(engine, prompt + [5], tenant="a") == 96
    await engine.unpin(preamble.pin_id)
    assert await cached_tokens(engine, prompt + [5, 6], tenant="a") == 96
    assert await cached_tokens(engine, prompt + [5, 6, 7], tenant="a", user="alice") == 96
    assert await cached_tokens(engine, prompt + [5, 6], tenant="b") == 0  # nothing shared any more


# -- a bad config is refused by TenantConfig, not by the engine step ---------------------------


@pytest.mark.parametrize("bad", [
    dict(cache_salt=123), dict(cache_salt=b"bytes"), dict(weight="2"), dict(weight=True),
    dict(max_running="3"), dict(max_running=1.5), dict(max_kv_fraction="0.5"),
    dict(tokens_per_minute=2.5), dict(tokens_per_minute=True),
])
def test_tenant_config_refuses_values_of_the_wrong_type(bad):
    field_name = next(iter(bad))
    with pytest.raises(ValueError, match=f"TenantConfig.{field_name} must be") as err:
        TenantConfig("x", **bad)
    if field_name == "cache_salt":
        assert "123" not in str(err.value) and "bytes'" not in str(err.value)  # a salt is never shown


async def test_a_tenant_added_at_run_time_cannot_break_the_engine(engine):
    """Before the fix TenantConfig took cache_salt=123; the first request of that tenant failed
    hashing its blocks inside the engine step, which restarted the engine and failed every other
    tenant's requests in flight."""
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_tenant(TenantConfig("x", cache_salt=123))
    assert await cached_tokens(engine, list(range(40)), tenant="x") == 0
    assert engine.health()["num_restarts"] == 0


def test_pins_add_takes_the_unsalted_head_from_the_segments_its_blocks_were_hashed_with():
    """The exact way (core passes its pin request's segments): a shared pin added while the
    tenant pin was computing does not change what the tenant pin's blocks were hashed with."""
    pins = Pins(BS)
    pins.add(_pin("pre", None, PREAMBLE))
    pins.add(_pin("sys", "a", PREAMBLE + SYSTEM), segments=((0, "salt-a"),))
    assert pins.segments(PREAMBLE + SYSTEM + [1], "a", "salt-a", None) == ((0, "salt-a"),)
    pins.add(_pin("sys2", "b", PREAMBLE + SYSTEM), segments=((0, None), (32, "salt-b")))
    assert pins.segments(PREAMBLE + SYSTEM + [1], "b", "salt-b", None) == ((0, None), (32, "salt-b"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pin", "unpin"]), st.sampled_from([None, "a", "b"]),
                          st.integers(1, 4)), max_size=12))
def test_tenant_pins_stay_hit_and_private_whatever_the_order_of_pins(ops):
    """Pins (shared preambles of 1-4 blocks, tenant prompts extending them) come and go in any
    order; after each change a tenant's request that starts with its pinned prompt computes the
    very hashes that prompt's blocks got when pinned (with or without a user salt), and no
    other tenant computes any of them past the unsalted head."""
    base = list(range(500, 500 + 8 * BS))
    pins, live = Pins(BS), {}  # pin id -> (tenant, hashes of its blocks)
    salts = {"a": "salt-a", "b": "salt-b"}
    for k, (op, tenant, blocks) in enumerate(ops):
        if op == "unpin":
            if live:
                pins.pop(sorted(live)[blocks % len(live)])
                live.pop(sorted(live)[blocks % len(live)])
            continue
        ids = base[: blocks * BS] if tenant is None else base[: (blocks + 4) * BS]
        pin = _pin(f"p{k}", tenant, ids)
        segments = ((0, None),) if tenant is None else pins.segments(ids, tenant, salts[tenant], None)
        pins.add(pin)  # its request's segments are those of this moment
        live[pin.info.pin_id] = (tenant, prompt_block_hashes(ids, BS, segments, segments[-1][1]))
        for _, (owner, hashes) in live.items():
            if owner is None:
                continue
            prompt = base[: len(hashes) * BS] + [1]
            for user in (None, "u"):
                mine = pins.segments(prompt, owner, salts[owner], user)
                got = prompt_block_hashes(prompt, BS, mine, mine[-1][1])
                shared = max((len(h) for o, h in live.values() if o is None), default=0)
                if shared < len(hashes):  # else a longer shared pin covers it (and is hit)
                    assert got == hashes
                other = "b" if owner == "a" else "a"
                theirs = pins.segments(prompt, other, salts[other], user)
                head = next((start for start, salt in mine if salt is not None), len(prompt)) // BS
                leaked = set(prompt_block_hashes(prompt, BS, theirs, theirs[-1][1])) & set(hashes[head:])
                assert not leaked


# -- a tenant's salt cannot be made to equal another tenant's user salt -------------------------


def test_tenant_names_and_salts_with_nul_are_refused():
    with pytest.raises(ValueError, match="TenantConfig.name must not contain NUL"):
        TenantConfig("a\x00user:alice")
    with pytest.raises(ValueError, match="TenantConfig.cache_salt must not contain NUL") as err:
        TenantConfig("b", cache_salt="salt-a\x00user:alice")
    assert "salt-a" not in str(err.value)


async def test_a_crafted_tenant_name_does_not_hit_a_users_private_blocks(engine):
    """Before the fix tenant "a\\0user:alice" (no user salt) had the salt of tenant a's user
    alice, so its request hit all 64 tokens of alice's conversation."""
    secret = list(range(3000, 3064))
    await cached_tokens(engine, secret + [1], tenant="a", user="alice")
    assert await cached_tokens(engine, secret + [2], tenant="a", user="alice") == 64
    with pytest.raises(ValueError, match="NUL"):
        await cached_tokens(engine, secret + [2], tenant="a\x00user:alice")
    assert await cached_tokens(engine, secret + [2], tenant="a", user="bob") == 0


async def test_a_tenant_pin_made_beside_a_shared_pin_is_hit(engine):
    """Before the fix: the two pins computed side by side; the tenant's was hashed without the
    shared preamble in place but registered after it, so its requests looked up hashes its
    pinned blocks do not have (32 cached tokens instead of 96)."""
    prompt = PREAMBLE + SYSTEM
    await asyncio.gather(engine.pin_prefix(PREAMBLE, shared=True), engine.pin_prefix(prompt, tenant="a"))
    assert await cached_tokens(engine, prompt + [5], tenant="a") == 96
    assert await cached_tokens(engine, prompt + [5, 6], tenant="a", user="alice") == 96
    assert await cached_tokens(engine, prompt + [5, 6], tenant="b") == 32  # the preamble only


async def _restart_with_pins(engine, monkeypatch) -> None:
    """Fails one scheduling step: the engine restarts its core and repins in the background."""
    scheduler = engine.core.scheduler
    monkeypatch.setattr(scheduler, "schedule", lambda: (_ for _ in ()).throw(RuntimeError("injected fault")))
    with pytest.raises(Exception, match="engine restarted"):
        await cached_tokens(engine, list(range(300, 340)), tenant="b")
    assert engine.core.scheduler is not scheduler


async def test_an_unpin_during_the_repin_after_a_restart_sticks(engine, monkeypatch):
    """Before the fix: unpin raised KeyError (the restart had cleared the pins), and the repin
    then pinned the prefix again for good, against the caller's wish."""
    kept = await engine.pin_prefix(PREAMBLE + SYSTEM, tenant="a")
    dropped = await engine.pin_prefix(list(range(3000, 3048)), tenant="b")
    await _restart_with_pins(engine, monkeypatch)
    await engine.unpin(dropped.pin_id)  # the repin has not reached it yet
    for _ in range(400):  # the repin starts after the restart's backoff
        if not engine._repin_pending:
            break
        await asyncio.sleep(0.05)
    assert engine.core.pins.get(kept.pin_id) is not None and engine.core.pins.get(dropped.pin_id) is None
    assert engine.core.block_manager.retention.num_pinned_blocks == kept.num_blocks
    with pytest.raises(KeyError):
        await engine.unpin(dropped.pin_id)
    assert await cached_tokens(engine, PREAMBLE + SYSTEM + [5], tenant="a") == 96


# -- requests that the pinned prefixes leave without room ----------------------------------------

HALF = list(range(1000, 1128))  # 8 blocks: half of a 16-block pool


async def _last(engine, prompt, tenant, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return [o async for o in engine.generate(prompt, params, tenant=tenant)][-1]


@pytest.fixture
async def engine16(tiny_llama_dir):
    async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=16)) as engine:
        yield engine


async def test_a_request_too_long_for_the_room_pins_leave_is_refused(engine16):
    engine = engine16
    await engine.pin_prefix(HALF, tenant="a")
    with pytest.raises(ValueError, match="only 8 of the pool's 16 blocks are free of pinned prefixes"):
        await _last(engine, list(range(2000, 2160)), "b")
    # the same length starting with a's pinned prompt needs only 3 more blocks: served
    out = await _last(engine, HALF + list(range(2000, 2032)), "a")
    assert out.finished and out.num_cached_tokens == 128 and len(out.outputs[0].token_ids) == 4


async def test_an_implicit_max_tokens_shrinks_to_the_room_pins_leave(engine16):
    """max_tokens=None means the room left in the context (the whole pool here): beside 8
    pinned blocks it is what the other 8 hold, not a refusal."""
    engine = engine16
    await engine.pin_prefix(HALF, tenant="a")
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)
    out = [o async for o in engine.generate([5, 6, 7], params, tenant="b")][-1]
    assert out.finished and len(out.outputs[0].token_ids) == 8 * 16 - 3
    # its own pinned blocks count as room for tenant a
    out = [o async for o in engine.generate(HALF + [5], params, tenant="a")][-1]
    assert out.num_cached_tokens == 128 and len(out.outputs[0].token_ids) == 16 * 16 - 129


async def test_a_request_left_without_room_by_a_later_pin_fails_alone(engine16):
    """b's 160 tokens fit the empty pool when it arrives, but the pin submitted just before
    it takes half the pool: b can never start. Before the fix the step loop found an empty
    step with work pending and restarted the engine, failing every request in flight."""
    engine = engine16
    pin = asyncio.ensure_future(engine.pin_prefix(HALF, tenant="a"))
    await asyncio.sleep(0)  # the pin's request is queued first
    other = asyncio.ensure_future(_last(engine, list(range(10, 20)), "c", max_tokens=40))
    with pytest.raises(RequestFailedError, match="no longer fits in the KV pool"):
        await _last(engine, list(range(2000, 2160)), "b")
    await pin
    assert (await other).finished
    assert engine.health()["num_restarts"] == 0
