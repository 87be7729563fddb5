"""Scheduler: token budget, chunked prefill, FCFS admission, max_num_seqs, preemption (recompute
and swap), prefix-cache hits at admission. The engine is simulated: after each step every
scheduled sequence advances `num_computed_tokens`, registers its full blocks, and appends a
fake token when it samples."""

from __future__ import annotations

import random

import pytest

from streamengine.kv.block_manager import BlockManager
from streamengine.sched.plan import SchedulerOutput
from streamengine.sched.preemption import PreemptionPolicy
from streamengine.sched.scheduler import Scheduler
from streamengine.sequence import Sequence, SequenceStatus

BS = 4


class Sim:
    """A scheduler, its block manager, and the engine's postprocessing without a model."""

    def __init__(
        self, num_blocks: int, *, budget: int = 64, max_num_seqs: int = 8, block_size: int = BS,
        prefix_caching: bool = True, policy: PreemptionPolicy | None = None,
        num_cpu_blocks: int = 0, chunk: int | None = None,
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, num_cpu_blocks=num_cpu_blocks)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, policy, max_prefill_chunk=chunk)
        self.max_tokens: dict[int, int] = {}
        self.finished: list[Sequence] = []
        self.next_id = 0
        self.clock = 0.0

    def add(self, prompt: list[int], max_tokens: int, salt: str | None = None, tenant: str = "default") -> Sequence:
        self.clock += 1.0
        seq = Sequence(self.next_id, f"r{self.next_id}", list(prompt), cache_salt=salt,
                       arrival_time=self.clock, tenant=tenant)
        self.next_id += 1
        self.max_tokens[seq.seq_id] = max_tokens
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self._advance(out)
        return out

    def _advance(self, out: SchedulerOutput) -> None:
        """What the engine does after the forward pass, with a fake token for each sample."""
        self.check_plan(out)
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.bm.cache_full_blocks(seq)
            if item.samples:
                seq.token_ids.append(1000 + seq.seq_id)
                if seq.num_output_tokens >= self.max_tokens[seq.seq_id]:
                    self.sched.remove(seq)
                    self.finished.append(seq)
        self.check_refcounts()

    def run(self, max_steps: int = 2000) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_work():
            assert len(outs) < max_steps, "no progress: a request starves or the loop spins"
            out = self.step()
            assert not out.is_empty, "an empty plan while work is pending"
            outs.append(out)
        return outs

    def check_plan(self, out: SchedulerOutput) -> None:
        sched = self.sched
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        ids = [item.seq.seq_id for item in out.scheduled]
        assert len(ids) == len(set(ids))
        for item in out.scheduled:
            seq = item.seq
            assert item.num_new_tokens > 0
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            end = seq.num_computed_tokens + item.num_new_tokens
            assert end <= seq.num_tokens
            assert item.samples == (end == seq.num_tokens)
            assert len(seq.block_table) == self.bm.blocks_needed(end)  # every slot allocated
        for seq in out.preempted:
            assert seq not in sched.running
            if seq.status is SequenceStatus.WAITING:
                assert seq.block_table == []

    def check_refcounts(self) -> None:
        counts = [self.bm.retention.pin_count(i) for i in range(self.bm.num_blocks)]
        for seq in [*self.sched.running, *self.sched.swapped]:  # a swapped one keeps its shared head
            for block_id in seq.block_table:
                counts[block_id] += 1
        for seq in self.sched.waiting:
            assert seq.block_table == []
        for seq in self.sched.swapped:
            assert all(self.bm.pool.blocks[b].ref_cnt >= 1 for b in seq.block_table)
            assert len(seq.block_table) + len(seq.cpu_block_table) == self.bm.blocks_needed(seq.num_computed_tokens)
        assert [b.ref_cnt for b in self.bm.pool.blocks] == counts
        assert self.bm.num_free_blocks == counts.count(0)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# -- budget and chunked prefill ------------------------------------------------------------


def test_chunked_prefill_of_a_long_prompt() -> None:
    sim = Sim(16, budget=4)
    seq = sim.add(tokens(10), max_tokens=3)
    plans = []
    for _ in range(5):
        out = sim.step()
        plans.append([(i.seq.seq_id, i.num_new_tokens, i.samples) for i in out.scheduled])
        if out.scheduled:
            assert out.scheduled[0].seq is seq
    assert plans == [[(0, 4, False)], [(0, 4, False)], [(0, 2, True)], [(0, 1, True)], [(0, 1, True)]]
    assert seq.is_finished and seq.num_output_tokens == 3
    assert sim.bm.num_free_blocks == 16


def test_chunks_grow_the_block_table_a_block_at_a_time() -> None:
    sim = Sim(16, budget=4, prefix_caching=False)
    seq = sim.add(tokens(10), max_tokens=5)
    tables = []
    for _ in range(3):
        sim.step()
        tables.append(list(seq.block_table))
    assert tables == [[0], [0, 1], [0, 1, 2]]
    assert seq.num_computed_tokens == 10 and seq.num_tokens == 11


def plan_of(out: SchedulerOutput) -> list[tuple[int, int, bool]]:
    return [(i.seq.seq_id, i.num_new_tokens, i.samples) for i in out.scheduled]


def test_max_prefill_chunk_keeps_a_decode_stream_stepping() -> None:
    """A long prompt arriving next to a decoding request takes at most `chunk` tokens a step,
    though the budget has room for all of it: the decode stream gets a token every step."""
    sim = Sim(32, budget=64, chunk=4)
    sim.add(tokens(3), max_tokens=6)
    assert plan_of(sim.step()) == [(0, 3, True)]
    sim.add(tokens(10, 50), max_tokens=2)
    plans = [plan_of(sim.step()) for _ in range(4)]
    assert plans == [
        [(0, 1, True), (1, 4, False)],
        [(0, 1, True), (1, 4, False)],
        [(0, 1, True), (1, 2, True)],
        [(0, 1, True), (1, 1, True)],
    ]
    sim.run()
    assert sim.bm.num_free_blocks == 32


def test_max_prefill_chunk_applies_to_every_admitted_prompt_and_to_recompute() -> None:
    sim = Sim(32, budget=64, chunk=4, prefix_caching=False)
    a = sim.add(tokens(10), max_tokens=3)
    sim.add(tokens(6, 50), max_tokens=1)
    assert plan_of(sim.step()) == [(0, 4, False), (1, 4, False)]
    assert plan_of(sim.step()) == [(0, 4, False), (1, 2, True)]
    assert plan_of(sim.step()) == [(0, 2, True)]
    sim.sched.running.remove(a)
    sim.sched._preempt(a)  # recompute preemption: all 11 tokens again, 4 at a time
    assert [plan_of(sim.step()) for _ in range(3)] == [[(0, 4, False)], [(0, 4, False)], [(0, 3, True)]]


def test_max_prefill_chunk_counts_from_a_prefix_cache_hit() -> None:
    sim = Sim(32, budget=64, chunk=4)
    sim.add(tokens(12), max_tokens=1)
    sim.run()
    b = sim.add(tokens(20), max_tokens=1)  # its first 3 blocks (12 tokens) are cached
    assert plan_of(sim.step()) == [(1, 4, False)] and b.num_computed_tokens == 12 + 4
    assert plan_of(sim.step()) == [(1, 4, True)]


def test_a_prompt_waits_for_a_shared_prefix_another_is_computing() -> None:
    """With chunked prefill a second request with the same system prompt would compute it
    again beside the first; it waits until the first has scheduled the shared blocks and then
    starts with all of them as hits. A request sharing nothing goes ahead meanwhile."""
    sim = Sim(32, budget=64, chunk=4)
    prefix = tokens(24)  # 6 blocks
    sim.add(prefix + tokens(3, 100), max_tokens=1)
    follower = sim.add(prefix + tokens(5, 200), max_tokens=1)
    sim.add(tokens(6, 300), max_tokens=8)
    plans = [plan_of(sim.step()) for _ in range(7)]
    assert plans == [
        [(0, 4, False), (2, 4, False)],
        [(0, 4, False), (2, 2, True)],
        [(0, 4, False), (2, 1, True)],
        [(0, 4, False), (2, 1, True)],
        [(0, 4, False), (2, 1, True)],
        [(0, 4, False), (2, 1, True), (1, 4, False)],  # the first scheduled the last shared block
        [(0, 3, True), (1, 1, True), (2, 1, True)],  # running in arrival order
    ]
    assert follower.num_cached_tokens == 24
    sim.run()
    assert sim.bm.num_free_blocks == 32


def test_token_budget_is_respected_and_used() -> None:
    sim = Sim(64, budget=6)
    seqs = [sim.add(tokens(n, 100 * i), max_tokens=3) for i, n in enumerate([5, 9, 2, 7, 4])]
    outs = sim.run()
    assert outs[0].num_batched_tokens == 6  # a full budget while prompts remain
    assert [i.num_new_tokens for i in outs[0].scheduled] == [5, 1]
    assert all(s.is_finished and s.num_output_tokens == 3 for s in seqs)
    assert sim.bm.num_free_blocks == 64


def test_running_sequences_are_scheduled_before_waiting_ones() -> None:
    sim = Sim(16, budget=5)
    a = sim.add(tokens(3), max_tokens=10)
    sim.step()  # a: prefill, samples
    b = sim.add(tokens(8, 50), max_tokens=1)
    out = sim.step()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 1), (b, 4)]
    out = sim.step()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 1), (b, 4)]
    assert out.scheduled[1].samples


def test_a_long_running_prefill_can_hold_back_admission() -> None:
    sim = Sim(16, budget=4)
    a = sim.add(tokens(12), max_tokens=1)
    sim.step()
    b = sim.add(tokens(2, 50), max_tokens=1)
    out = sim.step()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 4)]
    assert list(sim.sched.waiting) == [b]


def test_admission_is_fcfs() -> None:
    sim = Sim(32, budget=64)
    seqs = [sim.add(tokens(3, 10 * i), max_tokens=2) for i in range(4)]
    out = sim.step()
    assert [i.seq for i in out.scheduled] == seqs
    assert sim.sched.running == seqs
    assert [s.block_table for s in seqs] == [[0], [1], [2], [3]]


def test_head_of_line_blocks_smaller_requests_behind_it() -> None:
    sim = Sim(5, prefix_caching=False)
    a = sim.add(tokens(12), max_tokens=10)
    sim.step()  # a holds blocks 0-2
    b = sim.add(tokens(8, 50), max_tokens=1)  # needs 2 blocks
    c = sim.add(tokens(2, 80), max_tokens=1)  # needs 1 and would fit
    out = sim.step()  # a takes a 4th block for its 13th token: one free block left
    assert [i.seq for i in out.scheduled] == [a]
    assert list(sim.sched.waiting) == [b, c] and sim.bm.num_free_blocks == 1
    assert c.block_table == [] and c.status is SequenceStatus.WAITING


def test_max_num_seqs_caps_the_running_set() -> None:
    sim = Sim(32, max_num_seqs=2)
    seqs = [sim.add(tokens(2, 10 * i), max_tokens=2) for i in range(4)]
    out = sim.step()
    assert [i.seq for i in out.scheduled] == seqs[:2]
    assert list(sim.sched.waiting) == seqs[2:]
    sim.step()  # seqs 0 and 1 finish
    assert all(s.is_finished for s in seqs[:2])
    out = sim.step()
    assert [i.seq for i in out.scheduled] == seqs[2:]
    sim.run()
    assert all(s.is_finished and s.num_output_tokens == 2 for s in seqs)


# -- preemption by recompute ---------------------------------------------------------------


def first_scheduled(outs: list[SchedulerOutput], seq: Sequence) -> tuple[int, int]:
    """(step, position in the plan) of the first time `seq` runs."""
    for step, out in enumerate(outs):
        for pos, item in enumerate(out.scheduled):
            if item.seq is seq:
                return step, pos
    raise AssertionError("never scheduled")


def run_until_preemption(sim: Sim, max_steps: int = 50) -> SchedulerOutput:
    for _ in range(max_steps):
        out = sim.step()
        if out.preempted:
            return out
    raise AssertionError("no preemption happened")


def test_preemption_by_recompute_evicts_the_newest() -> None:
    sim = Sim(4, prefix_caching=False)
    a = sim.add(tokens(4), max_tokens=7)
    b = sim.add(tokens(4, 50), max_tokens=8)
    sim.step()
    sim.step()
    assert a.block_table == [0, 2] and b.block_table == [1, 3] and sim.bm.num_free_blocks == 0
    late = sim.add(tokens(2, 90), max_tokens=1)
    out = run_until_preemption(sim)
    # a reached 9 tokens and needed a third block: b (newest running) pays for it
    assert out.preempted == [b]
    assert [i.seq for i in out.scheduled] == [a]  # and no admission in a preempting step
    assert a.block_table == [0, 2, 1]  # b's blocks were freed tail first, to the front
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_tokens == 9
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert sim.sched.num_preemptions == 1
    assert list(sim.sched.waiting) == [b, late]  # ahead of a later arrival

    outs = sim.run()
    readmit = next(o for o in outs if any(i.seq is b for i in o.scheduled))
    item = next(i for i in readmit.scheduled if i.seq is b)
    assert (item.num_new_tokens, item.samples) == (9, True)  # recomputes its prompt + outputs
    assert b.output_token_ids[:5] == [1000 + b.seq_id] * 5
    assert all(s.is_finished for s in (a, b, late))
    assert a.num_output_tokens == 7 and b.num_output_tokens == 8
    assert first_scheduled(outs, b) <= first_scheduled(outs, late)
    assert sim.bm.num_free_blocks == 4


def test_the_sequence_that_needs_room_can_be_its_own_victim() -> None:
    sim = Sim(3, prefix_caching=False)
    a = sim.add(tokens(1), max_tokens=10)
    b = sim.add(tokens(7, 50), max_tokens=3)
    sim.step()
    assert a.block_table == [0] and b.block_table == [1, 2]
    sim.step()
    out = sim.step()  # b's 9th token needs a block; b is the newest, so b yields
    assert out.preempted == [b]
    assert [i.seq for i in out.scheduled] == [a]
    assert sim.sched.running == [a] and list(sim.sched.waiting) == [b]
    sim.run()
    assert a.num_output_tokens == 10 and b.num_output_tokens == 3
    assert b.num_preemptions == 1


def test_several_victims_keep_arrival_order_in_waiting() -> None:
    sim = Sim(4, prefix_caching=False)
    a = sim.add(tokens(3), max_tokens=12)  # 15 tokens: each fits the pool alone
    b = sim.add(tokens(3, 20), max_tokens=12)
    c = sim.add(tokens(3, 40), max_tokens=12)
    d = sim.add(tokens(3, 60), max_tokens=12)
    sim.step()
    assert sim.bm.num_free_blocks == 0
    out = run_until_preemption(sim)  # every 5th token needs a block: a takes d's, b takes c's
    assert out.preempted == [d, c]
    assert [i.seq for i in out.scheduled] == [a, b]
    assert list(sim.sched.waiting) == [c, d]
    assert sim.sched.num_preemptions == 2
    sim.run()
    assert all(s.num_output_tokens == 12 for s in (a, b, c, d))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_no_starvation_under_memory_pressure(prefix_caching: bool) -> None:
    rng = random.Random(1234)
    sim = Sim(12, budget=16, max_num_seqs=4, prefix_caching=prefix_caching)
    shared = [rng.randrange(3) for _ in range(12)]
    seqs = []
    for _ in range(24):
        prompt = shared[: rng.randint(1, 12)] + [rng.randrange(3) for _ in range(rng.randint(0, 8))]
        max_tokens = rng.randint(1, 48 - len(prompt) - 1)  # fits the pool alone
        seqs.append(sim.add(prompt, max_tokens))
    sim.run(max_steps=3000)
    assert sim.sched.num_preemptions > 0  # the pool was really under pressure
    for seq in seqs:
        assert seq.is_finished and seq.num_output_tokens == sim.max_tokens[seq.seq_id]
    assert sim.bm.num_free_blocks == 12
    if prefix_caching:
        assert sim.bm.stats.hits > 0


# -- prefix cache at admission -------------------------------------------------------------


def test_prefix_hit_at_admission_computes_only_the_rest() -> None:
    sim = Sim(16)
    prompt = tokens(10)
    a = sim.add(prompt, max_tokens=1)
    sim.step()
    assert a.is_finished
    b = sim.add(prompt, max_tokens=2)
    out = sim.sched.schedule()
    (item,) = out.scheduled
    assert item.seq is b and item.num_new_tokens == 2 and item.samples
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_table[:2] == [0, 1]  # a's prefix blocks, taken back from the free queue
    assert sim.bm.stats.queries == 20 and sim.bm.stats.hits == 8


def test_prefix_hit_on_a_running_sequence_shares_its_blocks() -> None:
    sim = Sim(16)
    a = sim.add(tokens(9), max_tokens=5)
    sim.step()
    b = sim.add(tokens(9), max_tokens=5)
    out = sim.step()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 1), (b, 1)]
    assert b.block_table[:2] == a.block_table[:2]
    assert [sim.bm.pool.blocks[i].ref_cnt for i in a.block_table[:2]] == [2, 2]
    sim.run()
    assert sim.bm.num_free_blocks == 16


def test_a_prompt_of_exactly_two_blocks_hits_one() -> None:
    sim = Sim(16)
    sim.add(tokens(8), max_tokens=1)
    sim.step()
    b = sim.add(tokens(8), max_tokens=1)
    out = sim.sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4 and b.num_cached_tokens == 4


def test_salted_requests_do_not_hit_each_other() -> None:
    sim = Sim(16)
    sim.add(tokens(9), max_tokens=1, salt="alice")
    sim.step()
    b = sim.add(tokens(9), max_tokens=1, salt="bob")
    out = sim.sched.schedule()
    assert out.scheduled[0].num_new_tokens == 9 and b.num_cached_tokens == 0
    assert sim.bm.stats.hits == 0


def test_prefix_stats_are_counted_once_per_admission() -> None:
    sim = Sim(4, prefix_caching=True)
    sim.add(tokens(12), max_tokens=2)
    sim.step()
    b = sim.add(tokens(9), max_tokens=1)  # hits a's first 2 blocks, but no room for a 3rd
    for _ in range(3):
        sim.sched.schedule()  # a would decode; b stays blocked at the head of the line
    assert list(sim.sched.waiting) == [b]
    assert sim.bm.stats.queries == 12 and sim.bm.stats.hits == 0
    sim.run()
    assert sim.bm.stats.queries == 12 + 9 and sim.bm.stats.hits == 8
    assert b.num_cached_tokens == 8


def test_readmission_after_preemption_does_not_recount_stats() -> None:
    sim = Sim(4)
    a = sim.add(tokens(4), max_tokens=6)
    b = sim.add(tokens(4, 50), max_tokens=8)
    sim.step()
    queries, hits = sim.bm.stats.queries, sim.bm.stats.hits
    assert (queries, hits) == (8, 0)
    run_until_preemption(sim)
    sim.run()
    assert b.num_preemptions == 1 and a.is_finished and b.is_finished
    assert (sim.bm.stats.queries, sim.bm.stats.hits) == (queries, hits)
    assert b.num_cached_tokens == 0


# -- remove / abort ------------------------------------------------------------------------


def test_remove_frees_running_and_waiting_sequences() -> None:
    sim = Sim(2, prefix_caching=False)
    a = sim.add(tokens(8), max_tokens=4)
    b = sim.add(tokens(4, 50), max_tokens=4)
    sim.step()
    assert sim.sched.running == [a] and list(sim.sched.waiting) == [b]
    sim.sched.remove(b)
    sim.sched.remove(a)
    assert a.status is b.status is SequenceStatus.FINISHED
    assert not sim.sched.has_work() and sim.bm.num_free_blocks == 2


def test_forked_sequences_run_and_copy_on_write() -> None:
    sim = Sim(8)
    parent = sim.add(tokens(6), max_tokens=3)
    sim.step()
    child = Sequence(99, "r0", tokens(6), token_ids=list(parent.token_ids[:6]),
                     arrival_time=parent.arrival_time)
    sim.bm.fork(parent, child)
    child.token_ids.append(7)
    sim.max_tokens[99] = 3
    sim.sched.add_running(child)
    assert sim.sched.running == [parent, child]
    out = sim.step()
    assert [i.seq for i in out.scheduled] == [parent, child]
    assert out.blocks_to_copy == [(1, 2)]  # the parent's write copied the shared partial block
    assert parent.block_table == [0, 2] and child.block_table == [0, 1]
    sim.run()
    assert sim.bm.num_free_blocks == 8


def _sibling(parent: Sequence, seq_id: int, next_token: int) -> Sequence:
    """Another sample of `parent`'s request whose prompt is all it has computed so far."""
    n = parent.num_prompt_tokens
    return Sequence(seq_id, parent.request_id, parent.prompt_token_ids, token_ids=[*parent.token_ids[:n], next_token],
                    arrival_time=parent.arrival_time, group_size=parent.group_size)


def test_a_recomputed_sample_starts_on_its_siblings_prompt_blocks() -> None:
    """Without prefix caching, a sample that recomputes (preempted, or forked without room)
    shares its running sibling's computed full blocks instead of computing them again."""
    sim = Sim(8, prefix_caching=False)
    parent = sim.add(tokens(9), max_tokens=4)
    parent.group_size = 2
    sim.step()  # the prompt, in blocks 0, 1, 2
    child = _sibling(parent, 99, 7)
    sim.max_tokens[99] = 4
    sim.sched.add_preempted(child)
    out = sim.step()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(parent, 1), (child, 2)]
    assert parent.block_table == [0, 1, 2] and child.block_table == [0, 1, 3]
    assert [sim.bm.pool.blocks[b].ref_cnt for b in range(4)] == [2, 2, 1, 1]
    sim.run()
    assert sim.bm.num_free_blocks == 8


def test_a_recomputing_sample_waits_for_its_siblings_prompt() -> None:
    sim = Sim(8, prefix_caching=False, chunk=4)
    parent = sim.add(tokens(9), max_tokens=4)
    parent.group_size = 2
    sim.step()  # 4 of its 9 prompt tokens
    child = _sibling(parent, 99, 7)
    sim.max_tokens[99] = 4
    sim.sched.add_preempted(child)
    for computed in (8, 9):  # it waits rather than compute the same prompt beside it
        assert [i.seq for i in sim.step().scheduled] == [parent] and parent.num_computed_tokens == computed
    assert [i.seq for i in sim.step().scheduled] == [parent, child] and child.block_table[:2] == [0, 1]


# -- preemption by swapping ----------------------------------------------------------------


def test_swap_preemption_keeps_computed_tokens_and_resumes_first() -> None:
    sim = Sim(4, prefix_caching=False, policy=PreemptionPolicy(mode="swap"), num_cpu_blocks=4)
    a = sim.add(tokens(4), max_tokens=7)
    b = sim.add(tokens(4, 50), max_tokens=8)
    sim.step()
    sim.step()
    late = sim.add(tokens(2, 90), max_tokens=1)
    out = run_until_preemption(sim)
    assert out.preempted == [b]
    assert out.blocks_to_swap_out == [(1, 0), (3, 1)]  # (device, host), host blocks lowest first
    assert b.status is SequenceStatus.SWAPPED and b.cpu_block_table == [0, 1]
    assert b.num_computed_tokens == 8 and sim.sched.swapped == [b]
    assert sim.sched.num_swap_outs == 1 and sim.bm.num_free_cpu_blocks == 2
    while True:  # a runs on alone; the late arrival waits behind the swapped b
        out = sim.step()
        if out.blocks_to_swap_in:
            break
        assert [i.seq for i in out.scheduled] == [a] and late.status is SequenceStatus.WAITING
    assert a.is_finished and sim.sched.swapped == [] and b.cpu_block_table == []
    assert out.blocks_to_swap_in == [(0, b.block_table[0]), (1, b.block_table[1])]
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled][0] == (b, 1)  # no recompute
    assert b.num_preemptions == 1 and sim.sched.num_preemptions == 1
    sim.run()
    assert a.num_output_tokens == 7 and b.num_output_tokens == 8
    assert sim.bm.num_free_blocks == 4 and sim.bm.num_free_cpu_blocks == 4


def test_swap_falls_back_to_recompute_when_the_host_pool_is_short() -> None:
    sim = Sim(4, prefix_caching=False, policy=PreemptionPolicy(mode="swap"), num_cpu_blocks=1)
    sim.add(tokens(4), max_tokens=6)
    b = sim.add(tokens(4, 50), max_tokens=8)
    out = run_until_preemption(sim)
    assert out.preempted == [b] and out.blocks_to_swap_out == []
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    sim.run()
    assert b.num_output_tokens == 8


def test_abort_while_swapped_returns_host_blocks() -> None:
    sim = Sim(4, prefix_caching=False, policy=PreemptionPolicy(mode="swap"), num_cpu_blocks=4)
    sim.add(tokens(4), max_tokens=6)
    b = sim.add(tokens(4, 50), max_tokens=8)
    run_until_preemption(sim)
    sim.sched.remove(b)
    assert b.cpu_block_table == [] and sim.bm.num_free_cpu_blocks == 4
    assert sim.sched.swapped == []
    sim.run()
    assert sim.bm.num_free_blocks == 4


def test_a_swapped_sequence_that_needs_the_whole_pool_comes_back() -> None:
    # 100 blocks of 2 tokens: watermark 1 block. b's 199 tokens (+1 output) fit the pool exactly.
    sim = Sim(100, block_size=2, budget=100, prefix_caching=False,
              policy=PreemptionPolicy(mode="swap"), num_cpu_blocks=100)
    a = sim.add(tokens(2), max_tokens=3)
    b = sim.add(tokens(199, 10), max_tokens=1)
    sim.step()  # a, plus b's first 98-token chunk
    sim.step()  # a's next token takes a block; b's chunk shrinks to the 98 tokens the rest holds
    assert b.num_computed_tokens == 196 and sim.bm.num_free_blocks == 0
    out = sim.step()  # b's last tokens do not fit: b is swapped out, a finishes
    assert out.preempted == [b] and b.status is SequenceStatus.SWAPPED and a.is_finished
    sim.run(max_steps=10)
    assert b.is_finished


def pin_prompt(sim: Sim, prompt: list[int]) -> list[int]:
    """Computes `prompt` and pins its full blocks, as EngineCore.pin_prefix does."""
    seq = sim.add(prompt, max_tokens=1)
    sim.run()
    ids = sim.bm.retention.cached_block_ids(sim.bm.compute_block_hashes(seq)[: len(prompt) // sim.bm.block_size])
    sim.bm.retention.pin_blocks(ids)
    return ids


def test_pinned_blocks_stay_shared_across_swap() -> None:
    """a and b open with a 2-block pinned prompt; each needs 8 blocks in all, 6 beside the pin
    (the pool leaves exactly 6). Swapped out, b keeps its references to the pinned blocks and
    copies out only its own; it comes back into 5 fresh blocks. Before the fix the pinned
    blocks went to the host too and b wanted 8 private blocks to come back: it never could,
    and the plan was empty once a finished."""
    sim = Sim(8, policy=PreemptionPolicy(mode="swap"), num_cpu_blocks=8)
    assert pin_prompt(sim, tokens(8)) == [0, 1]
    a = sim.add(tokens(8) + [50, 51], max_tokens=22)  # 32 tokens: 8 blocks
    b = sim.add(tokens(8) + [60, 61], max_tokens=22)
    out = run_until_preemption(sim)
    assert out.preempted == [b] and b.status is SequenceStatus.SWAPPED
    assert b.num_computed_tokens == 20 and b.block_table == [0, 1]  # the pinned blocks stay, held by b
    assert out.blocks_to_swap_out == [(3, 0), (5, 1), (7, 2)] and b.cpu_block_table == [0, 1, 2]
    assert [sim.bm.pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]  # the pin, a and b
    assert sim.sched.unfittable() == []
    outs = sim.run()
    assert [o.blocks_to_swap_in for o in outs if o.blocks_to_swap_in] == [[(0, 3), (1, 5), (2, 7)]]
    assert a.num_output_tokens == b.num_output_tokens == 22
    assert sim.bm.num_free_blocks == 6 and [sim.bm.pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    assert sim.bm.num_free_cpu_blocks == 8


def swapped_out(sim: Sim, seq: Sequence, fork_into: Sequence | None = None) -> None:
    """Computes all of waiting `seq`'s tokens (forking its blocks into `fork_into`, which
    then holds them too), samples one more token, and swaps `seq` out."""
    sim.sched.waiting.remove(seq)
    assert sim.bm.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    if fork_into is not None:
        sim.bm.fork(seq, fork_into)
    seq.token_ids.append(1000 + seq.seq_id)
    sim.sched._swap_out(seq, SchedulerOutput())


def test_a_swapped_head_kept_out_by_the_shared_blocks_of_a_later_one_takes_them_back() -> None:
    """Nothing runs; q (7 blocks) heads the swapped line, and s behind it holds 2 blocks on
    the device that it kept when swapped out (shared then with a sibling, since ended): 6
    are free, q cannot come back, and nothing will free a block. s recomputes instead (to
    the head of the waiting line), and q swaps in: the plan is not empty."""
    sim = Sim(8, policy=PreemptionPolicy(mode="swap"), num_cpu_blocks=16)
    q = sim.add(tokens(27), max_tokens=3)
    s = sim.add(tokens(8, 50), max_tokens=3)
    sibling = Sequence(99, s.request_id, tokens(8, 50), arrival_time=s.arrival_time)
    swapped_out(sim, q)
    swapped_out(sim, s, fork_into=sibling)
    assert q.cpu_block_table == [0, 1, 2, 3, 4, 5, 6] and s.block_table == [0, 1] and s.cpu_block_table == []
    sim.bm.free(sibling)
    assert sim.bm.num_free_blocks == 6 and sim.sched.swapped == [q, s] and not sim.sched.running
    out = sim.step()
    assert out.preempted == [] and [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(q, 1)]
    assert len(out.blocks_to_swap_in) == 7 and q.status is SequenceStatus.RUNNING
    assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0 and list(sim.sched.waiting) == [s]
    sim.run()
    assert q.num_output_tokens == s.num_output_tokens == 3 and sim.bm.num_free_blocks == 8


def test_idle_running_sequences_yield_blocks_to_a_waiting_one() -> None:
    """A running sequence with nothing to compute (a beam waiting for its sibling's logits)
    must not hold the pool while the sibling waits for blocks: it is preempted instead of
    the scheduler returning an empty plan with work pending."""
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    idle = Sequence(0, "r", tokens(12), arrival_time=0.0)
    sched.add(idle)
    plan = sched.schedule()
    assert [s.seq for s in plan.scheduled] == [idle]
    idle.num_computed_tokens = idle.num_tokens  # computed; now waits, holding 3 of 4 blocks
    sibling = Sequence(1, "r", tokens(12, 50), arrival_time=0.0)
    sched.add(sibling)
    plan = sched.schedule()
    assert plan.preempted == [idle]
    assert [s.seq for s in plan.scheduled] == [sibling]
    assert idle.status is SequenceStatus.WAITING and idle.num_computed_tokens == 0


@pytest.mark.parametrize("retain", [True, False])
def test_a_waiting_request_keeps_the_history_it_will_hit(retain: bool) -> None:
    """Two histories are cached, then a long request holds the only running slot and grows
    into the pool while a turn re-sending the older history waits. Retained, its blocks are
    evicted after the other history's; plain LRU evicts the older history first."""
    sim = Sim(10, max_num_seqs=1)
    sim.sched.retain_waiting_prefixes = retain
    history, other = tokens(12), tokens(12, 500)  # 3 full blocks each
    for prompt in (history, other):
        sim.add(prompt, max_tokens=1)
        sim.run()
    long = sim.add(tokens(16, 900), max_tokens=8)  # grows to 6 blocks: 4 free + 2 evicted
    sim.step()
    turn = sim.add(history + [7], max_tokens=1)
    sim.run()
    assert long.num_output_tokens == 8
    assert turn.num_cached_tokens == (12 if retain else 4)
