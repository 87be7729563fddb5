"""Block manager: exact block ids, refcounts and eviction order on tiny pools, plus a
stateful property test that checks refcounts, the free queue, the prefix cache and the
(simulated) K/V contents after every operation."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from streamengine.kv.block_hash import hash_block
from streamengine.kv.block_manager import BlockManager
from streamengine.kv.free_blocks import FreeBlockQueue, KVBlock, NoFreeBlocksError
from streamengine.sequence import Sequence

BS = 4


def make_seq(seq_id: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), cache_salt=salt, arrival_time=float(seq_id))


def free_ids(bm: BlockManager) -> list[int]:
    return [b.block_id for b in bm.pool.free_blocks()]


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_cnt for b in bm.pool.blocks]


def prefill(bm: BlockManager, seq: Sequence, cached: list[KVBlock] = ()) -> None:
    """Allocates and 'computes' every remaining token of `seq`, then registers full blocks."""
    computed = len(cached) * bm.block_size if cached else seq.num_computed_tokens
    assert bm.allocate_slots(seq, seq.num_tokens - computed, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def append_token(bm: BlockManager, seq: Sequence, token: int) -> None:
    """One decode step: the sampled token is appended, then its slot is allocated and filled."""
    seq.token_ids.append(token)
    assert bm.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1
    bm.cache_full_blocks(seq)


# -- construction and allocation ---------------------------------------------------------


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_rejects_empty_pool(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_allocation_takes_blocks_in_free_queue_order() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(10)))
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert refs(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert free_ids(bm) == [3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 5
    assert bm.usage() == pytest.approx(3 / 8)
    b = make_seq(1, [1])
    assert bm.allocate_slots(b, 1)
    assert b.block_table == [3]


def test_allocate_grows_only_when_the_last_block_is_full() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(6)))
    assert bm.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    assert bm.allocate_slots(a, 2)  # fills block 1 to 8 tokens: no new block
    assert a.block_table == [0, 1]
    assert bm.allocate_slots(a, 3)  # 6 + 3 = 9 tokens: a third block
    assert a.block_table == [0, 1, 2]
    assert bm.allocate_slots(a, 0)
    assert a.block_table == [0, 1, 2]
    assert bm.blocks_needed(0) == 0 and bm.blocks_needed(4) == 1 and bm.blocks_needed(5) == 2


def test_allocate_returns_false_and_changes_nothing_when_short() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(0, list(range(12)))
    assert bm.allocate_slots(a, 12)
    b = make_seq(1, list(range(8)))
    before = (refs(bm), free_ids(bm), list(a.block_table))
    assert not bm.allocate_slots(b, 8)
    assert (refs(bm), free_ids(bm), list(a.block_table)) == before
    assert b.block_table == [] and b.num_computed_tokens == 0
    # exactly enough fits, but not when a reserve must stay free
    assert not bm.allocate_slots(b, 4, reserve=1)
    assert bm.num_free_blocks == 1 and b.block_table == []
    assert bm.allocate_slots(b, 4)
    assert b.block_table == [3] and bm.num_free_blocks == 0


# -- free and eviction order -------------------------------------------------------------


def test_free_puts_uncached_blocks_at_the_front() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(0, list(range(10)))
    b = make_seq(1, list(range(5)))
    assert bm.allocate_slots(a, 10) and bm.allocate_slots(b, 5)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    bm.free(a)
    # tail first, each to the front: the queue ends up head..tail, reused before 5, 6, 7
    assert free_ids(bm) == [0, 1, 2, 5, 6, 7]
    assert a.block_table == [] and refs(bm)[:3] == [0, 0, 0]
    c = make_seq(2, list(range(4)))
    assert bm.allocate_slots(c, 4)
    assert c.block_table == [0]


def test_free_puts_cached_blocks_at_the_back_tail_first() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(10)))  # two full (hashed) blocks + a partial one
    prefill(bm, a)
    assert a.block_table == [0, 1, 2] and a.num_cached_blocks == 2
    bm.free(a)
    # partial block 2 to the front; hashed blocks to the back, the tail block (1) first,
    # so the prefix block 0 is evicted last
    assert free_ids(bm) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.pool.block_states() == [1, 1, 0, 0, 0, 0, 0, 0]
    big = make_seq(1, [99] * 28)  # 7 blocks: everything uncached, then the LRU tail (1)
    assert bm.allocate_slots(big, 28)
    assert big.block_table == [2, 3, 4, 5, 6, 7, 1]
    assert free_ids(bm) == [0]
    assert bm.pool.blocks[0].block_hash is not None and bm.pool.blocks[1].block_hash is None


def test_free_of_a_shared_block_only_drops_a_reference() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(8)))
    prefill(bm, a)
    child = make_seq(1, list(range(8)))
    bm.fork(a, child)
    bm.free(a)
    assert refs(bm)[:2] == [1, 1]
    assert 0 not in free_ids(bm) and 1 not in free_ids(bm)
    bm.free(child)
    assert free_ids(bm)[-2:] == [1, 0] and bm.num_free_blocks == 8


def test_double_free_raises() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(0, list(range(5)))
    assert bm.allocate_slots(a, 5)
    alias = make_seq(1, list(range(5)))
    alias.block_table = list(a.block_table)  # a table entry without its reference
    bm.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(alias)
    stray = make_seq(2, [1])
    stray.block_table = [3]  # never allocated
    with pytest.raises(RuntimeError, match="double free of block 3"):
        bm.free(stray)


def test_freeing_a_sequence_twice_is_a_no_op() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(0, list(range(5)))
    assert bm.allocate_slots(a, 5)
    bm.free(a)
    bm.free(a)  # its table was emptied by the first free
    assert bm.num_free_blocks == 4 and refs(bm) == [0, 0, 0, 0]


# -- prefix cache --------------------------------------------------------------------------


def test_prefix_hit_shares_blocks() -> None:
    bm = BlockManager(8, BS)
    prompt = list(range(10))
    a = make_seq(0, prompt)
    prefill(bm, a)
    b = make_seq(1, prompt)
    hits = bm.find_cached_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert bm.allocate_slots(b, 2, hits)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8 and b.num_cached_blocks == 2
    assert refs(bm)[:4] == [2, 2, 1, 1]
    assert bm.pool.block_states()[:4] == [3, 3, 2, 2]


@pytest.mark.parametrize(
    "prompt_len, expected_hits", [(4, 0), (5, 1), (7, 1), (8, 1), (9, 2), (12, 2), (13, 3)]
)
def test_hit_is_capped_so_one_token_is_left(prompt_len: int, expected_hits: int) -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(16)))
    prefill(bm, a)
    b = make_seq(1, list(range(prompt_len)))
    hits = bm.find_cached_blocks(b)
    assert len(hits) == expected_hits == (prompt_len - 1) // BS
    assert [blk.block_id for blk in hits] == list(range(expected_hits))


def test_hit_stops_at_the_first_miss() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(16)))
    prefill(bm, a)
    b = make_seq(1, [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])  # block 1 differs
    assert [blk.block_id for blk in bm.find_cached_blocks(b)] == [0]


def test_cache_salt_separates_tenants() -> None:
    bm = BlockManager(8, BS)
    prompt = list(range(9))
    a = make_seq(0, prompt, salt="alice")
    prefill(bm, a)
    assert bm.find_cached_blocks(make_seq(1, prompt, salt="bob")) == []
    assert bm.find_cached_blocks(make_seq(2, prompt)) == []
    assert bm.find_cached_blocks(make_seq(3, prompt, salt="")) == []
    assert len(bm.find_cached_blocks(make_seq(4, prompt, salt="alice"))) == 2
    assert hash_block(None, [1, 2], "x") != hash_block(None, [1, 2], None)
    assert hash_block(None, [1, 2], "x") != hash_block(None, [1, 2], "y")


def test_hash_chain_depends_on_the_parent() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, [1, 1, 1, 1, 7, 7, 7, 7, 0])
    prefill(bm, a)
    b = make_seq(1, [2, 2, 2, 2, 7, 7, 7, 7, 0])  # same second block, other parent
    bm.compute_block_hashes(b)
    assert b.block_hashes[1] not in bm.pool.cached
    assert b.block_hashes[1] != a.block_hashes[1]
    assert bm.find_cached_blocks(b) == []
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], [7, 7, 7, 7], None)
    assert hash_block(b"p" * 16, [7], None) != hash_block(b"q" * 16, [7], None)
    assert hash_block(None, [1, 2], None) != hash_block(None, [2, 1], None)


def test_block_hashes_are_computed_lazily_for_full_blocks_only() -> None:
    bm = BlockManager(8, BS)
    s = make_seq(0, list(range(7)))
    assert len(bm.compute_block_hashes(s)) == 1
    s.token_ids.append(7)
    assert len(bm.compute_block_hashes(s)) == 2
    assert s.block_hashes[0] == hash_block(None, [0, 1, 2, 3], None)


_HASH_SCRIPT = """
import sys, types
pkg = types.ModuleType("streamengine")
pkg.__path__ = [sys.argv[1]]  # skip the package __init__ (it imports torch): only hashing here
sys.modules["streamengine"] = pkg
from streamengine.kv.block_hash import hash_block
root = hash_block(None, [1, 2, 3, 4], None)
print(root.hex(), hash_block(root, [5, 6, 7, 49151], "tenant").hex())
"""


def test_hashes_are_stable_across_processes() -> None:
    root = hash_block(None, [1, 2, 3, 4], None)
    expected = f"{root.hex()} {hash_block(root, [5, 6, 7, 49151], 'tenant').hex()}"
    pkg_dir = Path(__file__).resolve().parents[1] / "streamengine"
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", _HASH_SCRIPT, str(pkg_dir)],
            capture_output=True, text=True, env=env, timeout=60, check=True,
        )
        assert proc.stdout.strip() == expected
    assert len(root) == 16


def test_cache_full_blocks_registers_only_computed_full_blocks() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(10)))
    assert bm.allocate_slots(a, 10)
    a.num_computed_tokens = 7
    bm.cache_full_blocks(a)
    assert a.num_cached_blocks == 1 and list(bm.pool.cached.values()) == [bm.pool.blocks[0]]
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert a.num_cached_blocks == 2
    assert {h: b.block_id for h, b in bm.pool.cached.items()} == {
        a.block_hashes[0]: 0, a.block_hashes[1]: 1,
    }
    assert bm.pool.blocks[2].block_hash is None


def test_duplicate_content_keeps_the_first_block() -> None:
    bm = BlockManager(8, BS)
    prompt = list(range(8))
    a, b = make_seq(0, prompt), make_seq(1, prompt)
    # both admitted before either is cached: the same content computed twice
    assert bm.allocate_slots(a, 8) and bm.allocate_slots(b, 8)
    for s in (a, b):
        s.num_computed_tokens = 8
        bm.cache_full_blocks(s)
    assert sorted(b.block_id for b in bm.pool.cached.values()) == [0, 1]
    assert bm.pool.blocks[2].block_hash is None and bm.pool.blocks[3].block_hash is None
    bm.free(b)
    assert free_ids(bm)[:2] == [2, 3]  # unhashed duplicates are reused first


def test_lazy_eviction_keeps_hash_until_reallocated() -> None:
    bm = BlockManager(4, BS)
    prompt = list(range(9))
    a = make_seq(0, prompt)
    prefill(bm, a)
    bm.free(a)
    assert free_ids(bm) == [2, 3, 1, 0]
    assert bm.pool.block_states() == [1, 1, 0, 0]
    assert len(bm.pool.cached) == 2
    # a hit while free: the block leaves the middle of the queue
    b = make_seq(1, list(range(5)))
    hits = bm.find_cached_blocks(b)
    assert [blk.block_id for blk in hits] == [0]
    assert bm.allocate_slots(b, 1, hits)
    assert b.block_table == [0, 2] and free_ids(bm) == [3, 1]
    bm.free(b)
    assert free_ids(bm) == [2, 3, 1, 0]
    # reallocating the cached blocks evicts them: their dict entries are gone
    c = make_seq(2, [50] * 16)
    assert bm.allocate_slots(c, 16)
    assert c.block_table == [2, 3, 1, 0]
    assert bm.pool.cached == {} and all(blk.block_hash is None for blk in bm.pool.blocks)
    bm.free(c)
    assert bm.find_cached_blocks(make_seq(3, prompt)) == []


def test_hit_on_free_cached_blocks_counts_against_capacity() -> None:
    bm = BlockManager(4, BS)
    prompt = list(range(9))
    a = make_seq(0, prompt)
    prefill(bm, a)
    bm.free(a)
    filler = make_seq(1, [50])
    assert bm.allocate_slots(filler, 1)  # takes block 2: free = [3, 1(hash), 0(hash)]
    b = make_seq(2, prompt + list(range(9, 16)))
    hits = bm.find_cached_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    # 16 tokens = 4 blocks: 2 hits + 2 new, but only block 3 is free besides the hits
    before = (refs(bm), free_ids(bm), dict(bm.pool.cached))
    assert not bm.allocate_slots(b, 8, hits)
    assert (refs(bm), free_ids(bm), dict(bm.pool.cached)) == before
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.allocate_slots(b, 4, hits)
    assert b.block_table == [0, 1, 3] and bm.num_free_blocks == 0


def test_cached_hits_need_an_empty_table() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(9)))
    prefill(bm, a)
    b = make_seq(1, list(range(9)))
    hits = bm.find_cached_blocks(b)
    assert bm.allocate_slots(b, 1)
    with pytest.raises(ValueError):
        bm.allocate_slots(b, 1, hits)


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(0, list(range(9)))
    prefill(bm, a)
    assert bm.pool.cached == {} and a.num_cached_blocks == 0
    assert bm.find_cached_blocks(make_seq(1, list(range(9)))) == []


def test_reset_prefix_cache() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(9)))
    prefill(bm, a)
    b = make_seq(1, list(range(9)))
    prefill(bm, b, bm.find_cached_blocks(b))
    bm.free(a)
    bm.pool.reset_prefix_cache()
    assert bm.pool.cached == {} and all(blk.block_hash is None for blk in bm.pool.blocks)
    assert bm.find_cached_blocks(make_seq(2, list(range(9)))) == []
    assert b.block_table[:2] == [0, 1] and refs(bm)[:2] == [1, 1]  # data kept for b


# -- fork and copy-on-write --------------------------------------------------------------


def test_blocks_a_waiting_sequence_will_hit_are_evicted_last() -> None:
    bm = BlockManager(8, BS)
    a, b = make_seq(0, list(range(9))), make_seq(1, list(range(100, 109)))
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)
    assert free_ids(bm) == [5, 2, 6, 7, 1, 0, 4, 3]  # LRU: a's chain would go first
    waiting = make_seq(2, list(range(9)) + [7])  # re-sends a's history: hits blocks 0 and 1
    bm.retention.want(waiting)
    assert free_ids(bm) == [5, 2, 6, 7, 4, 3, 1, 0]  # a's chain behind, still tail first
    big = make_seq(3, [99] * 24)  # 6 blocks: b's chain is evicted, a's is kept
    assert bm.allocate_slots(big, 24)
    assert [blk.block_id for blk in bm.find_cached_blocks(waiting)] == [0, 1]
    bm.retention.unwant(waiting)
    bm.retention.unwant(waiting)  # idempotent
    assert free_ids(bm) == [1, 0] and bm.pool.wanted_queue.num_free == 0  # plain LRU again


def tenant_seq(seq_id: int, tenant: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), cache_salt=tenant, arrival_time=float(seq_id), tenant=tenant)


def hits(bm: BlockManager, seq: Sequence) -> int:
    return len(bm.find_cached_blocks(seq))


def test_wanted_blocks_go_in_the_order_the_waiting_line_is_served() -> None:
    """Three conversations' histories, each re-sent by a waiting request. The pool must give up
    3 of their 6 blocks: the request queued last loses its history first, then the next to
    last; the one at the head of the line keeps its own. (LRU would take the first waiter's:
    its blocks were wanted longest ago.) A preempted request put back at the head of the line
    keeps its blocks behind everyone's."""
    bm = BlockManager(9, BS)
    histories = [list(range(100 * i, 100 * i + 8)) for i in range(3)]
    for i, tokens in enumerate(histories):
        done = make_seq(i, tokens)
        prefill(bm, done)
        bm.free(done)
    first, second, last = (make_seq(10 + i, tokens + [1]) for i, tokens in enumerate(histories))
    for seq in (first, second, last):
        bm.retention.want(seq)
    assert bm.allocate_slots(make_seq(20, [7] * 24), 24)  # 3 empty blocks, then 3 evicted
    assert [hits(bm, seq) for seq in (first, second, last)] == [2, 1, 0]

    bm = BlockManager(9, BS)
    for i, tokens in enumerate(histories):
        done = make_seq(i, tokens)
        prefill(bm, done)
        bm.free(done)
    waiting, resumed = make_seq(10, histories[0] + [1]), make_seq(11, histories[1] + [1])
    bm.retention.want(waiting)
    bm.retention.want(resumed, first=True)
    assert bm.allocate_slots(make_seq(20, [7] * 28), 28)  # 3 empty, the unwanted 2, then 2 more
    assert [hits(bm, waiting), hits(bm, resumed)] == [0, 2]


def test_eviction_takes_from_the_tenant_holding_the_most_free_cache() -> None:
    """B's 2 blocks were freed before A's 6, so plain LRU would evict B's first; evicting
    from the largest holder takes A's tail down to B's level instead, and B keeps its own."""
    bm = BlockManager(12, BS)
    a, b = tenant_seq(0, "a", list(range(25))), tenant_seq(1, "b", list(range(100, 109)))
    prefill(bm, b)
    prefill(bm, a)
    bm.free(b)
    bm.free(a)
    assert bm.pool.free_queue.num_cached("a") == 6 and bm.pool.free_queue.num_cached("b") == 2
    # 8 blocks: the 4 holding nothing (2 never used, each sequence's last, partial one), then
    # A's 6 -> 2 tail first; plain LRU would have left A 4 and B none
    assert bm.allocate_slots(tenant_seq(2, "c", list(range(500, 532))), 32)
    assert hits(bm, tenant_seq(3, "a", list(range(25)))) == 2
    assert hits(bm, tenant_seq(4, "b", list(range(100, 109)))) == 2


def test_without_tenant_fair_eviction_one_lru_order_spans_tenants() -> None:
    """The same frees as above with tenant_fair_eviction off (the multi-tenant bench's
    baseline, vLLM's order): B's 2 blocks, freed first, go first, then A's tail."""
    bm = BlockManager(12, BS, tenant_fair_eviction=False)
    a, b = tenant_seq(0, "a", list(range(25))), tenant_seq(1, "b", list(range(100, 109)))
    prefill(bm, b)
    prefill(bm, a)
    bm.free(b)
    bm.free(a)
    assert bm.allocate_slots(tenant_seq(2, "c", list(range(500, 532))), 32)
    assert hits(bm, tenant_seq(3, "a", list(range(25)))) == 4
    assert hits(bm, tenant_seq(4, "b", list(range(100, 109)))) == 0


def test_a_tenants_weight_scales_its_claim_on_the_free_cache() -> None:
    """Weight 4 for A: its 6 free blocks count as 1.5 against B's 2, so B gives up one first."""
    bm = BlockManager(8, BS, weight_of=lambda tenant: 4.0 if tenant == "a" else 1.0)
    a, b = tenant_seq(0, "a", list(range(24))), tenant_seq(1, "b", list(range(100, 108)))
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.allocate_slots(tenant_seq(2, "c", list(range(500, 508))), 8)  # 2 blocks evicted
    assert hits(bm, tenant_seq(3, "a", list(range(24)) + [0])) == 5  # B (2) > A (1.5), then A (1.5) > B (1)
    assert hits(bm, tenant_seq(4, "b", list(range(100, 108)) + [0])) == 1


def test_a_tenants_wanted_blocks_count_toward_its_share_and_go_after_its_others() -> None:
    """A's free blocks: 4 a waiting request of A wants, 2 nobody does; B's 2 nobody wants.
    A holds the most (6), so A gives up blocks first, its unwanted ones before its wanted."""
    bm = BlockManager(10, BS)
    kept, spare = tenant_seq(0, "a", list(range(16))), tenant_seq(1, "a", list(range(200, 208)))
    b = tenant_seq(2, "b", list(range(100, 108)))
    for seq in (kept, spare, b):
        prefill(bm, seq)
    for seq in (b, kept, spare):
        bm.free(seq)
    waiting = tenant_seq(3, "a", list(range(16)) + [7])
    bm.retention.want(waiting)
    assert bm.pool.wanted_queue.num_cached("a") == 4 and bm.pool.free_queue.num_cached("a") == 2
    assert bm.allocate_slots(tenant_seq(4, "c", list(range(500, 516))), 16)  # 2 empty + 2 evicted
    assert hits(bm, tenant_seq(5, "a", list(range(200, 208)) + [0])) == 0  # A's unwanted went
    assert hits(bm, waiting) == 4
    assert hits(bm, tenant_seq(6, "b", list(range(100, 108)) + [0])) == 2
    assert bm.allocate_slots(tenant_seq(7, "c", list(range(600, 604))), 4)  # A (4) > B (2): A's tail
    assert hits(bm, waiting) == 3


def test_a_wanted_hash_cached_later_goes_to_the_wanted_queue() -> None:
    """A waiting sequence wants its whole prefix, also blocks a running one computes later."""
    bm = BlockManager(6, BS)
    waiting = make_seq(0, list(range(9)))
    bm.retention.want(waiting)
    running = make_seq(1, list(range(9)))
    prefill(bm, running)
    bm.free(running)
    assert bm.pool.wanted_queue.num_free == 2 and free_ids(bm)[-2:] == [1, 0]
    bm.pool.reset_prefix_cache()  # no content is kept for anyone: they are plain free blocks
    assert bm.pool.wanted_queue.num_free == 0 and sorted(free_ids(bm)) == list(range(6))


def test_fork_shares_all_blocks_and_copies_on_write() -> None:
    bm = BlockManager(8, BS)
    parent = make_seq(0, list(range(6)))  # one full block + a partial one
    prefill(bm, parent)
    child = make_seq(1, list(range(6)))
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and refs(bm)[:2] == [2, 2]
    assert child.num_computed_tokens == 6 and child.block_hashes == parent.block_hashes
    assert child.num_cached_blocks == parent.num_cached_blocks == 1
    assert bm.pool.block_states()[:3] == [3, 3, 0]

    append_token(bm, parent, 100)  # writes into the shared partial block: copy it first
    assert parent.block_table == [0, 2]
    assert child.block_table == [0, 1]
    assert bm.pending_copies == [(1, 2)]
    assert refs(bm)[:3] == [2, 1, 1]

    append_token(bm, child, 200)  # block 1 is the child's alone now: written in place
    assert child.block_table == [0, 1]
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.pending_copies == [] and bm.take_pending_copies() == []

    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8 and refs(bm) == [0] * 8


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    bm = BlockManager(8, BS)
    parent = make_seq(0, list(range(8)))
    prefill(bm, parent)
    child = make_seq(1, list(range(8)))
    bm.fork(parent, child)
    append_token(bm, parent, 1)
    append_token(bm, child, 2)
    assert parent.block_table == [0, 1, 2] and child.block_table == [0, 1, 3]
    assert bm.pending_copies == [] and refs(bm)[:4] == [2, 2, 1, 1]


def test_copy_on_write_with_several_children() -> None:
    bm = BlockManager(8, BS)
    parent = make_seq(0, [5, 5, 5])
    prefill(bm, parent)
    kids = [make_seq(i, [5, 5, 5]) for i in (1, 2)]
    for kid in kids:
        bm.fork(parent, kid)
    assert refs(bm)[0] == 3
    append_token(bm, kids[0], 1)
    append_token(bm, parent, 2)
    append_token(bm, kids[1], 3)  # the last holder writes in place
    assert kids[0].block_table == [1] and parent.block_table == [2]
    assert kids[1].block_table == [0]
    assert bm.take_pending_copies() == [(0, 1), (0, 2)]
    assert refs(bm)[:3] == [1, 1, 1]


def test_copy_on_write_needs_a_free_block() -> None:
    bm = BlockManager(2, BS)
    parent = make_seq(0, list(range(6)))
    prefill(bm, parent)  # both blocks
    child = make_seq(1, list(range(6)))
    bm.fork(parent, child)
    parent.token_ids.append(9)
    before = (refs(bm), list(parent.block_table), list(child.block_table))
    assert not bm.allocate_slots(parent, 1)  # fits in the block, but the copy needs one more
    assert (refs(bm), list(parent.block_table), list(child.block_table)) == before
    assert bm.pending_copies == []


def test_fork_into_a_non_empty_table_raises() -> None:
    bm = BlockManager(8, BS)
    parent, child = make_seq(0, [1, 2]), make_seq(1, [1, 2])
    prefill(bm, parent)
    assert bm.allocate_slots(child, 2)
    with pytest.raises(ValueError):
        bm.fork(parent, child)


def test_block_states_codes() -> None:
    bm = BlockManager(5, BS)
    a = make_seq(0, list(range(6)))
    prefill(bm, a)  # block 0 full (hashed), block 1 partial
    other = make_seq(1, list(range(6)))
    bm.fork(a, other)
    b = make_seq(2, list(range(10, 18)))
    prefill(bm, b)  # blocks 2, 3, both hashed
    bm.free(b)
    assert bm.pool.block_states() == [3, 3, 1, 1, 0]
    bm.free(other)
    assert bm.pool.block_states() == [2, 2, 1, 1, 0]


# -- swapping ------------------------------------------------------------------------------


def test_swap_out_and_in_move_blocks_between_pools() -> None:
    bm = BlockManager(6, BS, num_cpu_blocks=3)
    a = make_seq(0, list(range(6)))
    prefill(bm, a)  # blocks 0 (hashed), 1
    assert bm.can_swap_out(a)
    assert bm.swap_out(a) == [(0, 0), (1, 1)]  # (device, host): its own blocks all go
    assert a.block_table == [] and a.cpu_block_table == [0, 1] and a.num_computed_tokens == 6
    assert refs(bm) == [0] * 6 and bm.num_free_cpu_blocks == 1
    b = make_seq(1, list(range(50, 58)))
    prefill(bm, b)
    assert not bm.can_swap_out(b)  # 2 blocks, 1 host block left
    before = (list(b.block_table), bm.num_free_cpu_blocks)
    with pytest.raises(NoFreeBlocksError):
        bm.swap_out(b)
    assert (b.block_table, bm.num_free_cpu_blocks) == before
    assert bm.can_swap_in(a, reserve=2) and not bm.can_swap_in(a, reserve=3)  # 4 free
    mapping = bm.swap_in(a)  # fresh device blocks, host blocks returned
    assert [cpu for cpu, _ in mapping] == [0, 1] and a.block_table == [dev for _, dev in mapping]
    assert a.cpu_block_table == [] and a.num_cached_blocks == 0 and bm.num_free_cpu_blocks == 3
    for s in (a, b):
        bm.free(s)
    assert bm.num_free_blocks == 6


def test_swap_keeps_the_leading_shared_blocks_on_the_device() -> None:
    """A block another sequence holds too stays where it is, held by the swapped sequence:
    copying it out would free nothing, and it would come back as a private copy."""
    bm = BlockManager(8, BS, num_cpu_blocks=3)
    a = make_seq(0, list(range(6)))
    prefill(bm, a)  # blocks 0 (hashed), 1
    child = make_seq(1, list(range(6)))
    bm.fork(a, child)
    append_token(bm, child, 100)  # the child's write copies the shared partial block 1 into 2
    for token in (101, 102, 103):
        append_token(bm, a, token)  # a fills block 1, then takes block 3
    assert a.block_table == [0, 1, 3] and child.block_table == [0, 2]
    assert bm.num_kept_on_swap(a) == 1
    assert bm.swap_out(a) == [(1, 0), (3, 1)]
    assert a.block_table == [0] and a.cpu_block_table == [0, 1] and refs(bm)[:4] == [2, 0, 1, 0]
    twin = make_seq(2, list(range(6)) + [100])
    bm.fork(child, twin)
    assert bm.num_kept_on_swap(twin) == 2 and bm.swap_out(twin) == []  # all shared: nothing moves
    assert twin.block_table == [0, 2] and twin.cpu_block_table == [] and refs(bm)[:3] == [3, 0, 2]
    bm.free(child)
    bm.free(twin)
    assert refs(bm)[:4] == [1, 0, 0, 0]  # a alone holds block 0 now
    assert bm.can_swap_in(a, reserve=5) and not bm.can_swap_in(a, reserve=6)  # 7 free
    mapping = bm.swap_in(a)
    assert [cpu for cpu, _ in mapping] == [0, 1] and a.block_table == [0, *(dev for _, dev in mapping)]
    assert a.cpu_block_table == [] and bm.num_free_cpu_blocks == 3
    bm.free(a)
    assert bm.num_free_blocks == 8


def test_pinned_blocks_stay_on_the_device_across_swap() -> None:
    bm = BlockManager(6, BS, num_cpu_blocks=4)
    system = make_seq(0, list(range(8)))
    prefill(bm, system)
    bm.retention.pin_blocks([0, 1])
    bm.free(system)
    a = make_seq(1, list(range(8)) + [50, 51])
    prefill(bm, a, bm.find_cached_blocks(a))  # both pinned blocks hit, block 2 for the rest
    assert a.block_table == [0, 1, 2]
    assert bm.swap_out(a) == [(2, 0)]
    assert a.block_table == [0, 1] and refs(bm)[:3] == [2, 2, 0] and bm.num_free_blocks == 4
    bm.retention.unpin_blocks([0, 1])  # a still holds them: they stay
    assert refs(bm)[:3] == [1, 1, 0] and bm.num_free_blocks == 4
    mapping = bm.swap_in(a)
    assert [cpu for cpu, _ in mapping] == [0] and a.block_table == [0, 1, mapping[0][1]]
    bm.free(a)
    assert bm.num_free_blocks == 6


def test_free_of_a_swapped_sequence_returns_its_host_blocks() -> None:
    bm = BlockManager(4, BS, num_cpu_blocks=2)
    a = make_seq(0, list(range(5)))
    prefill(bm, a)
    bm.swap_out(a)
    assert bm.num_free_cpu_blocks == 0 and bm.num_free_blocks == 4
    bm.free(a)
    assert bm.num_free_cpu_blocks == 2 and a.cpu_block_table == []
    with pytest.raises(ValueError):
        BlockManager(4, BS, num_cpu_blocks=-1)


# -- the free queue ------------------------------------------------------------------------


def test_free_queue_operations() -> None:
    blocks = [KVBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4, 5] and q.num_free == 6
    q.remove(blocks[3])
    assert [b.block_id for b in q] == [0, 1, 2, 4, 5] and q.num_free == 5
    assert blocks[3].prev is None and blocks[3].next is None
    q.appendleft(blocks[3])
    q.remove(blocks[5])
    q.append(blocks[5])
    assert [b.block_id for b in q] == [3, 0, 1, 2, 4, 5]
    assert [q.popleft().block_id for _ in range(6)] == [3, 0, 1, 2, 4, 5]
    assert q.num_free == 0 and list(q) == []
    with pytest.raises(NoFreeBlocksError):
        q.popleft()


def _counted_link(name: str) -> property:
    """KVBlock's `name` slot, counting each read in the block's `reads`."""
    slot = getattr(KVBlock, name)

    def read(block: CountingBlock) -> KVBlock | None:
        block.reads[name] += 1
        return slot.__get__(block)

    return property(read, slot.__set__)


class CountingBlock(KVBlock):
    """A block that counts reads of its queue links in `reads`: a removal that walks the
    queue has to read them once per block it passes."""

    __slots__ = ("reads",)
    next = _counted_link("next")
    prev = _counted_link("prev")

    def __init__(self, block_id: int, reads: Counter[str]) -> None:
        self.reads = reads
        super().__init__(block_id)


def test_free_queue_removal_does_not_scan() -> None:
    reads: Counter[str] = Counter()
    blocks = [CountingBlock(i, reads) for i in range(10_000)]
    q = FreeBlockQueue(blocks)
    reads.clear()
    removed = range(1, 9_999, 2)
    for i in removed:
        q.remove(blocks[i])
    q.appendleft(blocks[1])
    q.append(blocks[3])
    assert q.num_free == 5_003
    # each operation reads a constant number of links, whatever the queue's length
    assert reads.total() <= 4 * (len(removed) + 2), reads
    ids = [b.block_id for b in q]
    assert ids[:3] == [1, 0, 2] and ids[-2:] == [9_999, 3] and len(ids) == 5_003


# -- stateful property test ----------------------------------------------------------------

VOCAB = st.integers(0, 1)  # tiny prompt vocabulary: prefixes repeat, so hits are common
SAMPLED = st.integers(0, 7)  # wider for sampled tokens: forks soon diverge


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, prefix hits, chunked growth, forks and frees on a tiny pool.

    Besides the refcount and queue invariants it simulates the K/V bytes: every slot stores
    (salt, prefix up to and including its token), which is what the real K/V depends on.
    Pending copies are applied before each write. Every computed position of every live
    sequence must then read back its own prefix: this catches a missing copy-on-write, a
    bad prefix hit, a hit across salts, or a block handed to two writers."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.live: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.waiting: list[Sequence] = []  # wanted their prefixes (BlockManager.want)
        self.store: dict[int, list[object]] = {}
        self.cpu_store: dict[int, list[object]] = {}
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(3, 10),
        block_size=st.sampled_from([1, 2, 2, 3, 4]),
        num_cpu_blocks=st.integers(0, 6),
    )
    def setup(self, num_blocks: int, block_size: int, num_cpu_blocks: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks)
        self.store = {i: [None] * block_size for i in range(num_blocks)}

    # -- helpers

    def _snapshot(self, seq: Sequence) -> tuple:
        bm = self.bm
        return (
            refs(bm), free_ids(bm), {h: b.block_id for h, b in bm.pool.cached.items()},
            [b.block_hash for b in bm.pool.blocks], list(bm.pending_copies),
            list(seq.block_table), seq.num_computed_tokens, seq.num_cached_blocks,
        )

    def _compute(self, seq: Sequence, n: int) -> None:
        """What the runner does: copy first, then write K/V for the next n positions."""
        for src, dst in self.bm.take_pending_copies():
            self.store[dst] = list(self.store[src])
        bs = self.bm.block_size
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block_id = seq.block_table[pos // bs]
            self.store[block_id][pos % bs] = (seq.cache_salt, tuple(seq.token_ids[: pos + 1]))
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)

    def _allocate(self, seq: Sequence, n: int, cached: list[KVBlock] = ()) -> bool:
        before = self._snapshot(seq)
        ok = self.bm.allocate_slots(seq, n, cached)
        if not ok:
            assert self._snapshot(seq) == before, "a failed allocation changed state"
        return ok

    # -- rules

    @rule(
        tokens=st.lists(VOCAB, min_size=1, max_size=12),
        salt=st.sampled_from([None, "a"]),
        use_cache=st.booleans(),
        chunk=st.integers(1, 12),
    )
    def admit(self, tokens: list[int], salt: str | None, use_cache: bool, chunk: int) -> None:
        seq = Sequence(self.next_id, f"r{self.next_id}", tokens, cache_salt=salt)
        self.next_id += 1
        cached = self.bm.find_cached_blocks(seq) if use_cache else []
        assert len(cached) <= (seq.num_tokens - 1) // self.bm.block_size
        assert len({b.block_id for b in cached}) == len(cached)
        n = min(chunk, seq.num_tokens - len(cached) * self.bm.block_size)
        if not self._allocate(seq, n, cached):
            return
        assert seq.num_computed_tokens == len(cached) * self.bm.block_size
        assert seq.block_table[: len(cached)] == [b.block_id for b in cached]
        self._compute(seq, n)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 6), token=SAMPLED)
    def grow(self, data: st.DataObject, chunk: int, token: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)  # the token sampled from the last step
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if self._allocate(seq, n):  # on failure the scheduler would preempt someone
            self._compute(seq, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.live))
        child = Sequence(
            self.next_id, f"r{self.next_id}", list(parent.prompt_token_ids),
            cache_salt=parent.cache_salt, token_ids=list(parent.token_ids),
        )
        self.next_id += 1
        self.bm.fork(parent, child)
        assert child.block_table == parent.block_table
        self.live.append(child)

    @rule(tokens=st.lists(VOCAB, min_size=1, max_size=12), salt=st.sampled_from([None, "a"]))
    def want(self, tokens: list[int], salt: str | None) -> None:
        seq = Sequence(self.next_id, f"r{self.next_id}", tokens, cache_salt=salt)
        self.next_id += 1
        self.bm.retention.want(seq)
        self.waiting.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def unwant(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(seq)
        self.bm.retention.unwant(seq)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.pool.reset_prefix_cache()

    @precondition(lambda self: self.live or self.swapped)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live + self.swapped))
        (self.live if seq in self.live else self.swapped).remove(seq)
        self.bm.free(seq)
        assert seq.block_table == [] and seq.cpu_block_table == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        if not self.bm.can_swap_out(seq):
            before = self._snapshot(seq)
            with pytest.raises(NoFreeBlocksError):
                self.bm.swap_out(seq)
            assert self._snapshot(seq) == before
            return
        table = list(seq.block_table)
        kept = self.bm.num_kept_on_swap(seq)
        assert all(self.bm.pool.blocks[b].ref_cnt > 1 for b in table[:kept])
        mapping = self.bm.swap_out(seq)
        assert [dev for dev, _ in mapping] == table[kept:]
        for dev, cpu in mapping:  # the runner copies before the device blocks are reused
            self.cpu_store[cpu] = list(self.store[dev])
        assert seq.block_table == table[:kept] and seq.cpu_block_table == [cpu for _, cpu in mapping]
        self.live.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.swapped))
        if not self.bm.can_swap_in(seq):
            return
        host, kept = list(seq.cpu_block_table), list(seq.block_table)
        mapping = self.bm.swap_in(seq)
        assert [cpu for cpu, _ in mapping] == host
        for cpu, dev in mapping:
            self.store[dev] = list(self.cpu_store[cpu])
        assert seq.block_table == kept + [dev for _, dev in mapping] and seq.cpu_block_table == []
        self.swapped.remove(seq)
        self.live.append(seq)

    # -- invariants

    @invariant()
    def refcounts_match_tables(self) -> None:
        if self.bm is None:
            return
        counts = [0] * self.bm.num_blocks
        for seq in self.live + self.swapped:  # a swapped one keeps its leading shared blocks
            assert len(set(seq.block_table)) == len(seq.block_table), "block twice in a table"
            assert len(seq.block_table) + len(seq.cpu_block_table) == self.bm.blocks_needed(seq.num_computed_tokens)
            for block_id in seq.block_table:
                counts[block_id] += 1
        assert refs(self.bm) == counts

    @invariant()
    def host_blocks_are_owned_once(self) -> None:
        if self.bm is None:
            return
        owned = [cpu for seq in self.swapped for cpu in seq.cpu_block_table]
        assert sorted(owned + self.bm.cpu_free) == list(range(self.bm.num_cpu_blocks))
        assert self.bm.num_free_cpu_blocks == len(self.bm.cpu_free)
        bs = self.bm.block_size
        for seq in self.swapped:  # its kept blocks on the device, then the host ones
            kept = len(seq.block_table)
            for pos in range(seq.num_computed_tokens):
                i = pos // bs
                block = self.store[seq.block_table[i]] if i < kept else self.cpu_store[seq.cpu_block_table[i - kept]]
                assert block[pos % bs] == (seq.cache_salt, tuple(seq.token_ids[: pos + 1]))
        for seq in self.live:
            assert seq.cpu_block_table == []

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self) -> None:
        if self.bm is None:
            return
        ids = free_ids(self.bm)
        assert len(ids) == len(set(ids)) == self.bm.num_free_blocks
        assert set(ids) == {b.block_id for b in self.bm.pool.blocks if b.ref_cnt == 0}
        # a free block waits in the second queue exactly when a waiting sequence wants its hash
        wanted = {h for seq in self.waiting for h in seq.block_hashes[: (seq.num_tokens - 1) // self.bm.block_size]}
        for block in self.bm.pool.free_blocks():
            assert (block.queue is self.bm.pool.wanted_queue) == (block.block_hash in wanted), block.block_id

    @invariant()
    def cache_dict_is_consistent(self) -> None:
        if self.bm is None:
            return
        for h, block in self.bm.pool.cached.items():
            assert block.block_hash == h
        hashed = [b for b in self.bm.pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.bm.pool.cached)
        for block in hashed:
            assert self.bm.pool.cached[block.block_hash] is block
            assert None not in self.store[block.block_id], "a cached block is not full"

    @invariant()
    def kv_reads_back_for_every_live_sequence(self) -> None:
        if self.bm is None:
            return
        bs = self.bm.block_size
        for seq in self.live:
            for pos in range(seq.num_computed_tokens):
                got = self.store[seq.block_table[pos // bs]][pos % bs]
                assert got == (seq.cache_salt, tuple(seq.token_ids[: pos + 1])), (seq, pos)

    @invariant()
    def cached_hashes_name_their_content(self) -> None:
        if self.bm is None:
            return
        for seq in self.live:
            for i, h in enumerate(seq.block_hashes[: seq.num_computed_tokens // self.bm.block_size]):
                block = self.bm.pool.cached.get(h)
                if block is not None:
                    last = self.store[block.block_id][-1]
                    assert last == (seq.cache_salt, tuple(seq.token_ids[: (i + 1) * self.bm.block_size]))

    def teardown(self) -> None:
        if self.bm is None:
            return
        for seq in self.live + self.swapped:
            self.bm.free(seq)
        for seq in self.waiting:
            self.bm.retention.unwant(seq)
        assert self.bm.pool.wanted_queue.num_free == 0  # nothing is wanted any more
        # no leak: every block is back, exactly once
        assert sorted(self.bm.cpu_free) == list(range(self.bm.num_cpu_blocks))
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert sorted(free_ids(self.bm)) == list(range(self.bm.num_blocks))
        assert refs(self.bm) == [0] * self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
