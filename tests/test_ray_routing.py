"""The routing state of the Ray deployment, without a cluster: the block index mirrored from
KV events, the directory's log and snapshots, the router's ranking, and merged figures."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("ray.serve")

from streamengine.kv.block_hash import prompt_block_hashes  # noqa: E402
from streamengine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode  # noqa: E402
from streamengine.ray.block_index import BlockIndex  # noqa: E402
from streamengine.ray.cluster_engine import merge_stats  # noqa: E402
from streamengine.ray.directory import DirectoryUpdate, ReplicaDirectory  # noqa: E402
from streamengine.ray.request import ClusterAdapter, ReplicaRequest  # noqa: E402
from streamengine.ray.router import CachedBlockRouter  # noqa: E402
from streamengine.sample.sampling_params import SamplingParams  # noqa: E402

BS = 16
SALT_A = ((0, "tenant:a"),)
SALT_B = ((0, "tenant:b"),)


def _stored(hashes, parent=None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[], block_size=BS)


def _batch(*events) -> EventBatch:
    return EventBatch(ts=time.time(), events=list(events))


def _hashes(n_blocks: int, salt=SALT_A, start: int = 0) -> list[bytes]:
    ids = list(range(start, start + n_blocks * BS))
    return prompt_block_hashes(ids, BS, salt)


# ---- the block index ----------------------------------------------------------------------


def test_index_depth_is_the_leading_run_of_held_hashes():
    h = _hashes(6)
    index = BlockIndex()
    index.apply("r1", _batch(_stored(h[:4])))
    index.apply("r2", _batch(_stored(h[:2])))
    index.apply("r3", _batch(_stored(h[1:6])))  # all but the first: matches nothing
    assert index.depths(h, ["r1", "r2", "r3", "r4"]) == {"r1": 4, "r2": 2, "r3": 0, "r4": 0}
    index.apply("r1", _batch(BlockRemoved(block_hashes=[h[2]])))
    assert index.depths(h, ["r1"]) == {"r1": 2}
    index.apply("r2", _batch(AllBlocksCleared()))
    assert index.depths(h, ["r2"]) == {"r2": 0} and index.num_blocks("r2") == 0
    index.forget("r1")
    index.forget("r3")
    assert len(index) == 0  # nothing left behind once every holder is gone


def test_salted_hashes_of_the_same_tokens_never_match():
    index = BlockIndex()
    index.add("r1", _hashes(4, SALT_A))
    assert index.depths(_hashes(4, SALT_B), ["r1"]) == {"r1": 0}
    assert index.depths(_hashes(4, SALT_A), ["r1"]) == {"r1": 4}


# ---- the directory ------------------------------------------------------------------------


async def test_directory_serves_events_after_a_cursor_and_snapshots_late_readers():
    d = ReplicaDirectory(max_log=3)
    h = _hashes(5)
    await d.publish("r1", [encode(_batch(_stored(h[:2])))], {"n": 1})
    first = await d.poll(-1, timeout_s=0.01)
    assert first.snapshot == {"r1": list(first.snapshot["r1"])} and set(first.snapshot["r1"]) == set(h[:2])
    await d.publish("r1", [encode(_batch(_stored(h[2:3])))], {"n": 2})
    news = await d.poll(first.cursor, timeout_s=0.01)
    assert news.snapshot is None and len(news.batches) == 1 and news.loads == {"r1": {"n": 2}}
    assert news.work == {"r1": (0, 2)}  # no stats in these reports: nothing queued, 2 reports
    await d.publish("r1", [], {"stats": {"num_tokens_to_compute": 40}})
    assert (await d.poll(news.cursor, timeout_s=0.01, with_loads=False)).work == {"r1": (40, 3)}
    # Four more batches overflow a log of 3: a reader at the old cursor gets a snapshot.
    for i in range(3, 5):
        await d.publish("r1", [encode(_batch(_stored(h[i:i + 1]))), encode(_batch())], {"n": i})
    late = await d.poll(news.cursor, timeout_s=0.01)
    assert late.snapshot is not None and set(late.snapshot["r1"]) == set(h)


async def test_directory_poll_waits_for_news_and_forgets_silent_replicas():
    clock = [1000.0]  # the directory's own clock, so a slow machine cannot make r1 stale early
    d = ReplicaDirectory(stale_after_s=0.2, clock=lambda: clock[0])
    await d.publish("r1", [encode(_batch(_stored(_hashes(1))))], {})
    cursor = (await d.poll(-1, timeout_s=0.01)).cursor
    waiter = asyncio.create_task(d.poll(cursor, timeout_s=60.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # a long poll: nothing new yet
    await d.publish("r2", [encode(_batch(_stored(_hashes(1, start=999))))], {})
    update = await asyncio.wait_for(waiter, 10.0)  # woken by the publish, not its own timeout
    assert [rid for rid, _ in update.batches] == ["r2"]
    clock[0] += 0.3
    await d.publish("r2", [], {})  # r1 said nothing for longer than stale_after_s
    assert set(await d.loads()) == {"r2"}
    gone = await d.poll(update.cursor, timeout_s=0.01)
    assert any(rid == "r1" for rid, _ in gone.batches)  # routers are told to drop r1's blocks


async def test_a_removed_adapter_has_holders_until_every_replica_reported_it_gone():
    d = ReplicaDirectory(clock=lambda: 0.0)  # a stalled machine must not make the replicas stale
    tune = ClusterAdapter("tune", "/adapters/tune", "d1")
    await d.publish("r1", [], {"loras": {"tune": "d1"}})
    await d.publish("r2", [], {"loras": {}})
    assert await d.set_adapter("tune", tune) == {"r1": 1, "r2": 1}
    assert await d.publish("r2", [], {}) == {"tune": tune}  # each replica reads the changes in the answer
    since = await d.set_adapter("tune", None)
    # r2 never held it, but its next report may have been made before it read the removal
    assert await d.lora_holders("tune", since, timeout_s=0.01) == ["r1", "r2"]
    await d.publish("r2", [], {})
    await d.publish("r1", [], {"loras": {"tune": "d1"}})  # still running a request on it
    assert await d.lora_holders("tune", since, timeout_s=0.01) == ["r1", "r2"]
    await d.publish("r2", [], {})
    waiter = asyncio.create_task(d.lora_holders("tune", since, timeout_s=60.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # waits for the next report
    await d.publish("r1", [], {"loras": {}})
    assert await asyncio.wait_for(waiter, 10.0) == []
    assert await d.adapters() == {"tune": None}


# ---- the router's ranking -----------------------------------------------------------------


@dataclass(frozen=True)
class _ID:
    unique_id: str


@dataclass(frozen=True)
class _Replica:
    replica_id: _ID


def _router(**kwargs) -> CachedBlockRouter:
    router = CachedBlockRouter.__new__(CachedBlockRouter)  # no Ray: only the routing state
    router.initialize_state(app_name="t", block_size=BS, **kwargs)
    return router


def _request(ids, salt=SALT_A) -> ReplicaRequest:
    return ReplicaRequest(list(ids), SamplingParams(), "r", None, "a", salt)


def test_router_prefers_the_deepest_chain_then_the_least_loaded():
    router = _router()
    reps = [_Replica(_ID(f"r{i}")) for i in range(3)]
    ids = list(range(5 * BS + 3))
    hashes = router.request_hashes(_request(ids))
    assert hashes == prompt_block_hashes(ids[: 5 * BS], BS, SALT_A)  # the engine's own hashes
    router._index.add("r2", hashes[:3])
    router._index.add("r1", hashes[:1])
    assert router.rank(reps, hashes, len(ids))[0] is reps[2]
    router._index.add("r0", hashes[:3])
    router._in_flight["r2"] = 2
    assert router.rank(reps, hashes, len(ids))[0] is reps[0]  # equal cost: the fewer in flight
    assert router.decisions["cached"] == 2


def _report(router, rid: str, tokens: int, number: int = 1) -> None:
    router.apply(DirectoryUpdate(cursor=0, work={rid: (tokens, number)}))


def test_router_weighs_queued_work_against_the_tokens_its_cache_saves():
    router = _router(cache_weight=2.0)
    reps = [_Replica(_ID("r0")), _Replica(_ID("r1"))]
    n = 10 * BS + 1
    hashes = router.request_hashes(_request(range(n)))
    router._index.add("r0", hashes)  # r0 computes 1 token, r1 all 161 (cost 2 x 161 = 322)
    _report(router, "r0", 300)
    _report(router, "r1", 0)
    assert router.rank(reps, hashes, n)[0] is reps[0]  # 2 + 300 < 322
    _report(router, "r0", 330, 2)
    assert router.rank(reps, hashes, n)[0] is reps[1]  # 2 + 330 > 322: the idle replica
    assert router.decisions == {"cached": 1, "balanced": 1}
    router._index.add("r1", hashes[:8])  # r1 now lacks 2 blocks and the last token: 2 x 33
    _report(router, "r1", 250, 2)
    assert router.rank(reps, hashes, n)[0] is reps[1]  # 66 + 250 < 332


def test_placements_since_the_last_report_count_as_queued():
    router = _router(cache_weight=1.0, report_lag_s=0.0)
    reps = [_Replica(_ID("r0")), _Replica(_ID("r1"))]
    _report(router, "r0", 0)
    _report(router, "r1", 100)
    big = _request(range(20 * BS + 1))  # nobody holds it: r0, the idle one, takes it
    assert router.rank(reps, router.request_hashes(big), 20 * BS + 1)[0] is reps[0]
    _routed(router, big, reps[0], "x")
    assert router.queued_tokens("r0") == 20 * BS + 1  # not in r0's report yet
    small = _request(range(1000, 1000 + 2 * BS + 1), salt=SALT_B)
    assert router.rank(reps, router.request_hashes(small), 2 * BS + 1)[0] is reps[1]
    _report(router, "r0", 7, 2)  # a newer report covers the placement
    assert router.queued_tokens("r0") == 7


def _routed(router, req: ReplicaRequest, replica, request_id: str) -> None:
    class _Pending:
        args = (req,)

        class metadata:
            internal_request_id = request_id

    router.on_request_routed(_Pending(), replica.replica_id, None)


def test_recent_placements_draw_a_burst_until_they_expire():
    router = _router(affinity_ttl_s=5.0)
    reps = [_Replica(_ID("r0")), _Replica(_ID("r1"))]
    req = _request(range(4 * BS + 1))

    _routed(router, req, reps[1], "x")
    router.on_request_completed(reps[1].replica_id, "x")
    hashes = router.request_hashes(req)
    assert all(router.rank(reps, hashes)[0] is reps[1] for _ in range(10))
    router._expire(time.monotonic() + 5.1)  # past the time to live
    assert router._recent.depths(hashes, ["r1"]) == {"r1": 0}


def test_router_prefers_a_replica_holding_the_adapter_after_cached_blocks():
    router = _router(affinity_ttl_s=5.0)
    reps = [_Replica(_ID(f"r{i}")) for i in range(3)]
    tune = ClusterAdapter("tune", "/adapters/tune", "d1")
    router.apply(DirectoryUpdate(cursor=0, loras={"r1": {"tune": "d1"}, "r2": {"tune": "d0"}}))
    router._in_flight.update({"r1": 2, "r2": 1})  # without the adapter criterion r0 (fewest in flight) wins
    req = _request(range(4 * BS + 1))
    req.lora = tune
    hashes = router.request_hashes(req)
    assert router.rank(reps, hashes, 4 * BS + 1, tune)[0] is reps[1]  # r2 holds other files under the name
    assert router.rank(reps, hashes, 4 * BS + 1)[0] is reps[0]  # a base-model request: fewest in flight
    router._index.add("r0", hashes[:1])  # cached blocks come first
    assert router.rank(reps, hashes, 4 * BS + 1, tune)[0] is reps[0]
    _routed(router, req, reps[0], "x")  # placed there: it loads the adapter, before it reports so
    assert router.holds("r0", tune) and not router.holds("r0", ClusterAdapter("tune", "/elsewhere", "d2"))
    router._expire(time.monotonic() + 5.1)
    assert not router.holds("r0", tune) and router.holds("r1", tune)


def test_router_forgets_replicas_that_left():
    router = _router()
    hashes = _hashes(2)
    router._index.add("gone", hashes)
    router._recent.add("gone", hashes)
    router._forget("gone")
    assert router._index.depths(hashes, ["gone"]) == {"gone": 0} and len(router._recent) == 0


# ---- figures ------------------------------------------------------------------------------


def test_merged_stats_sum_counters_and_average_usage():
    one = {"num_running": 1, "kv_cache_usage": 0.5, "block_size": 16, "tenants": {"a": {"weight": 2.0, "prompt_tokens": 10}}}
    two = {"num_running": 3, "kv_cache_usage": 0.1, "block_size": 16, "tenants": {"a": {"weight": 2.0, "prompt_tokens": 5}}}
    merged = merge_stats([one, two])
    assert merged["num_running"] == 4 and merged["num_replicas"] == 2 and merged["block_size"] == 16
    assert merged["kv_cache_usage"] == pytest.approx(0.3)
    assert merged["tenants"]["a"] == {"weight": 2.0, "prompt_tokens": 15}


def test_merged_spec_decode_counters_sum_by_position_and_recompute_the_mean():
    one = {"spec_decode_num_drafts": 2, "spec_decode_num_accepted_tokens": 3, "spec_decode_mean_accepted_length": 2.5,
           "spec_decode_num_accepted_tokens_per_pos": [2, 1]}
    two = {"spec_decode_num_drafts": 2, "spec_decode_num_accepted_tokens": 1, "spec_decode_mean_accepted_length": 1.5,
           "spec_decode_num_accepted_tokens_per_pos": [1]}
    merged = merge_stats([one, two])
    assert merged["spec_decode_num_accepted_tokens_per_pos"] == [3, 1]
    assert merged["spec_decode_mean_accepted_length"] == 2.0  # 1 + 4 accepted / 4 drafts, not 2.5 + 1.5
