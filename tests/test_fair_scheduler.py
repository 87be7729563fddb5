"""Fair scheduling between tenants: the virtual token counter (weights, no banked credit),
quotas, preemption victims, cache-aware order inside a tenant and its pass-over bound, and
"fcfs" left as it was. The engine is simulated as in test_scheduler.py: after each step every
scheduled sequence advances, registers its full blocks and appends a fake token if it samples."""

from __future__ import annotations

import random

import pytest
from test_scheduler import Sim as BaseSim

from streamengine.kv.block_manager import BlockManager
from streamengine.sched.fair import over_block_share
from streamengine.sched.plan import SchedulerOutput
from streamengine.sched.scheduler import Scheduler
from streamengine.sequence import Sequence, SequenceStatus
from streamengine.tenancy.fair_share import (
    CACHE_AWARE_MIN_WAITING,
    FAIRNESS_SLACK,
    MAX_PASS_OVERS,
    MAX_YIELDS_PER_STEP,
    TENANT_PREFILL_CHUNKS,
    weighted_split,
)
from streamengine.tenancy.tenants import TenantConfig, Tenants

BS = 4


class Sim(BaseSim):
    """test_scheduler's simulation with tenants, recording first admissions in order."""

    def __init__(
        self, num_blocks: int, *, tenants: list[TenantConfig] = (), policy: str = "fair",
        budget: int = 64, max_num_seqs: int = 8, prefix_caching: bool = True, chunk: int | None = None,
    ) -> None:
        super().__init__(num_blocks, budget=budget, max_num_seqs=max_num_seqs, prefix_caching=prefix_caching,
                         chunk=chunk)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, max_prefill_chunk=chunk, policy=policy,
                               tenants=Tenants(tenants))
        self.admitted: list[Sequence] = []  # first admissions, in order

    def add(self, tenant: str, prompt: list[int], max_tokens: int) -> Sequence:  # type: ignore[override]
        return super().add(prompt, max_tokens, salt=tenant, tenant=tenant)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        seen = set(self.admitted)
        self.admitted += [i.seq for i in out.scheduled if i.seq not in seen and i.seq.num_preemptions == 0
                          and i.seq.num_computed_tokens == i.seq.num_cached_tokens]
        self._advance(out)
        return out

    def run(self, max_steps: int = 3000) -> None:
        super().run(max_steps)

    def stat(self, tenant: str, key: str) -> float:
        return self.sched.tenant_stats()[tenant][key]

    def running_of(self, tenant: str) -> list[Sequence]:
        return [s for s in self.sched.running if s.tenant == tenant]

    def blocks_of(self, tenant: str) -> int:
        return len({b for s in self.running_of(tenant) for b in s.block_table})


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def ids(seqs: list[Sequence]) -> list[int]:
    return [s.seq_id for s in seqs]


def keep_queued(sim: Sim, tenant: str, depth: int, steps: int) -> None:
    """Runs `steps` steps with `tenant` refilled to `depth` waiting requests (8-token prompts,
    2 tokens each) before every one: a tenant that stays backlogged throughout."""
    for _ in range(steps):
        while sum(1 for s in sim.sched.waiting if s.tenant == tenant) < depth:
            sim.add(tenant, tokens(8, 100 * sim.next_id), max_tokens=2)
        sim.step()


def service(sim: Sim, tenant: str) -> float:
    """Unweighted service: prompt tokens computed * 1 + generated tokens * 2 (the defaults)."""
    return sim.stat(tenant, "prompt_tokens") + 2 * sim.stat(tenant, "output_tokens")


# -- the virtual token counter -------------------------------------------------------------


def test_weights_one_to_two_get_service_one_to_two() -> None:
    """Both tenants always have requests waiting; B (weight 2) gets twice A's service. Bound:
    the weighted service of two backlogged tenants differs by at most 2 U (Sheng et al.),
    U the cost of one whole request (prompt 8 * 1 + 6 outputs * 2 = 20)."""
    sim = Sim(64, tenants=[TenantConfig("a", weight=1.0), TenantConfig("b", weight=2.0)], max_num_seqs=4)
    bound = 2 * (8 + 2 * 6)
    for step in range(400):
        for tenant in ("a", "b"):
            while sum(1 for s in sim.sched.waiting if s.tenant == tenant) < 3:
                sim.add(tenant, tokens(8, 100 * sim.next_id), max_tokens=6)
        sim.step()
        gap = service(sim, "a") / 1.0 - service(sim, "b") / 2.0
        assert abs(gap) <= bound, (step, gap)
        assert sim.stat("a", "virtual_time") == pytest.approx(service(sim, "a"))
        assert sim.stat("b", "virtual_time") == pytest.approx(service(sim, "b") / 2)
    assert service(sim, "a") > 20 * bound  # long enough for the bound to mean a ratio
    assert service(sim, "b") / service(sim, "a") == pytest.approx(2.0, abs=0.1)


def test_an_idle_tenant_banks_no_credit() -> None:
    """A is served alone for a while; B arrives with a backlog: B's counter starts at A's, so
    the two then alternate instead of B taking every admission until it catches up."""
    sim = Sim(64, tenants=[TenantConfig("a"), TenantConfig("b")], max_num_seqs=2)
    keep_queued(sim, "a", depth=4, steps=40)
    a_time = sim.stat("a", "virtual_time")
    assert a_time > 200 and sim.stat("b", "virtual_time") == 0
    b_seqs = [sim.add("b", tokens(8, 100 * sim.next_id), max_tokens=2) for _ in range(8)]
    assert sim.stat("b", "virtual_time") == a_time  # lifted to the least backlogged counter
    start = len(sim.admitted)
    keep_queued(sim, "a", depth=4, steps=12)
    order = [s.tenant for s in sim.admitted[start:]][:12]
    assert order.count("a") == order.count("b") == 6
    assert all(abs(order[:i].count("a") - order[:i].count("b")) <= 2 for i in range(len(order)))
    assert all(s in sim.admitted for s in b_seqs[:6])


def test_a_tenant_with_requests_running_but_none_waiting_banks_no_credit() -> None:
    """Q runs one long request and queues nothing (light demand) while A keeps a queue, so A
    gets far ahead. Then Q sends 8 requests: Q joins the line at A's counter and the two
    alternate, instead of Q keeping the credit of its light phase and taking every admission
    until A's lead is spent (what happened while only a tenant with no sequence at all was
    lifted: a bot with one conversation always running fell thousands of tokens behind)."""
    sim = Sim(256, tenants=[TenantConfig("a"), TenantConfig("q")], max_num_seqs=3)
    sim.add("q", tokens(2, 5000), max_tokens=200)
    keep_queued(sim, "a", depth=3, steps=30)
    q_time, a_time = sim.stat("q", "virtual_time"), sim.stat("a", "virtual_time")
    assert q_time + 100 < a_time and sim.stat("q", "num_running") == 1 and sim.stat("q", "num_waiting") == 0
    for _ in range(8):
        sim.add("q", tokens(8, 100 * sim.next_id), max_tokens=2)
    assert sim.stat("q", "virtual_time") == a_time  # lifted to the least counter waiting
    start = len(sim.admitted)
    keep_queued(sim, "a", depth=3, steps=16)
    order = [s.tenant for s in sim.admitted[start:]][:12]
    # Q's running request is charged each step too, so the turns are not strictly alternate.
    line = "".join(order)
    assert len(order) == 12 and order.count("a") >= 5 and "qqqq" not in line and "aaaa" not in line, line


def test_a_returning_tenant_starts_level_with_the_waiting_not_the_running() -> None:
    """Q runs one long request and has the least counter, but nothing waiting; A, far ahead,
    keeps a queue. C arrives: it starts at A's counter (the least among the tenants waiting)
    and competes level with A, instead of at Q's and taking every admission from A."""
    sim = Sim(256, tenants=[TenantConfig(t) for t in "aqc"], max_num_seqs=2)
    sim.add("q", tokens(2, 5000), max_tokens=200)
    keep_queued(sim, "a", depth=3, steps=30)
    q_time, a_time = sim.stat("q", "virtual_time"), sim.stat("a", "virtual_time")
    assert q_time < a_time and sim.stat("q", "num_running") == 1
    sim.add("c", tokens(8, 9000), max_tokens=1)
    assert sim.stat("c", "virtual_time") == a_time


def test_a_tenant_returning_to_an_empty_engine_starts_where_service_got_to() -> None:
    sim = Sim(64, tenants=[TenantConfig("a"), TenantConfig("b")])
    for _ in range(5):
        sim.add("a", tokens(8, 100 * sim.next_id), max_tokens=3)
    sim.run()
    a_time = sim.stat("a", "virtual_time")
    assert a_time == 5 * (8 + 2 * 3)
    sim.add("b", tokens(8, 900), max_tokens=1)  # nobody backlogged: B starts at A's counter
    assert sim.stat("b", "virtual_time") == a_time
    sim.run()
    b_time = sim.stat("b", "virtual_time")
    sim.add("a", tokens(8, 950), max_tokens=1)
    assert sim.stat("a", "virtual_time") == max(a_time, b_time)


def test_removing_a_waiting_sequence_makes_its_tenant_idle() -> None:
    sim = Sim(64, tenants=[TenantConfig("a"), TenantConfig("b")])
    b = sim.add("b", tokens(8, 500), max_tokens=1)
    sim.sched.remove(b)
    sim.sched.remove(b)  # idempotent
    for _ in range(3):
        sim.add("a", tokens(8, 100 * sim.next_id), max_tokens=2)
    sim.run()
    assert sim.stat("b", "virtual_time") == 0 and sim.stat("b", "num_waiting") == 0
    sim.add("a", tokens(8, 800), max_tokens=4)
    sim.step()
    sim.add("b", tokens(8, 900), max_tokens=1)  # idle: lifted to A's counter, not left at 0
    assert sim.stat("b", "virtual_time") == sim.stat("a", "virtual_time") > 0


def test_recompute_and_forks_are_not_charged_twice() -> None:
    sim = Sim(4, tenants=[TenantConfig("a")], prefix_caching=False)
    seqs = [sim.add("a", tokens(4, 50 * i), max_tokens=10) for i in range(3)]
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert sim.stat("a", "prompt_tokens") == 12  # the recomputed prompts were paid for once
    assert sim.stat("a", "output_tokens") == 30 == sum(s.num_output_tokens for s in seqs)

    sim = Sim(16, tenants=[TenantConfig("a")])
    parent = sim.add("a", tokens(6), max_tokens=3)
    sim.step()
    child = Sequence(99, "r0", tokens(6), token_ids=list(parent.token_ids[:6]),
                     arrival_time=parent.arrival_time, tenant="a")
    sim.bm.fork(parent, child)
    child.token_ids.append(7)
    sim.max_tokens[99] = 3
    sim.sched.add_running(child)
    sim.sched.running.remove(child)
    sim.sched._preempt(child)  # before its first step: it recomputes the prompt its parent paid for
    beam = Sequence(98, "r0", tokens(6), token_ids=list(parent.token_ids), arrival_time=parent.arrival_time,
                    tenant="a")
    sim.max_tokens[98] = 2
    sim.sched.add_preempted(beam)  # a beam whose parent was preempted: recomputes its tokens
    sim.run()
    assert sim.stat("a", "prompt_tokens") == 6
    # each sample's own new tokens; the child's first one came from the parent's sample
    assert sim.stat("a", "output_tokens") == 3 + 2 + 1
    assert sim.sched.share.usage["a"].num_seqs == 0


# -- quotas --------------------------------------------------------------------------------


def test_max_running_holds_and_does_not_hold_back_other_tenants() -> None:
    sim = Sim(64, tenants=[TenantConfig("a", max_running=2), TenantConfig("b")])
    a_seqs = [sim.add("a", tokens(4, 10 * i), max_tokens=3) for i in range(5)]
    b_seqs = [sim.add("b", tokens(4, 100 + 10 * i), max_tokens=3) for i in range(3)]
    out = sim.step()
    # equal counters go to the tenant whose request came first; A then stops at its limit
    assert [i.seq for i in out.scheduled] == [a_seqs[0], b_seqs[0], a_seqs[1], b_seqs[1], b_seqs[2]]
    while sim.sched.has_work():
        assert len(sim.running_of("a")) <= 2
        sim.step()
    assert all(s.is_finished for s in a_seqs + b_seqs)


def test_max_running_counts_a_wide_request_as_its_whole_group_before_it_forks() -> None:
    """Under max_running=4, a request of 3 samples runs one sequence until its prompt is
    computed, then forks the other two: it counts as 3 from the start, so a second such
    request waits. Before the fix it counted as 1, the second started beside it in the same
    step, and the tenant ran 6 sequences once both forked."""
    sim = Sim(64, tenants=[TenantConfig("a", max_running=4)])
    first = sim.add("a", tokens(8), max_tokens=4)
    second = sim.add("a", tokens(8, 50), max_tokens=4)
    first.group_size = second.group_size = 3
    out = sim.step()
    assert [i.seq for i in out.scheduled] == [first] and second.status is SequenceStatus.WAITING


def test_max_kv_fraction_holds_at_admission_and_while_growing() -> None:
    """A may hold 4 of 16 blocks: it admits what fits and, when its sequences grow, yields its
    own newest; B is never preempted for A's quota."""
    sim = Sim(16, tenants=[TenantConfig("a", max_kv_fraction=0.25), TenantConfig("b")], prefix_caching=False)
    a_seqs = [sim.add("a", tokens(8, 10 * i), max_tokens=8) for i in range(4)]  # 2 blocks each
    b_seqs = [sim.add("b", tokens(8, 100 + 10 * i), max_tokens=8) for i in range(2)]
    out = sim.step()
    assert [i.seq for i in out.scheduled] == [a_seqs[0], b_seqs[0], a_seqs[1], b_seqs[1]]
    preempted = []
    while sim.sched.has_work():
        out = sim.step()
        preempted += out.preempted
        assert len(sim.running_of("a")) <= 1 or sim.blocks_of("a") <= 4
    assert preempted and all(s.tenant == "a" for s in preempted)
    assert all(s.is_finished for s in a_seqs + b_seqs)


def test_a_quota_smaller_than_one_request_does_not_stop_its_tenant() -> None:
    sim = Sim(16, tenants=[TenantConfig("a", max_kv_fraction=0.1)])
    seqs = [sim.add("a", tokens(12, 20 * i), max_tokens=6) for i in range(2)]
    sim.run()
    assert all(s.is_finished for s in seqs)


def test_room_in_the_pool_is_kept_for_the_tenant_owed_the_most() -> None:
    """A's request does not fit beside B's running one; B's small one would, but waits: the
    blocks that free up go to A first (no large request starves behind small ones)."""
    sim = Sim(8, tenants=[TenantConfig("a"), TenantConfig("b")], prefix_caching=False)
    b0 = sim.add("b", tokens(16), max_tokens=8)
    sim.step()
    a0 = sim.add("a", tokens(20, 100), max_tokens=2)  # 5 blocks
    b1 = sim.add("b", tokens(2, 200), max_tokens=2)  # 1 block
    out = sim.step()
    assert [i.seq for i in out.scheduled] == [b0] and sim.bm.num_free_blocks == 3
    assert b1.status is SequenceStatus.WAITING
    sim.run()
    assert ids(sim.admitted) == ids([b0, a0, b1])


# -- preemption ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_the_victim_comes_from_the_tenant_furthest_over_its_share(policy: str) -> None:
    sim = Sim(6, tenants=[TenantConfig("a"), TenantConfig("b", weight=4.0)], policy=policy,
              prefix_caching=False)
    a0 = sim.add("a", tokens(4), max_tokens=10)
    a1 = sim.add("a", tokens(4, 20), max_tokens=10)
    b0 = sim.add("b", tokens(4, 40), max_tokens=10)
    for _ in range(20):
        out = sim.step()
        if out.preempted:
            break
    assert sim.stat("a", "virtual_time") > sim.stat("b", "virtual_time")
    # fair: A's newest yields, though B's sequence is newer, and B (least served) is scheduled
    # first; fcfs: the newest yields, whoever owns it, and the oldest go first
    assert out.preempted == ([a1] if policy == "fair" else [b0])
    assert [i.seq for i in out.scheduled] == ([b0, a0] if policy == "fair" else [a0, a1])
    sim.run()
    assert all(s.num_output_tokens == 10 for s in (a0, a1, b0))


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_tenant_holding_the_pool_gives_way_to_an_under_served_one(policy: str) -> None:
    """A's two requests fill the pool; B's request arrives and cannot fit. B starts level with
    A (no banked credit), but while it waits A keeps being served; under "fair", once A is
    FAIRNESS_SLACK ahead (its small weight makes each token count 100 times) A's newest
    sequence yields (recompute) and B runs before A's requests end. Under "fcfs" B waits."""
    sim = Sim(10, tenants=[TenantConfig("a", weight=0.01), TenantConfig("b")], policy=policy, prefix_caching=False)
    a = [sim.add("a", tokens(8, 100 * i), max_tokens=12) for i in range(2)]  # 5 blocks each at the end
    while sim.bm.num_free_blocks >= 4:
        sim.step()
    b0 = sim.add("b", tokens(14, 900), max_tokens=2)  # 4 blocks
    sim.run()
    assert all(s.num_output_tokens == 12 for s in a)  # the one that yielded resumed and completed
    if policy == "fair":
        assert a[1].num_preemptions == 1 and a[0].num_preemptions == 0
        assert sim.finished.index(b0) < sim.finished.index(a[1])
    else:
        assert a[0].num_preemptions == a[1].num_preemptions == 0
        assert sim.finished.index(b0) == 2


def test_a_quiet_tenants_lone_prompt_keeps_its_blocks_while_a_busy_tenant_yields() -> None:
    """Busy's three sequences decode and grow; quiet's one long prompt arrives and prefills in
    chunks. Quiet starts level with busy and is charged its chunks at once, so it is ahead in
    service, but busy holds the pool: when it runs out, busy's newest yields (victims are
    chosen among all running sequences before any is scheduled), never quiet's prompt."""
    sim = Sim(16, tenants=[TenantConfig("busy"), TenantConfig("quiet")], chunk=4, prefix_caching=False)
    busy = [sim.add("busy", tokens(4, 100 * k), max_tokens=36) for k in range(3)]  # 10 blocks each at the end
    for _ in range(8):
        sim.step()
    quiet = sim.add("quiet", tokens(40, 900), max_tokens=2)  # 10 blocks
    sim.step()
    assert sim.stat("quiet", "virtual_time") > sim.stat("busy", "virtual_time")  # ahead in service
    sim.run()
    assert quiet.num_preemptions == 0 and sum(s.num_preemptions for s in busy) >= 1
    assert all(s.num_output_tokens == 36 for s in busy) and quiet.num_output_tokens == 2


def test_a_running_prompts_chunk_shrinks_to_the_free_blocks_instead_of_preempting() -> None:
    """Under either policy (fcfs here: one chunk a step): the prompt's chunks stop fitting
    beside the decoding sequence's growth, and the prompt goes on with what the pool holds
    rather than preempting the decoding sequence or itself. Both complete, nobody preempted."""
    sim = Sim(14, tenants=[TenantConfig("a")], policy="fcfs", chunk=8, prefix_caching=False)
    decoding = sim.add("a", tokens(4), max_tokens=6)
    prompt = sim.add("a", tokens(48, 500), max_tokens=1)  # 12 blocks of the 14
    sizes = []
    while not prompt.is_finished:
        out = sim.step()
        sizes += [i.num_new_tokens for i in out.scheduled if i.seq is prompt]
    assert sizes == [8, 8, 8, 8, 8, 4, 4]
    sim.run()
    assert sim.sched.num_preemptions == 0
    assert decoding.num_output_tokens == 6 and prompt.num_output_tokens == 1


def test_nobody_yields_when_yielding_cannot_make_the_room() -> None:
    """Busy's sequences (MAX_YIELDS_PER_STEP + 2) run on a pinned prefix, each with one block
    of its own. Quiet's prompt needs MAX_YIELDS_PER_STEP + 5 blocks: 4 are free, and the
    yields a step allows would free MAX_YIELDS_PER_STEP more, one short. So nobody yields (a
    yield would be undone the next step, over and over), and quiet starts when busy's
    sequences end."""
    num_busy = MAX_YIELDS_PER_STEP + 2
    sim = Sim(6 + num_busy + 4, tenants=[TenantConfig("busy"), TenantConfig("quiet")], budget=256,
              max_num_seqs=num_busy + 2)
    first = sim.add("busy", tokens(24) + [7], max_tokens=1)
    sim.run()  # caches the 6 blocks of the shared prefix
    sim.bm.retention.pin_blocks(sim.bm.retention.cached_block_ids(first.block_hashes[:6]))
    busy = [sim.add("busy", tokens(24) + [50 + k], max_tokens=3) for k in range(num_busy)]
    sim.step()
    assert sim.bm.num_free_blocks == 4  # all but the pinned blocks and busy's last blocks
    quiet = sim.add("quiet", tokens(BS * (MAX_YIELDS_PER_STEP + 5), 900), max_tokens=1)
    sim.run()
    assert sim.sched.num_preemptions == 0
    assert sim.finished.index(quiet) == num_busy + 1 and all(s.num_output_tokens == 3 for s in busy)


def fill_pool(sim: Sim, tenant: str, n: int) -> list[Sequence]:
    """`n` requests of `tenant` (6 prompt tokens, 10 to generate), stepped until they hold
    every block of the pool."""
    seqs = [sim.add(tenant, tokens(6, 100 * i), max_tokens=10) for i in range(n)]
    for _ in range(100):
        if sim.bm.num_free_blocks == 0:
            return seqs
        sim.step()
    raise AssertionError(f"{n} requests of {tenant} never filled the pool")


def test_a_tenant_over_its_pool_share_gives_way_to_one_with_nothing_running() -> None:
    """A (within the slack) holds the whole pool with two requests; B, with nothing running,
    waits for it: A's newest yields at once, although A is not FAIRNESS_SLACK ahead."""
    sim = Sim(8, tenants=[TenantConfig("a"), TenantConfig("b")], prefix_caching=False)
    a = fill_pool(sim, "a", 2)
    assert sim.stat("a", "virtual_time") < FAIRNESS_SLACK
    b0 = sim.add("b", tokens(6, 900), max_tokens=2)
    out = sim.step()
    assert out.preempted == [a[1]] and b0 in [i.seq for i in out.scheduled]
    sim.run()
    assert a[0].num_preemptions == 0 and a[1].num_preemptions == 1
    assert all(s.num_output_tokens == 10 for s in a)


def wide_request(sim: Sim, tenant: str, prompt: list[int], n: int, max_tokens: int) -> list[Sequence]:
    """A request of `n` samples as the core runs it: sample 0 computes the prompt, then the
    others fork its blocks, each with a first token of its own."""
    first = sim.add(tenant, prompt, max_tokens)
    first.group_size = n
    while first.num_output_tokens == 0:
        sim.step()
    samples = [first]
    for i in range(1, n):
        child = Sequence(1000 + sim.next_id + i, first.request_id, list(prompt), arrival_time=first.arrival_time,
                         token_ids=list(prompt), group_size=n, tenant=tenant, cache_salt=first.cache_salt)
        sim.bm.fork(first, child)
        child.token_ids.append(7000 + i)
        sim.max_tokens[child.seq_id] = max_tokens
        sim.sched.add_running(child)
        samples.append(child)
    return samples


def test_a_wide_request_holding_every_slot_gives_way_to_a_tenant_with_nothing_running() -> None:
    """A's one request of 8 samples holds all 8 running slots and little of the pool; B's
    8-token request arrives: the next step A's newest sample yields its slot (recompute: its
    prompt stays cached) and B starts in that step. Before the fix samples never yielded and
    the rule ran only while a slot was free: B waited for all of A's samples to end."""
    sim = Sim(128, tenants=[TenantConfig("a"), TenantConfig("b")], max_num_seqs=8)
    a = wide_request(sim, "a", tokens(8), n=8, max_tokens=40)
    sim.step()
    assert len(sim.sched.running) == 8 and sim.bm.num_free_blocks >= 96
    b0 = sim.add("b", tokens(8, 900), max_tokens=2)
    out = sim.step()
    assert out.preempted == [a[-1]] and b0 in [i.seq for i in out.scheduled]
    assert a[-1].status is SequenceStatus.WAITING and len(sim.sched.running) == 8
    sim.run()
    assert b0.is_finished and all(s.num_output_tokens == 40 for s in a)
    assert a[-1].num_preemptions == 1 and sum(s.num_preemptions for s in a) == 1  # no thrash


def test_a_wide_request_far_ahead_in_service_gives_way_to_a_running_tenant() -> None:
    """B runs one long request and waits with a second; A's 8 samples hold the other slots.
    Once A is FAIRNESS_SLACK ahead of B (its 8 samples are charged 8 tokens a step, B's one
    stream 1), A's newest sample yields and B's second request starts, long before A's
    samples end. Before the fix a sample never owed anyone room."""
    sim = Sim(256, tenants=[TenantConfig("a"), TenantConfig("b")], max_num_seqs=9)
    b = sim.add("b", tokens(8, 500), max_tokens=300)
    a = wide_request(sim, "a", tokens(8), n=8, max_tokens=300)
    b1 = sim.add("b", tokens(8, 900), max_tokens=2)
    steps = 0
    while b1.status is SequenceStatus.WAITING:
        lead = sim.stat("a", "virtual_time") - sim.stat("b", "virtual_time")
        out = sim.step()
        steps += 1
        assert len(sim.sched.running) == 9 and steps < 200
    assert lead > FAIRNESS_SLACK and out.preempted == [a[-1]]
    assert all(not s.is_finished for s in a) and not b.is_finished
    sim.run()
    assert b1.is_finished and all(s.num_output_tokens == 300 for s in a)


def test_on_a_tie_the_tenant_with_nothing_running_is_made_room_for() -> None:
    """A fills the pool and also has a request waiting; B arrives and is lifted to A's counter
    (the least among the waiting). The tie goes to B, which runs nothing: A's newest yields
    and B starts in that very step, A's waiting one after."""
    sim = Sim(8, tenants=[TenantConfig("a"), TenantConfig("b")], prefix_caching=False)
    a = fill_pool(sim, "a", 2)
    a_waiting = sim.add("a", tokens(6, 300), max_tokens=2)
    b0 = sim.add("b", tokens(6, 900), max_tokens=2)
    assert sim.stat("b", "virtual_time") == sim.stat("a", "virtual_time")
    out = sim.step()
    assert out.preempted == [a[1]] and b0 in [i.seq for i in out.scheduled]
    assert a_waiting.status is SequenceStatus.WAITING
    sim.run()
    assert all(s.num_output_tokens == 10 for s in a)


def test_a_tenant_with_nothing_running_goes_before_a_less_served_running_one() -> None:
    """B was served more than C and is idle now; C runs a request and waits with another, with
    the least counter; A, served as much as B, fills the rest of the pool. B's new request is the
    one made room for (by A) and started: a returning tenant's first token does not wait behind
    tenants already running."""
    sim = Sim(12, tenants=[TenantConfig(t) for t in "abc"], prefix_caching=False)
    sim.add("b", tokens(8, 700), max_tokens=4)
    sim.run()
    c_run = sim.add("c", tokens(2, 500), max_tokens=12)
    _ = [sim.add("a", tokens(6, 100 * i), max_tokens=10) for i in range(2)]
    for _ in range(20):
        if sim.bm.num_free_blocks < 2:  # too few for B's next request
            break
        sim.step()
    c_wait = sim.add("c", tokens(6, 600), max_tokens=2)
    for tenant in "ab":  # as if B, and A holding the pool, had been served much more
        sim.sched.share.usage_of(tenant).virtual_time = 1000.0
    b1 = sim.add("b", tokens(6, 900), max_tokens=2)
    assert sim.stat("c", "virtual_time") < sim.stat("b", "virtual_time")
    assert c_run.status is SequenceStatus.RUNNING
    out = sim.step()
    assert b1 in [i.seq for i in out.scheduled]
    assert c_wait not in sim.admitted or sim.admitted.index(b1) < sim.admitted.index(c_wait)
    assert out.preempted and all(v.tenant == "a" for v in out.preempted)
    sim.run()


def test_a_running_tenant_made_room_for_starts_in_that_step() -> None:
    """B runs a request and waits with another; A (far ahead: weight 0.01) holds the rest of
    the pool with a decode and a long prompt that prefills a chunk a step. A's newest yields
    for B, and B's waiting request starts in that very step: the room is not left to ordinary
    admission, where A's prompt would take it first, step after step."""
    sim = Sim(12, tenants=[TenantConfig("a", weight=0.01), TenantConfig("b")], prefix_caching=False, chunk=2)
    b_run = sim.add("b", tokens(2, 500), max_tokens=10)  # 3 blocks at the end
    a_dec = sim.add("a", tokens(4, 100), max_tokens=12)  # 4 blocks
    sim.step()
    a_long = sim.add("a", tokens(36, 200), max_tokens=2)  # 10 blocks, prefilled 8 tokens a step
    while sim.bm.num_free_blocks > 1:
        sim.step()
    assert a_long.status is SequenceStatus.RUNNING and a_long.num_computed_tokens < 36
    b_wait = sim.add("b", tokens(6, 900), max_tokens=2)  # 2 blocks
    out = sim.step()
    assert out.preempted and out.preempted[0] is a_long
    assert b_wait in [i.seq for i in out.scheduled]
    assert b_run.status is SequenceStatus.RUNNING and a_dec.status is SequenceStatus.RUNNING
    sim.run()


def test_several_tenants_with_nothing_running_start_in_one_step() -> None:
    """A fills the pool with three requests; B and C arrive together with nothing running. In
    one step A's two newest yield, one for each, and both start: a burst of quiet tenants is
    not served one tenant a step while each step runs a full batch."""
    sim = Sim(12, tenants=[TenantConfig(t) for t in "abc"], prefix_caching=False)
    a = fill_pool(sim, "a", 3)
    b0 = sim.add("b", tokens(6, 900), max_tokens=2)
    c0 = sim.add("c", tokens(10, 950), max_tokens=2)  # 3 blocks: more than A's newest left after B
    out = sim.step()
    assert out.preempted == [a[2], a[1]]
    assert {b0, c0} <= {i.seq for i in out.scheduled}
    sim.run()
    assert all(s.num_output_tokens == 10 for s in a)


def test_a_tenant_whose_history_sits_free_in_the_cache_is_made_room_for() -> None:
    """B's first turn ended and its 3 blocks sit free in the cache; A's requests hold every
    other block. B's next turn re-sends that history: its 3 hits count among the free blocks
    but are no room for it (taking them empties the free queue), so it needs 5 free blocks,
    not 2. A's newest yields and B starts in that very step on its 3 hits. (Counted as room,
    the hits hid the shortage: B waited for A's requests to end while A's growth evicted its
    history.)"""
    sim = Sim(12, tenants=[TenantConfig("a"), TenantConfig("b")])
    b0 = sim.add("b", tokens(10, 900), max_tokens=3)
    sim.run()  # 12 of its 13 tokens computed: 3 full blocks cached, all free
    a = [sim.add("a", tokens(8, 100 * i), max_tokens=10) for i in range(3)]
    for _ in range(100):  # until fresh blocks are gone (they go first): B's 3 cached ones are left
        if sim.bm.num_free_blocks <= 3:
            break
        sim.step()
    b1 = sim.add("b", b0.token_ids + tokens(6, 950), max_tokens=2)  # 19 tokens: 5 blocks
    assert len(sim.bm.find_cached_blocks(b1)) == 3 == sim.bm.num_free_blocks
    out = sim.step()
    assert b1 in [i.seq for i in out.scheduled] and b1.num_cached_tokens == 3 * BS
    assert out.preempted and all(v.tenant == "a" for v in out.preempted)
    sim.run()
    assert all(s.num_output_tokens == 10 for s in a) and b1.num_output_tokens == 2


def test_a_request_started_for_one_tenant_never_yields_for_the_next_in_that_step() -> None:
    """B (weight 0.01) and C arrive together while A fills the pool. B starts first, and its
    prompt's charge puts it more than FAIRNESS_SLACK ahead of C at once; C's room then comes
    from A, never from the request B has just started (preempting it would leave the plan
    computing tokens of a sequence that holds no blocks)."""
    sim = Sim(12, tenants=[TenantConfig("a"), TenantConfig("b", weight=0.01), TenantConfig("c")],
              prefix_caching=False)
    a = fill_pool(sim, "a", 3)
    b0 = sim.add("b", tokens(12, 900), max_tokens=2)
    c0 = sim.add("c", tokens(6, 950), max_tokens=2)
    out = sim.step()  # the simulation checks the plan
    assert sim.stat("b", "virtual_time") > sim.stat("c", "virtual_time") + FAIRNESS_SLACK
    assert out.preempted == [a[2], a[1]]
    assert {b0, c0} <= {i.seq for i in out.scheduled}
    sim.run()


def test_a_tenant_owed_more_service_never_gives_way_to_one_served_more() -> None:
    """L (owed the most service) and N (served the most) both run two requests and are over
    their share of the pool, L holding more blocks; Q returns from idle, served between them.
    Q's room comes from N: L, less served than Q, does not yield to it, although L holds the
    most blocks (the victims were taken by blocks held alone, and the least-served tenant of a
    busy trace was preempted again and again for quiet ones served more)."""
    sim = Sim(12, tenants=[TenantConfig(t) for t in "lnq"], prefix_caching=False)
    low = [sim.add("l", tokens(10, 100 * i), max_tokens=20) for i in range(2)]
    busy = [sim.add("n", tokens(2, 500 + 100 * i), max_tokens=20) for i in range(2)]
    for _ in range(20):
        if sim.bm.num_free_blocks < 2:  # too few for Q's request
            break
        sim.step()
    q0 = sim.add("q", tokens(6, 900), max_tokens=2)
    for tenant, vt in (("l", 100.0), ("n", 5000.0), ("q", 2000.0)):
        sim.sched.share.usage_of(tenant).virtual_time = vt
    assert len(sim.running_of("l")) == len(sim.running_of("n")) == 2
    assert sim.blocks_of("l") > sim.blocks_of("n")
    out = sim.step()
    assert out.preempted and all(v.tenant == "n" for v in out.preempted)
    assert q0 in [i.seq for i in out.scheduled]
    sim.run()
    assert all(s.num_output_tokens == 20 for s in low + busy)


def test_room_given_this_step_goes_to_no_tenant_served_more_than_the_giver() -> None:
    """A fills the pool, far ahead of B; B and U return from idle, U served even more than A.
    A's newest yields for B, and the room left over stays free in that step: U, although idle
    and small enough to fit, does not start on room taken from a tenant it is ahead of."""
    sim = Sim(12, tenants=[TenantConfig(t) for t in "abu"], prefix_caching=False)
    a = fill_pool(sim, "a", 3)
    sim.sched.share.usage_of("a").virtual_time = 5000.0
    b0 = sim.add("b", tokens(2, 900), max_tokens=2)  # 1 block (2 with the next token)
    u0 = sim.add("u", tokens(2, 950), max_tokens=2)
    sim.sched.share.usage_of("u").virtual_time = 9000.0
    out = sim.step()
    assert out.preempted == [a[2]]
    scheduled = [i.seq for i in out.scheduled]
    assert b0 in scheduled and u0 not in scheduled
    assert sim.bm.num_free_blocks >= 1  # the room was there
    sim.run()
    assert all(s.num_output_tokens == 10 for s in a) and u0.num_output_tokens == 2


@pytest.mark.parametrize("seed", range(12))
def test_random_tenants_under_pressure_keep_every_plan_sound(seed: int) -> None:
    """Tenants of weights 100x apart arrive in bursts on a small pool with shared prefixes, so
    room is made for several in one step while others run, and one admission can put its
    tenant past FAIRNESS_SLACK at once: every plan keeps its invariants (the simulation checks
    each one: a sequence scheduled holds the blocks for its tokens, a preempted one holds none
    and is not running) and every request completes. (With a request just started allowed to
    yield for the next tenant, 8 of these 12 seeds break a plan.)"""
    rng = random.Random(seed)
    names = "abcde"
    sim = Sim(12, tenants=[TenantConfig(t, weight=rng.choice([0.01, 0.1, 1.0])) for t in names],
              prefix_caching=True, chunk=rng.choice([None, 2, 4]), max_num_seqs=rng.choice([3, 8]))
    prefixes = {t: tokens(8, 1000 * (i + 1)) for i, t in enumerate(names)}
    seqs = []
    for _ in range(40):
        for _ in range(rng.randint(0, 3)):
            t = rng.choice(names)
            prompt = prefixes[t][: rng.choice([0, 4, 8])] + tokens(rng.randint(1, 14), rng.randrange(100, 900))
            seqs.append(sim.add(t, prompt, max_tokens=rng.randint(1, 10)))
        if sim.sched.has_work():
            sim.step()
    sim.run()
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)


def test_tenants_within_the_slack_do_not_preempt_each_other() -> None:
    """B already runs a request, so the pool-share rule does not apply; A is within the slack
    of B: B's second request waits for room instead of preempting A."""
    sim = Sim(9, tenants=[TenantConfig("a"), TenantConfig("b")], prefix_caching=False)
    b_run = sim.add("b", tokens(2, 500), max_tokens=10)  # 3 blocks at the end, as A's
    a = [sim.add("a", tokens(6, 100 * i), max_tokens=6) for i in range(2)]
    while sim.bm.num_free_blocks >= 2:  # B's second request needs 2
        sim.step()
    assert b_run.status is SequenceStatus.RUNNING
    assert sim.stat("a", "virtual_time") < sim.stat("b", "virtual_time") + FAIRNESS_SLACK
    sim.add("b", tokens(6, 900), max_tokens=2)
    sim.run()
    assert a[0].num_preemptions == a[1].num_preemptions == 0


# -- cache-aware order inside a tenant -----------------------------------------------------


def warm_prefix(sim: Sim, tenant: str, prefix: list[int]) -> None:
    sim.add(tenant, prefix + [9999], max_tokens=1)
    sim.run()


def test_cache_aware_order_prefers_the_longest_cached_prefix() -> None:
    sim = Sim(64, tenants=[TenantConfig("a")], max_num_seqs=1)
    prefix = tokens(12, 500)  # 3 blocks
    warm_prefix(sim, "a", prefix)
    x = [sim.add("a", tokens(6, 10 * i), max_tokens=1) for i in range(3)]
    two = sim.add("a", prefix[:8] + [1, 2, 3], max_tokens=1)  # 2 cached blocks
    x.append(sim.add("a", tokens(6, 40), max_tokens=1))
    three = sim.add("a", prefix + [4, 5], max_tokens=1)  # 3 cached blocks
    assert len(sim.sched.waiting) == 6 > CACHE_AWARE_MIN_WAITING
    start = len(sim.admitted)
    sim.run()
    assert ids(sim.admitted[start:]) == ids([three, two, *x])
    assert three.num_cached_tokens == 12 and two.num_cached_tokens == 8


def test_a_short_queue_keeps_arrival_order() -> None:
    sim = Sim(64, tenants=[TenantConfig("a")], max_num_seqs=1)
    prefix = tokens(12, 500)
    warm_prefix(sim, "a", prefix)
    seqs = [sim.add("a", tokens(6, 10 * i), max_tokens=1) for i in range(CACHE_AWARE_MIN_WAITING - 1)]
    seqs.append(sim.add("a", prefix + [4, 5], max_tokens=1))
    start = len(sim.admitted)
    sim.run()
    assert ids(sim.admitted[start:]) == ids(seqs)


def test_nobody_is_passed_over_more_than_the_bound() -> None:
    """Requests hitting a cached prefix keep arriving behind one that hits nothing: it is
    passed over exactly MAX_PASS_OVERS times, then admitted next."""
    sim = Sim(256, tenants=[TenantConfig("a")], max_num_seqs=1)
    prefix = tokens(12, 500)
    warm_prefix(sim, "a", prefix)
    cold = sim.add("a", tokens(6, 0), max_tokens=1)
    for i in range(CACHE_AWARE_MIN_WAITING):
        sim.add("a", prefix + [i], max_tokens=1)
    start = len(sim.admitted)
    for i in range(MAX_PASS_OVERS + 1):
        sim.step()
        sim.add("a", prefix + [100 + i], max_tokens=1)  # the queue stays long
    order = sim.admitted[start:]
    assert order.index(cold) == MAX_PASS_OVERS
    assert all(s.num_cached_tokens == 12 for s in order[:MAX_PASS_OVERS])


def test_pass_over_bound_holds_on_a_random_workload() -> None:
    """Counted from outside: how many later requests of the same tenant started before each."""
    rng = random.Random(7)
    sim = Sim(96, tenants=[TenantConfig("a"), TenantConfig("b", weight=2.0)], max_num_seqs=2, budget=32)
    prefixes = {t: [tokens(4 * rng.randint(1, 4), 1000 * k + 100 * j) for j in range(3)]
                for k, t in enumerate(("a", "b"))}
    for _ in range(300):
        for _ in range(rng.randint(0, 2)):
            tenant = rng.choice("ab")
            prompt = rng.choice(prefixes[tenant]) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            sim.add(tenant, prompt, max_tokens=rng.randint(1, 4))
        sim.step()
    sim.run()
    rank = {s: i for i, s in enumerate(sim.admitted)}
    worst = 0
    for seq in sim.admitted:
        later = [o for o in sim.admitted if o.tenant == seq.tenant and o.arrival_time > seq.arrival_time]
        worst = max(worst, sum(1 for o in later if rank[o] < rank[seq]))
    assert 0 < worst <= MAX_PASS_OVERS
    assert sim.bm.stats.hits > 0


def test_a_prompt_still_waits_for_a_shared_prefix_in_flight() -> None:
    sim = Sim(32, tenants=[TenantConfig("a"), TenantConfig("b")], chunk=4)
    prefix = tokens(24)
    first = sim.add("a", prefix + tokens(3, 100), max_tokens=1)
    follower = sim.add("a", prefix + tokens(5, 200), max_tokens=1)
    other = sim.add("b", tokens(6, 300), max_tokens=1)
    out = sim.step()
    assert [i.seq for i in out.scheduled] == [first, other]
    while follower.status is SequenceStatus.WAITING:
        assert first.num_computed_tokens < len(prefix)  # its shared blocks are still in flight
        out = sim.step()
    # it started in the step after the first scheduled the last shared block, on hits
    assert follower in [i.seq for i in out.scheduled]
    assert follower.num_cached_tokens == 24


def test_a_tenants_prompts_in_flight_share_its_prefill_chunks() -> None:
    """A tenant with one prompt in flight (or waiting) prefills TENANT_PREFILL_CHUNKS chunks a step; one with
    many gets one chunk per prompt (never less), so a quiet tenant's cold prompt is not slowed
    by how many prompts a busy one sends. fcfs: one chunk per prompt for everyone."""
    for policy, lone in (("fair", TENANT_PREFILL_CHUNKS * 4), ("fcfs", 4)):
        sim = Sim(64, tenants=[TenantConfig("busy"), TenantConfig("quiet")], chunk=4, policy=policy,
                  prefix_caching=False)
        busy = [sim.add("busy", tokens(40, 100 * k), max_tokens=1) for k in range(1, 5)]
        quiet = sim.add("quiet", tokens(40, 900), max_tokens=1)
        sim.step()
        assert [s.num_computed_tokens for s in busy] == [4] * 4
        assert quiet.num_computed_tokens == lone


def test_a_busy_tenants_prompts_share_its_chunks_while_another_tenant_runs() -> None:
    """However many prompts a tenant has in flight, they compute TENANT_PREFILL_CHUNKS chunks a
    step in all while another tenant has a sequence in the step (here a decode), and only that
    many start: a burst of one tenant's turns cannot make every tenant's step long. Alone, each
    of its prompts takes a chunk."""
    chunk = 4
    for with_other in (False, True):
        sim = Sim(512, tenants=[TenantConfig("busy"), TenantConfig("quiet")], chunk=chunk, budget=256,
                  max_num_seqs=32, prefix_caching=False)
        if with_other:
            sim.add("quiet", tokens(2, 9000), max_tokens=50)
            sim.step()  # its prompt is done: it decodes from now on
        busy = [sim.add("busy", tokens(40, 100 * k), max_tokens=1) for k in range(1, 11)]
        for _ in range(3):
            before = sum(s.num_computed_tokens for s in busy)
            sim.step()
            computed = sum(s.num_computed_tokens for s in busy) - before
            assert computed == (TENANT_PREFILL_CHUNKS * chunk if with_other else 10 * chunk), with_other


def test_a_heavier_tenants_chunk_share_scales_with_its_weight_over_the_least_present() -> None:
    """The cap is TENANT_PREFILL_CHUNKS chunks times the tenant's weight over the least weight
    among the tenants in the step: weight 2 beside a tenant of weight 1 computes twice as many."""
    chunk = 4
    sim = Sim(512, tenants=[TenantConfig("busy", weight=2.0), TenantConfig("quiet")], chunk=chunk, budget=256,
              max_num_seqs=32, prefix_caching=False)
    sim.add("quiet", tokens(2, 9000), max_tokens=50)
    sim.step()
    busy = [sim.add("busy", tokens(40, 100 * k), max_tokens=1) for k in range(1, 11)]
    for _ in range(3):
        before = sum(s.num_computed_tokens for s in busy)
        sim.step()
        assert sum(s.num_computed_tokens for s in busy) - before == 2 * TENANT_PREFILL_CHUNKS * chunk


def test_weighted_split_fills_by_weight_and_passes_on_what_a_tenant_leaves() -> None:
    assert weighted_split(100, {"a": 10, "b": 1000, "c": 1000}, {"a": 1.0, "b": 1.0, "c": 2.0}) == \
        {"a": 10, "b": 30, "c": 60}
    assert weighted_split(100, {"a": 5, "b": 7}, {"a": 1.0, "b": 1.0}) == {"a": 5, "b": 7}
    rng = random.Random(5)
    for _ in range(300):
        names = [f"t{i}" for i in range(rng.randint(1, 5))]
        demands = {n: rng.choice([0, rng.randint(1, 50), rng.randint(1, 5000)]) for n in names}
        weights = {n: rng.choice([0.5, 1.0, 2.0, 3.0]) for n in names}
        budget = rng.randint(0, 3000)
        split = weighted_split(budget, demands, weights)
        assert sum(split.values()) == min(budget, sum(demands.values()))
        assert all(0 <= split[n] <= demands[n] for n in names)
        # Those left wanting got equal service per weight (within the rounding), and nobody
        # whose demand was met got more per weight than they did.
        wanting = [split[n] / weights[n] for n in names if split[n] < demands[n]]
        if wanting:
            assert max(wanting) - min(wanting) <= 1 / min(weights.values()) + 1e-9
            assert all(split[n] / weights[n] <= max(wanting) + 1e-9 for n in names)


def test_a_full_step_is_split_by_weight_between_tenants_prefilling() -> None:
    """When every prompt's chunk would not fit the step's budget, the tenants with prompts
    running split the step's prefill tokens by weight: the quiet tenant's lone prompt takes its
    slice instead of TENANT_PREFILL_CHUNKS chunks, the busy tenant's prompts one chunk each up
    to its slice. fcfs: one chunk each, in arrival order, so the quiet prompt still waits.
    (The budget is no more than the two tenants' chunk shares together, 16 + 16 tokens at equal
    weights, which cap each tenant's prompts while the other is in the step: the step is full
    whatever the split.)"""
    budget, chunk = 32, 4
    for policy, weight, lone in (("fair", 1.0, budget // 2), ("fair", 3.0, budget * 3 // 4), ("fcfs", 1.0, 0)):
        sim = Sim(512, tenants=[TenantConfig("busy"), TenantConfig("quiet", weight=weight)], chunk=chunk,
                  policy=policy, budget=budget, max_num_seqs=32, prefix_caching=False)
        busy = [sim.add("busy", tokens(40, 100 * k), max_tokens=1) for k in range(1, 21)]  # 80 tokens of chunks
        quiet = sim.add("quiet", tokens(80, 9000), max_tokens=1)
        first = sim.step()  # admits: the split applies to the prompts running
        assert quiet.num_computed_tokens == (TENANT_PREFILL_CHUNKS * chunk if policy == "fair" else 0)
        before = {s: s.num_computed_tokens for s in [*busy, quiet]}
        out = sim.step()
        assert first.num_batched_tokens == out.num_batched_tokens == budget
        assert quiet.num_computed_tokens - before[quiet] == lone, policy
        assert {s.num_computed_tokens - before[s] for s in busy} <= {0, chunk}
        assert sum(s.num_computed_tokens - before[s] for s in busy) == budget - lone


# -- fcfs and the policy switch ------------------------------------------------------------


def test_fcfs_admits_in_arrival_order_across_tenants_without_quotas() -> None:
    sim = Sim(64, tenants=[TenantConfig("a", max_running=1), TenantConfig("b", weight=8.0)], policy="fcfs")
    seqs = [sim.add(t, tokens(4, 10 * i), max_tokens=2) for i, t in enumerate("aabab")]
    out = sim.step()
    assert [i.seq for i in out.scheduled] == seqs
    sim.run()
    assert sim.stat("a", "prompt_tokens") == 12 and sim.stat("b", "output_tokens") == 4


def test_fair_with_one_tenant_and_a_short_queue_plans_exactly_as_fcfs() -> None:
    def plans(policy: str) -> list[list[tuple[int, int]]]:
        rng = random.Random(3)
        sim = Sim(10, tenants=[TenantConfig("a")], policy=policy, budget=16, max_num_seqs=4)
        result = []
        for _ in range(400):
            if len(sim.sched.waiting) <= CACHE_AWARE_MIN_WAITING - 2 and rng.random() < 0.5:
                sim.add("a", [rng.randrange(3) for _ in range(rng.randint(1, 14))], rng.randint(1, 20))
            out = sim.step()
            result.append([(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] + [(-1, s.seq_id) for s in out.preempted])
        return result

    fair = plans("fair")
    assert fair == plans("fcfs")
    assert any(p and p[-1][0] == -1 for p in fair)  # the pool was under pressure


def test_tenant_stats() -> None:
    sim = Sim(64, tenants=[TenantConfig("a"), TenantConfig("idle")])
    sim.add("a", tokens(8), max_tokens=2)
    sim.step()
    sim.add("a", tokens(9), max_tokens=1)
    sim.add("b", tokens(4, 50), max_tokens=2)
    stats = sim.sched.tenant_stats()
    assert set(stats) == {"a", "idle", "b"}
    assert stats["a"] == {
        "virtual_time": 8 + 2, "num_running": 1, "num_waiting": 1, "prompt_tokens": 8, "output_tokens": 1,
        "prefix_cache_queries": 8, "prefix_cache_hits": 0, "num_blocks": 2,
    }
    sim.step()
    stats = sim.sched.tenant_stats()
    assert stats["a"]["prefix_cache_queries"] == 17 and stats["a"]["prefix_cache_hits"] == 8
    assert stats["b"]["num_running"] == 1 and stats["idle"]["virtual_time"] == 0


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(BlockManager(4, BS), 4, 16, policy="lottery")


def test_a_step_the_pool_cannot_hold_is_split_by_weight_between_tenants_prefilling() -> None:
    """The free blocks run out before the token budget: the tenants prefilling split the
    prompt tokens the pool holds by weight, those over their share of the pool taking what the
    others leave. At weights 1:1, both holding half the pool, each takes half; handed out in
    service order instead, the least-served tenant, level within a few tokens, took every block
    for its chunks and the other got what was left (15 and 7 tokens). At weights 1:2 with the
    pool held half and half, "a" is over its third: "b" takes at least its two thirds first."""
    for weight_b in (1.0, 2.0):
        sim = Sim(28, tenants=[TenantConfig("a"), TenantConfig("b", weight=weight_b)], chunk=4, budget=256,
                  max_num_seqs=8, prefix_caching=False)
        prompts = {t: [sim.add(t, tokens(48, 1000 * k + (500 if t == "b" else 0)), max_tokens=1) for k in range(3)]
                   for t in "ab"}
        room = 0
        for _ in range(50):  # up to the first step whose chunks (6 of 5 tokens) the pool cannot hold
            if sim.sched.running:
                room = sum(len(s.block_table) * BS - s.num_computed_tokens for s in sim.sched.running)
                room += sim.bm.num_free_blocks * BS
            over = over_block_share(sim.sched)
            before = {t: sum(s.num_computed_tokens for s in seqs) for t, seqs in prompts.items()}
            out = sim.step()
            took = {t: sum(s.num_computed_tokens for s in seqs) - before[t] for t, seqs in prompts.items()}
            if 0 < room < 6 * 5:
                break
        else:
            pytest.fail("no step ran short of blocks")
        assert not out.preempted
        assert room - 4 <= took["a"] + took["b"] <= room  # a chunk's new blocks are whole blocks
        if weight_b == 1.0:
            assert over == set() and abs(took["b"] - took["a"]) <= 2, (took, room)
        else:
            assert over == {"a"} and took["b"] >= room * 2 // 3 - 2, (took, room)


def test_admission_counts_an_admitted_prompt_as_service_before_it_computes() -> None:
    """A's prompts are ten times B's. Each admitted prompt computes one chunk in its first
    step, so by the counters alone both tenants look level after one admission each, and A,
    listed first, would take the next slot. Counting the prompt tokens A was admitted for,
    B's short prompts take the remaining slots of the step."""
    sim = Sim(256, tenants=[TenantConfig("a"), TenantConfig("b")], chunk=4, budget=256, max_num_seqs=4,
              prefix_caching=False)
    a = [sim.add("a", tokens(80, 1000 * k), max_tokens=1) for k in range(1, 4)]
    b = [sim.add("b", tokens(8, 100 * k), max_tokens=1) for k in range(1, 4)]
    sim.step()
    assert sim.admitted == [a[0], b[0], b[1], b[2]]
    assert sim.stat("a", "virtual_time") < sim.stat("b", "virtual_time") + 1  # the counters alone are level
