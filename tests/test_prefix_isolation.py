"""Tenancy at the block level: salt segments (a shared prefix hits across tenants, the private
blocks after it never do), pins (pinned blocks survive any pressure), tail-first eviction
within a chain, and per-block owners. Tiny pools, exact block ids; the stateful machine of
test_block_manager.py is rerun with pins taken and dropped at random."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_block_manager import BlockManagerMachine, free_ids, prefill, refs

from streamengine.kv.block_hash import hash_block
from streamengine.kv.block_manager import BlockManager
from streamengine.sequence import Sequence

BS = 4
SHARED = list(range(100, 108))  # a platform preamble: two full blocks


def seq_of(
    seq_id: int, tokens: list[int], segments: tuple = (), tenant: str = "default",
    salt: str | None = None,
) -> Sequence:
    return Sequence(
        seq_id, f"r{seq_id}", list(tokens), cache_salt=salt, arrival_time=float(seq_id),
        tenant=tenant, salt_segments=segments,
    )


def hit_ids(bm: BlockManager, seq: Sequence) -> list[int]:
    return [b.block_id for b in bm.find_cached_blocks(seq)]


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Admits `seq` with its prefix hits and computes it; returns the cached tokens found."""
    hits = bm.find_cached_blocks(seq)
    prefill(bm, seq, hits)
    return len(hits) * bm.block_size


def table_refs(bm: BlockManager, seqs: list[Sequence]) -> list[int]:
    """What the engine's audit counts: block-table entries plus pins."""
    counts = [bm.retention.pin_count(i) for i in range(bm.num_blocks)]
    for seq in seqs:
        for block_id in seq.block_table:
            counts[block_id] += 1
    return counts


# -- salt segments -----------------------------------------------------------------------


def test_shared_prefix_hits_across_tenants_private_blocks_never() -> None:
    bm = BlockManager(16, BS)
    private = list(range(8))  # the same private tokens for both: only the salt differs
    prompt = SHARED + private + [9]
    a = seq_of(0, prompt, ((0, None), (8, "salt-a")), tenant="a")
    assert admit(bm, a) == 0
    assert a.block_table == [0, 1, 2, 3, 4]
    b = seq_of(1, prompt, ((0, None), (8, "salt-b")), tenant="b")
    assert hit_ids(bm, b) == [0, 1]  # the preamble, not a's blocks 2 and 3
    assert admit(bm, b) == 8
    assert b.block_table == [0, 1, 5, 6, 7]
    assert b.block_hashes[:2] == a.block_hashes[:2] and b.block_hashes[2] != a.block_hashes[2]
    a2 = seq_of(2, prompt, ((0, None), (8, "salt-a")), tenant="a")
    assert hit_ids(bm, a2) == [0, 1, 2, 3]  # a's own next request hits its private blocks
    assert admit(bm, a2) == 16
    # the private blocks of both stay cached side by side, each reachable only with its salt
    bm.free(a)
    bm.free(a2)
    assert hit_ids(bm, seq_of(3, prompt, ((0, None), (8, "salt-b")))) == [0, 1, 5, 6]
    assert hit_ids(bm, seq_of(4, prompt, ((0, None), (8, "salt-c")))) == [0, 1]
    assert hit_ids(bm, seq_of(5, prompt, salt="salt-a")) == []  # the preamble salted: no hit


def test_a_block_straddling_the_end_of_a_shared_segment_is_private() -> None:
    bm = BlockManager(8, BS)
    prompt = SHARED[:6] + [1, 2, 3]  # the segment ends inside block 1 (tokens 4..7)
    a = seq_of(0, prompt, ((0, None), (6, "salt-a")), tenant="a")
    admit(bm, a)
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], prompt[4:8], "salt-a")
    b = seq_of(1, prompt, ((0, None), (6, "salt-b")), tenant="b")
    assert hit_ids(bm, b) == [0]
    assert admit(bm, b) == 4 and b.block_table == [0, 3, 4]


@pytest.mark.parametrize(
    "start, salts",
    [
        (7, [None, "s", "s"]),  # the segment starts at block 1's last token: block 1 is salted
        (8, [None, None, "s"]),  # at a block boundary
        (9, [None, None, "s"]),
        (12, [None, None, None]),  # after every full block
    ],
)
def test_each_block_takes_the_salt_of_its_last_token(start: int, salts: list) -> None:
    bm = BlockManager(4, BS)
    seq = seq_of(0, list(range(13)), ((0, None), (start, "s")))
    expected, parent = [], None
    for i, salt in enumerate(salts):
        parent = hash_block(parent, list(range(i * BS, (i + 1) * BS)), salt)
        expected.append(parent)
    assert bm.compute_block_hashes(seq) == expected


def test_blocks_before_the_first_segment_take_the_cache_salt() -> None:
    bm = BlockManager(4, BS)
    seq = seq_of(0, list(range(8)), ((4, None),), salt="x")
    h0 = hash_block(None, list(range(4)), "x")
    assert bm.compute_block_hashes(seq) == [h0, hash_block(h0, list(range(4, 8)), None)]
    plain = seq_of(1, list(range(8)), salt="x")  # no segments: today's behaviour
    h0 = hash_block(None, list(range(4)), "x")
    assert bm.compute_block_hashes(plain) == [h0, hash_block(h0, list(range(4, 8)), "x")]


def test_users_of_one_tenant_share_its_segment_not_each_other() -> None:
    bm = BlockManager(16, BS)
    system = list(range(50, 58))  # the bot's system prompt: two blocks, salted with the tenant
    turn = list(range(8))  # both users send the same message

    def user(seq_id: int, tenant: str, name: str, tokens: list[int]) -> Sequence:
        return seq_of(seq_id, tokens, ((0, tenant), (8, f"{tenant}/{name}")), tenant=tenant)

    u1 = user(0, "bot", "u1", system + turn + [1])
    assert admit(bm, u1) == 0 and u1.block_table == [0, 1, 2, 3, 4]
    u2 = user(1, "bot", "u2", system + turn + [1])
    assert hit_ids(bm, u2) == [0, 1]
    assert admit(bm, u2) == 8 and u2.block_table == [0, 1, 5, 6, 7]
    u1_next = user(2, "bot", "u1", system + turn + [1, 2, 3, 4, 5])  # u1's next turn
    assert hit_ids(bm, u1_next) == [0, 1, 2, 3]
    other = user(3, "other-bot", "u1", system + turn + [1])  # the same user salt elsewhere
    assert hit_ids(bm, other) == []


# -- pins ----------------------------------------------------------------------------------


def test_pinned_blocks_survive_any_pressure() -> None:
    bm = BlockManager(6, BS)
    prompt = list(range(9))
    a = seq_of(0, prompt)
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    hashes = [bm.pool.blocks[0].block_hash, bm.pool.blocks[1].block_hash]
    bm.retention.pin_blocks([0, 1])
    assert bm.retention.num_pinned_blocks == 2 and [bm.retention.pin_count(i) for i in range(6)] == [1, 1, 0, 0, 0, 0]
    assert refs(bm) == [2, 2, 1, 0, 0, 0] == table_refs(bm, [a])
    assert bm.pool.block_states() == [4, 4, 2, 0, 0, 0]
    bm.free(a)
    assert free_ids(bm) == [2, 3, 4, 5] and refs(bm)[:2] == [1, 1]
    for round_ in range(3):  # fill the pool with other content, free it, again
        filler = seq_of(10 + round_, [200 + round_] * 16)
        prefill(bm, filler)
        assert sorted(filler.block_table) == [2, 3, 4, 5] and bm.num_free_blocks == 0
        assert not bm.allocate_slots(seq_of(20, [7]), 1)
        bm.free(filler)
    bm.pool.reset_prefix_cache()  # a failed step forgets cached content, not pinned content
    assert [bm.pool.blocks[i].block_hash for i in (0, 1)] == hashes
    again = seq_of(1, prompt + [9])
    assert hit_ids(bm, again) == [0, 1]
    # a hit on pinned blocks takes no free block: a full pool still admits it
    filler = seq_of(30, [250] * 12)
    prefill(bm, filler)
    [last] = free_ids(bm)
    assert admit(bm, again) == 8 and again.block_table == [0, 1, last]
    assert refs(bm)[:2] == [2, 2] == table_refs(bm, [again, filler])[:2]


def test_unpin_makes_pinned_blocks_evictable_tail_first() -> None:
    bm = BlockManager(5, BS)
    prompt = list(range(13))
    a = seq_of(0, prompt)
    admit(bm, a)
    assert a.block_table == [0, 1, 2, 3]
    bm.retention.pin_blocks([0, 1, 2])
    bm.retention.pin_blocks([0, 1])  # a second pin on the first two
    bm.free(a)
    assert bm.pool.block_states() == [4, 4, 4, 0, 0]
    bm.retention.unpin_blocks([0, 1])
    assert bm.retention.num_pinned_blocks == 3 and bm.retention.pin_count(0) == 1 and bm.num_free_blocks == 2
    bm.retention.unpin_blocks([0, 1, 2])
    assert bm.retention.num_pinned_blocks == 0 and bm.pool.block_states() == [1, 1, 1, 0, 0]
    assert free_ids(bm) == [3, 4, 2, 1, 0]  # the tail block (2) is evicted first
    b = seq_of(1, [99] * 12)
    assert bm.allocate_slots(b, 12) and b.block_table == [3, 4, 2]
    assert hit_ids(bm, seq_of(2, prompt)) == [0, 1]  # the chain lost its tail only


def test_pin_and_unpin_are_all_or_nothing() -> None:
    bm = BlockManager(6, BS)
    a = seq_of(0, list(range(6)))
    admit(bm, a)  # block 0 full and cached, block 1 partial
    before = refs(bm)
    for bad in ([0, 1], [0, 2], [0, 6], [-1]):  # partial, free, no such block
        with pytest.raises(ValueError):
            bm.retention.pin_blocks(bad)
        assert refs(bm) == before and bm.retention.num_pinned_blocks == 0
    bm.retention.pin_blocks([0])
    with pytest.raises(ValueError):
        bm.retention.unpin_blocks([0, 0])  # one pin, two removals
    with pytest.raises(ValueError):
        bm.retention.unpin_blocks([1])
    assert bm.retention.pin_count(0) == 1 and refs(bm)[0] == 2
    bm.free(a)
    assert refs(bm)[0] == 1 and 0 not in free_ids(bm)


def test_a_free_cached_block_can_be_pinned() -> None:
    bm = BlockManager(4, BS)
    b = seq_of(1, [70] * 5)
    admit(bm, b)
    bm.free(b)
    assert free_ids(bm) == [1, 2, 3, 0]
    bm.retention.pin_blocks([0])  # a hit that holds on: out of the queue
    assert free_ids(bm) == [1, 2, 3] and refs(bm) == [1, 0, 0, 0]
    assert bm.pool.block_states() == [4, 0, 0, 0] and bm.pool.block_tenants() == [None] * 4
    filler = seq_of(2, [1] * 12)
    assert bm.allocate_slots(filler, 12) and not bm.allocate_slots(seq_of(3, [2]), 1)
    assert hit_ids(bm, seq_of(4, [70] * 5)) == [0]


def test_pin_what_is_cached_when_a_prefix_was_computed_twice() -> None:
    bm = BlockManager(6, BS)
    prompt = list(range(8))  # a whole number of blocks: a hit leaves the last to compute
    a = seq_of(0, prompt)
    admit(bm, a)
    b = seq_of(1, prompt)
    admit(bm, b)
    assert b.block_table == [0, 2] and bm.pool.blocks[2].block_hash is None
    with pytest.raises(ValueError):
        bm.retention.pin_blocks(b.block_table)
    assert bm.retention.cached_block_ids(b.block_hashes[:2]) == [0, 1]
    bm.retention.pin_blocks(bm.retention.cached_block_ids(b.block_hashes))
    bm.free(a)
    bm.free(b)
    filler = seq_of(2, [9] * 16)
    assert bm.allocate_slots(filler, 16) and sorted(filler.block_table) == [2, 3, 4, 5]
    assert hit_ids(bm, seq_of(3, prompt + [8])) == [0, 1]
    assert bm.retention.cached_block_ids([hash_block(None, [5] * 4, None)]) == []


# -- eviction order ------------------------------------------------------------------------


def cached_along(bm: BlockManager, seq: Sequence) -> list[bool]:
    """For each full block of `seq`, whether its hash is cached."""
    return [h in bm.pool.cached for h in bm.compute_block_hashes(seq)]


def evict_one(bm: BlockManager, seq_id: int) -> int:
    """Pressure: one more block for an unrelated sequence; returns which block it took."""
    taker = seq_of(seq_id, [300 + seq_id])
    assert bm.allocate_slots(taker, 1)
    return taker.block_table[0]


def test_eviction_takes_a_chain_tail_first() -> None:
    bm = BlockManager(4, BS)
    prompt = list(range(13))
    a = seq_of(0, prompt)
    admit(bm, a)
    bm.free(a)
    assert free_ids(bm) == [3, 2, 1, 0]
    probe = seq_of(1, prompt)
    assert evict_one(bm, 10) == 3  # the partial block first
    for seq_id, (block_id, hits) in enumerate([(2, [0, 1]), (1, [0]), (0, [])], start=11):
        assert evict_one(bm, seq_id) == block_id
        assert hit_ids(bm, probe) == hits


def test_a_duplicate_block_keeps_its_cached_twin_behind_the_twins_children() -> None:
    """b hits only a's first block (hits leave one token to compute), so it computes its own
    copy of a's block 1, uncached, then a block of its own, cached as block 1's child. Freeing
    a, then b, must still evict that child before block 1: else it is stranded, cached but
    unreachable, and block 1's eviction throws away the hit b's next turn needs."""
    bm = BlockManager(8, BS)
    prompt = list(range(8))
    a = seq_of(0, prompt)
    admit(bm, a)
    b = seq_of(1, prompt)
    assert admit(bm, b) == 4 and b.block_table == [0, 2]
    assert bm.pool.blocks[2].block_hash is None  # a duplicate of block 1
    b.token_ids.extend([8, 9, 10, 11])  # four decode steps fill a block of b's own
    assert bm.allocate_slots(b, 4) and b.block_table == [0, 2, 3]
    b.num_computed_tokens = 12
    bm.cache_full_blocks(b)
    assert cached_along(bm, b) == [True, True, True]
    bm.free(a)
    bm.free(b)
    order = free_ids(bm)
    assert order.index(3) < order.index(1) < order.index(0)
    probe = seq_of(2, list(range(12)) + [12])
    for seq_id in range(10, 18):
        evict_one(bm, seq_id)
        along = cached_along(bm, probe)
        assert along == sorted(along, reverse=True), along  # never a hole in the chain


# -- owners --------------------------------------------------------------------------------


def test_block_tenants() -> None:
    bm = BlockManager(8, BS)
    a = seq_of(0, SHARED + [1, 2], ((0, None), (8, "sa")), tenant="a")
    admit(bm, a)
    b = seq_of(1, SHARED + [3] * 5, ((0, None), (8, "sb")), tenant="b")
    admit(bm, b)
    assert b.block_table == [0, 1, 3, 4]
    assert bm.pool.block_tenants() == ["*", "*", "a", "b", "b", None, None, None]
    child = seq_of(2, SHARED + [3] * 5, ((0, None), (8, "sb")), tenant="b")
    bm.fork(b, child)
    child.token_ids.append(4)
    assert bm.allocate_slots(child, 1)  # copy-on-write of block 4 into block 5
    assert child.block_table == [0, 1, 3, 5]
    assert bm.pool.block_tenants() == ["*", "*", "a", "b", "b", "b", None, None]
    bm.free(a)
    assert bm.pool.block_tenants()[:3] == ["b", "b", None]
    bm.retention.pin_blocks([0, 1, 3])  # b's own prefix: the owner is the holder, "b"
    bm.retention.pin_blocks([0, 1], owner="*")  # a platform preamble: blocks 0 and 1 have two owners
    for s in (b, child):
        bm.free(s)
    assert bm.pool.block_tenants() == ["*", "*", None, "b", None, None, None, None]
    bm.retention.unpin_blocks([0, 1])
    assert bm.pool.block_tenants()[:4] == ["*", "*", None, "b"]  # still pinned by both
    bm.retention.unpin_blocks([0, 1, 3])
    assert bm.pool.block_tenants() == [None] * 8 and bm.retention.num_pinned_blocks == 0


# -- the stateful machine, with pins -------------------------------------------------------


class PinningMachine(BlockManagerMachine):
    """test_block_manager's machine plus pins: a pinned block keeps its id, hash and K/V
    whatever else happens, refcounts count pins, and a free cached block's free cached parent
    is always behind it in the queue (tail-first eviction)."""

    def __init__(self) -> None:
        super().__init__()
        self.pins: list[list[int]] = []
        self.pinned_kv: dict[int, tuple[bytes, list[object]]] = {}

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        computed = seq.block_hashes[: seq.num_computed_tokens // self.bm.block_size]
        chain = self.bm.retention.cached_block_ids(computed)  # may be free twins of seq's own blocks
        if not chain:
            return
        chain = chain[: data.draw(st.integers(1, len(chain)))]
        self.bm.retention.pin_blocks(chain)
        self.pins.append(chain)
        for block_id in chain:
            block = self.bm.pool.blocks[block_id]
            self.pinned_kv.setdefault(block_id, (block.block_hash, list(self.store[block_id])))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        chain = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.bm.retention.unpin_blocks(chain)
        for block_id in chain:
            if self.bm.retention.pin_count(block_id) == 0:
                del self.pinned_kv[block_id]

    @invariant()
    def refcounts_match_tables(self) -> None:
        if self.bm is None:
            return
        assert refs(self.bm) == table_refs(self.bm, self.live + self.swapped)  # swapped: their shared head
        assert self.bm.retention.num_pinned_blocks == len(self.pinned_kv)

    @invariant()
    def pinned_blocks_keep_hash_and_kv(self) -> None:
        if self.bm is None:
            return
        for block_id, (block_hash, kv) in self.pinned_kv.items():
            block = self.bm.pool.blocks[block_id]
            assert block.block_hash == block_hash and self.bm.pool.cached[block_hash] is block
            assert self.store[block_id] == kv and block.prev is None and block.ref_cnt > 0

    @invariant()
    def free_chains_are_evicted_tail_first(self) -> None:
        if self.bm is None:
            return
        bs = self.bm.block_size
        position = {block_id: i for i, block_id in enumerate(free_ids(self.bm))}
        for block_id in position:
            block = self.bm.pool.blocks[block_id]
            if block.block_hash is None:
                continue
            salt, prefix = self.store[block_id][-1]
            if len(prefix) == bs:
                continue  # a root block
            parent = self.bm.pool.cached.get(_chain_hash(prefix[:-bs], bs, salt))
            if parent is not None and parent.block_id in position:
                assert position[parent.block_id] > position[block_id], "parent evicted first"

    def teardown(self) -> None:
        if self.bm is not None:
            for chain in self.pins:
                self.bm.retention.unpin_blocks(chain)
            self.pins = []
        super().teardown()


def _chain_hash(tokens: tuple[int, ...], bs: int, salt: str | None) -> bytes:
    parent = None
    for i in range(0, len(tokens), bs):
        parent = hash_block(parent, list(tokens[i:i + bs]), salt)
    return parent


PinningMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pinning_state_machine = PinningMachine.TestCase
