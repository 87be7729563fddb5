"""Tenants in the engine: registry and rate limits, salt segments, pinned prefixes, and the
guarantee that scheduling policy never changes results."""

from __future__ import annotations

import asyncio

import pytest

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.errors import LimitExceededError
from streamengine.tenancy.pinning import Pin, PinnedPrefix, Pins
from streamengine.tenancy.tenants import RATE_WINDOW_S, TenantConfig, TenantRateLimitError, Tenants

BS = 16


# -- registry and rate limit (no model) ---------------------------------------------------------


def test_tenant_config_is_validated():
    for bad in (dict(weight=0), dict(max_running=0), dict(max_kv_fraction=1.5), dict(tokens_per_minute=0),
                dict(max_n=0), dict(max_best_of=1.5), dict(max_n="4")):
        with pytest.raises(ValueError, match=f"TenantConfig.{next(iter(bad))}"):
            TenantConfig("a", **bad)
    with pytest.raises(ValueError, match="name"):
        TenantConfig("")
    assert TenantConfig("a").salt != TenantConfig("b").salt
    assert TenantConfig("a", cache_salt="s").salt == "s"


def test_unknown_tenants_are_registered_with_defaults():
    tenants = Tenants([TenantConfig("a", weight=2.0)])
    assert tenants.get("a").weight == 2.0
    assert tenants.get("new").weight == 1.0 and "new" in tenants


def test_rate_limit_counts_the_last_minute():
    tenants = Tenants([TenantConfig("a", tokens_per_minute=100)])
    tenants.record("a", 60, now=0.0)
    tenants.check_rate("a", now=1.0)  # 60 < 100
    tenants.record("a", 50, now=10.0)
    with pytest.raises(TenantRateLimitError) as err:
        tenants.check_rate("a", now=20.0)
    # 110 used; the first 60 age out at t=60, leaving 50 < 100
    assert err.value.retry_after == pytest.approx(RATE_WINDOW_S - 20.0)
    assert tenants.num_rejected["a"] == 1
    tenants.check_rate("a", now=RATE_WINDOW_S + 0.5)
    tenants.check_rate("unlimited", now=0.0)


def test_a_request_wider_than_its_tenants_caps_is_refused_by_name():
    tenants = Tenants([TenantConfig("a", max_n=4, max_best_of=2), TenantConfig("b", max_running=3)])
    tenants.check_width("a", n=4, beam_width=1)
    tenants.check_width("a", n=2, beam_width=2)
    for n, beam_width, limit in ((5, 1, "max_n"), (2, 3, "max_best_of")):
        with pytest.raises(LimitExceededError, match=f"past tenant 'a'.s {limit}") as err:
            tenants.check_width("a", n=n, beam_width=beam_width)
        assert err.value.limit == limit
    # max_running bounds the sequences a request runs at once too, samples or beams
    tenants.check_width("b", n=3, beam_width=1)
    for n, beam_width in ((4, 1), (1, 4)):
        with pytest.raises(LimitExceededError, match="may run at most 3") as err:
            tenants.check_width("b", n=n, beam_width=beam_width)
        assert err.value.limit == "max_running"
    tenants.check_width("unlimited", n=128, beam_width=32)


def test_a_new_tenant_takes_the_default_tenants_settings_but_its_own_salt():
    """What makes each of the server's --api-key keys a tenant of its own with the tenants
    file's `default` entry as its share and limits (apart from every other key's)."""
    tenants = Tenants([TenantConfig("default", weight=0.5, max_running=4, max_n=2, cache_salt="secret")])
    key = tenants.get("tenant-0123456789abcdef")
    assert (key.weight, key.max_running, key.max_n) == (0.5, 4, 2)
    assert key.salt == "tenant:tenant-0123456789abcdef" != tenants.get("default").salt
    assert Tenants().get("x") == TenantConfig("x")


# -- salt segments (no model) -------------------------------------------------------------------


def pins_with(*pins: tuple[str | None, bool, list[int]]) -> Pins:
    registry = Pins(BS)
    for i, (tenant, shared, ids) in enumerate(pins):
        registry.add(Pin(PinnedPrefix(f"p{i}", tenant, shared, len(ids), len(ids) // BS), tuple(ids)))
    return registry


def test_segments_follow_the_longest_matching_pins():
    preamble, system = list(range(40)), list(range(40, 80))
    pins = pins_with((None, True, preamble), ("a", False, preamble + system))
    prompt = preamble + system + [999] * 10
    # shared part in whole blocks (32 of 40 tokens), the tenant's pin (80 -> 80), then the user
    assert pins.segments(prompt, "a", "salt-a", "u1") == ((0, None), (32, "salt-a"), (80, "salt-a\x00user:u1"))
    assert pins.segments(prompt, "a", "salt-a", None) == ((0, None), (32, "salt-a"))
    # another tenant shares only the preamble; its user salt starts right after it
    assert pins.segments(prompt, "b", "salt-b", "u1") == ((0, None), (32, "salt-b\x00user:u1"))
    # no pins at all: the tenant salt (or tenant + user) from the first block
    assert Pins(BS).segments(prompt, "a", "salt-a", None) == ((0, "salt-a"),)
    assert pins.segments([7] * 50, "a", "salt-a", None) == ((0, "salt-a"),)


# -- the engine ---------------------------------------------------------------------------------


@pytest.fixture
async def engine(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_pinned_fraction=0.5,
                          tenants=(TenantConfig("a"), TenantConfig("b", weight=2.0)))
    async with AsyncEngine(config) as eng:
        yield eng


async def cached_tokens(engine, prompt, tenant=None, user=None) -> int:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = [o async for o in engine.generate(prompt, params, tenant=tenant, cache_salt=user)]
    return outs[-1].num_cached_tokens


SYSTEM = list(range(1000, 1064))  # 4 blocks
PREAMBLE = list(range(2000, 2032))  # 2 blocks


async def test_a_pinned_system_prompt_is_hit_by_its_tenant_only(engine):
    pin = await engine.pin_prefix(SYSTEM, tenant="a")
    assert (pin.num_blocks, pin.tenant, pin.shared) == (4, "a", False)
    assert engine.stats()["num_pinned_blocks"] == 4
    assert await cached_tokens(engine, SYSTEM + [5, 6, 7], tenant="a") == 64
    assert await cached_tokens(engine, SYSTEM + [5, 6, 7], tenant="b") == 0  # b's salt differs


async def test_users_share_the_pinned_prompt_but_not_each_others_messages(engine):
    await engine.pin_prefix(SYSTEM, tenant="a")
    message = list(range(3000, 3040))
    assert await cached_tokens(engine, SYSTEM + message, tenant="a", user="alice") == 64
    # alice's own next turn hits her earlier message; bob's identical message does not
    assert await cached_tokens(engine, SYSTEM + message + [1], tenant="a", user="alice") == 64 + 32
    assert await cached_tokens(engine, SYSTEM + message + [1], tenant="a", user="bob") == 64


async def test_a_shared_preamble_is_hit_by_every_tenant_and_only_it(engine):
    await engine.pin_prefix(PREAMBLE, shared=True)
    rest = list(range(4000, 4040))
    assert await cached_tokens(engine, PREAMBLE + rest, tenant="a") == 32
    assert await cached_tokens(engine, PREAMBLE + rest, tenant="b") == 32  # a's own blocks stay a's
    assert await cached_tokens(engine, PREAMBLE + rest, tenant="a") == 32 + 32


async def test_pinned_blocks_survive_pressure_and_unpin_releases_them(engine):
    pin = await engine.pin_prefix(SYSTEM, tenant="a")
    # Each fills most of the pool: every unpinned block is recycled. The pressure is a's own:
    # eviction takes the largest holder's blocks first, so another tenant's requests would
    # recycle their own blocks before a's few, pinned or not.
    for i in range(12):
        await cached_tokens(engine, [100 + i] * 400, tenant="a")
    assert await cached_tokens(engine, SYSTEM + [9], tenant="a") == 64
    await engine.unpin(pin.pin_id)
    assert engine.stats()["num_pinned_blocks"] == 0 and engine.pinned() == []
    for i in range(12):
        await cached_tokens(engine, [200 + i] * 400, tenant="a")
    assert await cached_tokens(engine, SYSTEM + [9], tenant="a") == 0
    with pytest.raises(KeyError):
        await engine.unpin(pin.pin_id)


async def test_a_busy_tenant_recycles_its_own_blocks_before_a_quiet_ones(engine):
    """Nothing pinned: a's prompt is cached once, then b fills most of the pool twelve times.
    Eviction takes from the tenant holding the most free cache, so b recycles its own blocks
    and a's stay (plain LRU would have evicted a's first: they are the oldest)."""
    await cached_tokens(engine, SYSTEM + [9], tenant="a")
    for i in range(12):
        await cached_tokens(engine, [300 + i] * 400, tenant="b")
    assert await cached_tokens(engine, SYSTEM + [9], tenant="a") == 64


async def test_pins_past_the_pinned_fraction_are_refused(engine):
    await engine.pin_prefix(list(range(16 * 30)), tenant="a")  # 30 of the 32 allowed
    with pytest.raises(LimitExceededError, match="max_pinned_fraction") as err:
        await engine.pin_prefix(list(range(5000, 5048)), tenant="b")
    assert err.value.limit == "max_pinned_fraction"
    with pytest.raises(ValueError, match="full block"):
        await engine.pin_prefix([1, 2, 3])


async def test_rate_limited_tenant_is_refused_and_others_are_not(engine):
    engine.add_tenant(TenantConfig("slow", tokens_per_minute=50))
    await cached_tokens(engine, list(range(60)), tenant="slow")
    with pytest.raises(TenantRateLimitError) as err:
        await cached_tokens(engine, [1, 2, 3], tenant="slow")
    assert err.value.retry_after > 0
    await cached_tokens(engine, [1, 2, 3], tenant="a")
    tenants = engine.stats()["tenants"]
    assert tenants["slow"]["num_rejected"] == 1 and tenants["b"]["weight"] == 2.0


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_greedy_outputs_do_not_depend_on_the_policy(tiny_llama_dir, policy):
    """Scheduling decides when tokens are computed, never which: every tenant's greedy output
    equals what the same prompt gives alone."""

    async def run(config: EngineConfig) -> dict[str, list[int]]:
        async with AsyncEngine(config) as engine:
            async def one(i: int) -> tuple[str, list[int]]:
                params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
                outs = [o async for o in engine.generate([10 + i] * (20 + 7 * i), params, tenant=f"t{i % 3}")]
                return f"r{i}", outs[-1].outputs[0].token_ids
            return dict(await asyncio.gather(*(one(i) for i in range(9))))

    base = dict(model=str(tiny_llama_dir), num_gpu_blocks=24, max_num_seqs=4,
                tenants=(TenantConfig("t0", weight=3.0), TenantConfig("t1")))
    got = asyncio.run(run(EngineConfig(scheduling_policy=policy, **base)))
    alone = asyncio.run(run(EngineConfig(scheduling_policy="fcfs", **dict(base, max_num_seqs=1))))
    assert got == alone


# -- quotas count every sequence a request runs ---------------------------------------------------


async def _peaks_of_a(tiny_llama_dir, tenant: TenantConfig, params: SamplingParams) -> list[tuple[int, int]]:
    """Three requests of tenant "a" at once; after each step, a's running requests and the
    distinct blocks their sequences hold."""
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, tenants=(tenant,))
    async with AsyncEngine(config) as engine:
        sched = engine.core.scheduler
        schedule, peaks = sched.schedule, []

        def recorded():
            out = schedule()
            mine = [s for s in sched.running if s.tenant == "a"]
            peaks.append((len({s.request_id for s in mine}), len({b for s in mine for b in s.block_table})))
            return out

        sched.schedule = recorded

        async def run(i: int) -> list:
            return [o async for o in engine.generate(list(range(100 + 40 * i, 140 + 40 * i)), params, tenant="a")]

        results = await asyncio.gather(*(run(i) for i in range(3)))
        assert engine.core.block_manager.num_free_blocks == 64
    assert all(r[-1].finished and len(r[-1].outputs) == params.n for r in results)
    return peaks


WIDE = {"samples": SamplingParams(temperature=1.0, n=3, max_tokens=40, ignore_eos=True, seed=1),
        "beams": SamplingParams(beam_width=3, n=3, max_tokens=40, ignore_eos=True)}


@pytest.mark.parametrize("kind", sorted(WIDE))
async def test_max_running_counts_the_sequences_a_request_forks(tiny_llama_dir, kind):
    """n=3 samples (or 3 beams) run 3 sequences: under max_running=4 one such request runs at
    a time."""
    peaks = await _peaks_of_a(tiny_llama_dir, TenantConfig("a", max_running=4), WIDE[kind])
    assert max(n for n, _ in peaks) == 1, peaks


@pytest.mark.parametrize("kind", sorted(WIDE))
async def test_a_request_wider_than_max_running_is_refused(tiny_llama_dir, kind):
    """Before the fix a tenant with nothing else running ran one request however wide: under
    max_running=2 an n=3 request ran 3 sequences (n=128 took every running slot)."""
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, tenants=(TenantConfig("a", max_running=2),))
    async with AsyncEngine(config) as engine:
        with pytest.raises(LimitExceededError, match="may run at most 2") as err:
            await anext(engine.generate([5, 6, 7], WIDE[kind], tenant="a"))
        assert err.value.limit == "max_running"
        assert engine.stats()["num_requests"] == 0


async def test_a_wide_request_gives_way_to_another_tenants_short_one(tiny_llama_dir):
    """A's one request of n=8 samples holds all 8 running slots; B's 8-token request arrives
    and finishes while A's samples still run (one of them yields its slot). Before the fix B
    waited until every sample of A's request had ended."""
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128, max_num_seqs=8,
                          tenants=(TenantConfig("a"), TenantConfig("b")))
    wide = SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=200, ignore_eos=True, output_kind="delta")
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        a_tokens = 0
        stream = engine.generate(list(range(100, 120)), wide, tenant="a")
        while a_tokens < 8 * 8:  # every sample is running
            a_tokens += sum(len(c.token_ids) for c in (await anext(stream)).outputs)
        assert engine.stats()["num_running"] == 8
        b = [o async for o in engine.generate([5, 6, 7], short, tenant="b")][-1]
        assert b.finished and len(b.outputs[0].token_ids) == 8
        assert engine.stats()["num_requests"] == 1  # A's samples are still running
        async for out in stream:
            a_tokens += sum(len(c.token_ids) for c in out.outputs)
    assert a_tokens == 8 * 200


@pytest.mark.parametrize("kind", sorted(WIDE))
async def test_max_kv_fraction_counts_the_blocks_of_a_requests_forks(tiny_llama_dir, kind):
    """A may hold 16 of the 64 blocks; beside another of its requests, a request's forks count
    against that too (a lone request may exceed it)."""
    peaks = await _peaks_of_a(tiny_llama_dir, TenantConfig("a", max_kv_fraction=0.25), WIDE[kind])
    assert max(n for n, _ in peaks) >= 2  # the quota, not the requests' size, kept them apart
    assert max(blocks for n, blocks in peaks if n >= 2) <= 16, peaks
