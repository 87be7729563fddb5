"""Fair share between tenants: the virtual token counter of Sheng et al., "Fairness in Serving
Large Language Models" (OSDI 2024), per-tenant quotas, and cache-aware order inside a tenant.

Each tenant has a counter of the service it received, weighted by its share:
(prompt tokens computed * prompt weight + generated tokens * output weight) / tenant weight.
The scheduler admits from the backlogged tenant with the least counter, so two tenants that
both keep requests waiting receive service in proportion to their weights. A tenant that had
nothing waiting (idle, or with requests running but none queued) starts its new request level
with the least-served backlogged tenant instead of where it left off: time with little or no
demand banks no credit, so a returning tenant cannot monopolise the engine.

The block manager and the queues stay the scheduler's; this class only keeps counts and
answers "whose turn", "which of this tenant's requests" and "who yields".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from streamengine.sequence import Sequence
from streamengine.tenancy.tenants import Tenants

CACHE_AWARE_MIN_WAITING = 4
"""A tenant with more waiting sequences than this admits the one with the longest cached prefix
first. With a short queue everyone starts within a step or two anyway, so reordering would only
cost the head its turn; a long queue is where hits first raises throughput."""
MAX_PASS_OVERS = 8
"""How many times a sequence may be passed over by a later one of its own tenant (cache-aware
order) before it is admitted next regardless: no starvation, and its extra wait is bounded by
8 admissions of its own tenant. The gain of hits-first comes from starting a burst of turns
that re-send one cached history together; 8 covers the turns a bot's users send in one short
window while keeping the bound far below a queue's usual length."""
FAIRNESS_SLACK = 1024.0
"""Weighted tokens a running tenant must be ahead of the least-served waiting one before its
sequences give way to it: about one request's service, so tenants within a request of each
other never preempt each other, and a tenant that was just made room for must be served a
whole slack further before the other can take its room back."""
MAX_YIELDS_PER_STEP = 16
"""Running sequences preempted per step to make room for under-served tenants (all of them
together): room comes over a few steps rather than by emptying the batch at once. A busy
tenant's sequences on a shared system prompt free a block or two each, so 4 (the first
value) admitted about one quiet request a step, and on a one-thread CPU engine, with steps
of a second or two, a burst of quiet bots waited several seconds each for admission."""
TENANT_PREFILL_CHUNKS = 4
"""Under "fair" a tenant's prompts in flight share this many prefill chunks per step. A quiet
tenant's lone cold prompt, such as a bot's system prompt that fell out of the cache, prefills
in a quarter of the steps. While other tenants have sequences in the step, a busy tenant's
prompts take these chunks in all (scaled by its weight over the least weight there), not one
each: a burst of its turns cannot lengthen every stream's step, and the time to first token
of the tenants with little in flight stops depending on how many prompts a noisy one sends.
A tenant alone takes a chunk per prompt, up to the budget. When the chunks would overflow
the step's budget anyway, the step's prefill tokens are split between the tenants by weight
(weighted_split): each takes its slice, spread over its prompts, and no more, so each step
serves the tenants prefilling in proportion to their weights rather than in the order their
prompts arrived."""
LOOKAHEAD = 32
"""Cache-aware order looks at this many of a tenant's waiting sequences (in arrival order), so
one admission costs a bounded number of prefix-cache lookups however long the queue is."""


def weighted_split(budget: int, demands: dict[str, int], weights: dict[str, float]) -> dict[str, int]:
    """Water-filling: `budget` tokens split in proportion to `weights`, nobody given more than
    it demands, what one leaves shared by the others by weight. Whole tokens: those left
    wanting get the floor of their share, and the rounding's remainder goes one token each to
    those listed first."""
    split = dict.fromkeys(demands, 0)
    wanting = sorted((name for name in demands if demands[name] > 0), key=lambda n: demands[n] / weights[n])
    left, total = budget, sum(weights[name] for name in wanting)
    while wanting and demands[wanting[0]] * total <= left * weights[wanting[0]]:
        name = wanting.pop(0)  # the least demand per weight fits under the level: met in full
        split[name] = demands[name]
        left -= demands[name]
        total -= weights[name]
    for name in wanting:
        split[name] = int(left * weights[name] / total)
    remainder = left - sum(split[name] for name in wanting)
    short = set(wanting)
    for name in [n for n in demands if n in short][:remainder]:
        split[name] += 1
    return split


@dataclass(slots=True)
class TenantUsage:
    virtual_time: float = 0.0  # weighted service so far, lifted on return from idle
    num_seqs: int = 0  # sequences in the scheduler: waiting, running or swapped
    prompt_tokens: int = 0  # prompt tokens computed (not served from the cache, not recomputed)
    output_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class FairShare:
    """Per-tenant service counters and the fair policy's choices."""

    def __init__(self, tenants: Tenants, prompt_token_weight: float = 1.0, output_token_weight: float = 2.0) -> None:
        self.tenants = tenants
        self.prompt_token_weight = prompt_token_weight
        self.output_token_weight = output_token_weight
        self.usage: dict[str, TenantUsage] = {}
        # Per sequence in the scheduler: positions below this were charged already (a recompute
        # after preemption, or a fork sharing its parent's prompt, is not charged again).
        self._charged: dict[Sequence, int] = {}
        self._passed: dict[Sequence, int] = {}  # times passed over by a later one of its tenant
        self._admitted: set[str] = set()  # tenants the current (or last) step admitted from the line

    def usage_of(self, tenant: str) -> TenantUsage:
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
        return usage

    # -- counters -------------------------------------------------------------------------

    def on_arrival(self, seq: Sequence, charged_upto: int = 0, waiting: Iterable[str] | None = None) -> None:
        """`seq` enters the scheduler; its first `charged_upto` positions were paid for.
        `waiting`, for a new request joining the waiting line: the tenants with sequences
        waiting for admission. A tenant not among them becomes backlogged with this request
        and is lifted to the frontier, whether or not it has sequences running, as in the
        paper, whose queue holds only requests not yet admitted; unless the last step
        admitted from its line (start_step): a line emptied by admission was served, not
        short of demand, and lifting it there would take from a backlogged tenant the
        service it is owed. (Lifting only a tenant with no sequence at all would let a bot
        that always has one conversation running fall far behind while its demand is light,
        then take every admission once its demand rises, the tenants lifted meanwhile
        waiting behind it.)"""
        if seq in self._charged:
            return
        usage = self.usage_of(seq.tenant)
        if waiting is not None and seq.tenant not in self._admitted:
            backlogged = set(waiting)
            if seq.tenant not in backlogged:
                usage.virtual_time = max(usage.virtual_time, self._frontier(backlogged))
        usage.num_seqs += 1
        self._charged[seq] = charged_upto
        self._passed[seq] = 0

    def _frontier(self, waiting: set[str]) -> float:
        """Where a returning tenant starts: the least counter among the tenants waiting for
        admission (as in the paper: it then competes level with them, not ahead of them);
        with none waiting, the least among tenants with sequences running; with none at all,
        the furthest any counter got (those who come later start there too, so nobody gains
        from the time the engine served others or stood idle)."""
        backlogged = [self.usage_of(name).virtual_time for name in waiting]
        if backlogged:
            return min(backlogged)
        active = [u.virtual_time for u in self.usage.values() if u.num_seqs]
        if active:
            return min(active)
        return max((u.virtual_time for u in self.usage.values()), default=0.0)

    def start_step(self) -> None:
        """A step's scheduling begins: who the previous step admitted no longer matters."""
        self._admitted.clear()

    def on_admit(self, seq: Sequence) -> None:
        """`seq` left the waiting line for the running set this step."""
        self._admitted.add(seq.tenant)

    def on_leave(self, seq: Sequence) -> None:
        """`seq` finished or was aborted (idempotent)."""
        if self._charged.pop(seq, None) is None:
            return
        self._passed.pop(seq, None)
        self.usage_of(seq.tenant).num_seqs -= 1

    def charge(self, seq: Sequence, start: int, num_new_tokens: int, samples: bool) -> None:
        """Counts positions [start, start + num_new_tokens) of `seq` scheduled this step."""
        upto = self._charged.get(seq)
        if upto is None:
            return
        end = start + num_new_tokens
        self._charged[seq] = max(upto, end)
        # Positions past the prompt feed back tokens that were charged when generated.
        prompt = max(0, min(end, seq.num_prompt_tokens) - max(start, upto))
        self._count(seq.tenant, prompt, 1 if samples else 0)

    def charge_accepted(self, seq: Sequence, num_tokens: int) -> None:
        """Counts `num_tokens` accepted proposed tokens of `seq` (speculative decoding) as
        output tokens, as if each had been sampled in a step of its own."""
        if seq in self._charged:
            self._count(seq.tenant, 0, num_tokens)

    def _count(self, tenant: str, prompt: int, generated: int) -> None:
        usage = self.usage_of(tenant)
        usage.prompt_tokens += prompt
        usage.output_tokens += generated
        cost = prompt * self.prompt_token_weight + generated * self.output_token_weight
        usage.virtual_time += cost / self.tenants.get(tenant).weight

    def count_admission(self, seq: Sequence, num_hit_tokens: int) -> None:
        usage = self.usage_of(seq.tenant)
        usage.prefix_cache_queries += seq.num_tokens
        usage.prefix_cache_hits += num_hit_tokens

    # -- choices --------------------------------------------------------------------------

    def committed(self, seqs: Iterable[Sequence]) -> dict[str, float]:
        """Per tenant, the weighted cost of the prompt tokens its `seqs` were admitted for and
        have not been charged yet: service promised, which admission counts as given (as VTC
        charges a prompt when it is admitted). Counted only as its chunks run, a long-prompt
        tenant would keep the least counter while its first prompts prefill and be admitted
        again and again, taking the free room of several steps."""
        cost: dict[str, float] = {}
        for seq in seqs:
            left = seq.num_prompt_tokens - self._charged.get(seq, seq.num_prompt_tokens)
            if left > 0:
                weight = self.tenants.get(seq.tenant).weight
                cost[seq.tenant] = cost.get(seq.tenant, 0.0) + left * self.prompt_token_weight / weight
        return cost

    def least_served(self, tenants: Iterable[str], committed: Mapping[str, float] | None = None) -> str:
        """The tenant owed the most service, counting what `committed` promised it; ties go to
        the one listed first (arrival order)."""
        return min(tenants, key=lambda name: self._owed(name, committed))

    def first_to_serve(self, tenants: Iterable[str], running: set[str],
                       committed: Mapping[str, float] | None = None) -> str:
        """Whom to make room for: the least served of the tenants with nothing in `running` (a
        returning tenant's first request), else the least served (`committed` counted)."""
        return min(tenants, key=lambda name: (name in running, self._owed(name, committed)))

    def _owed(self, tenant: str, committed: Mapping[str, float] | None) -> float:
        return self.usage_of(tenant).virtual_time + (committed or {}).get(tenant, 0.0)

    def service_order(self, seqs: list[Sequence], last: Iterable[str] = ()) -> list[Sequence]:
        """`seqs` with the least-served tenants' first, those of the tenants in `last` after
        all others (stable: arrival order within a tenant): the order in which a step's token
        budget and free blocks are handed out."""
        last = set(last)
        return sorted(seqs, key=lambda s: (s.tenant in last, self.usage_of(s.tenant).virtual_time))

    def pick(self, candidates: list[tuple[Sequence, int]], num_waiting: int) -> int:
        """Index of the candidate (sequence, cached blocks), in the tenant's arrival order, to
        admit next: one passed over MAX_PASS_OVERS times, else with a long queue the longest
        cached prefix (earliest on ties), else the first."""
        for i, (seq, _) in enumerate(candidates):
            if self._passed.get(seq, 0) >= MAX_PASS_OVERS:
                return i
        if num_waiting <= CACHE_AWARE_MIN_WAITING:
            return 0
        return max(range(len(candidates)), key=lambda i: candidates[i][1])

    def passed_over(self, seqs: Iterable[Sequence]) -> None:
        """`seqs` were eligible and ahead of the one just admitted from their tenant."""
        for seq in seqs:
            if seq in self._passed:
                self._passed[seq] += 1

    def num_passed(self, seq: Sequence) -> int:
        return self._passed.get(seq, 0)

    def pick_victim(self, candidates: list[Sequence], held: Mapping[str, tuple[int, int]],
                    cached: bool = True) -> Sequence:
        """The newest sequence of the candidates' tenant furthest over its share of the pool.
        `held`: per tenant, its running sequences and the blocks they hold. A tenant running
        a single sequence goes last (as in over_block_share: one request larger than a share
        must not be preempted over and over); then the most blocks per unit of weight (shares
        being proportional to weights); ties to the one furthest ahead in service.

        Not the service counter alone: a quiet tenant returning from idle starts level with
        the busy one and is charged its whole prompt at once, so by service it would be the
        first to yield, its lone prompt preempted mid-prefill to let the busy tenant's many
        sequences grow; by blocks held the busy tenant yields, which is what frees the pool.

        Without the prefix cache (`cached` False) a victim loses its whole computed prefix: among
        lone sequences only, the newest arrival yields (as under "fcfs"), so the oldest always
        advances. By blocks held, two long prompts that did not fit side by side preempted
        each other in turn, neither ever finishing."""
        if not cached and all(held.get(s.tenant, (0, 0))[0] == 1 for s in candidates):
            return max(candidates, key=lambda s: (s.arrival_time, s.seq_id))
        def key(seq: Sequence) -> tuple[bool, float, float, float, int]:
            num_seqs, num_blocks = held.get(seq.tenant, (0, 0))
            weight = self.tenants.get(seq.tenant).weight
            service = self.usage_of(seq.tenant).virtual_time
            return num_seqs > 1, num_blocks / weight, service, seq.arrival_time, seq.seq_id
        return max(candidates, key=key)

    def over_block_share(self, held: Mapping[str, tuple[int, int]], waiting: Iterable[Sequence],
                         pool_size: int) -> set[str]:
        """Tenants running two or more sequences whose blocks exceed their weight's share of
        the pool among the tenants with sequences in the scheduler. `held`: per running
        tenant, its sequences and the blocks they hold that preemption would free (a block
        shared inside the tenant counted once, pinned ones not at all: they stay either way);
        `pool_size`: the blocks not pinned. As with quotas, a tenant's only sequence is never
        counted over: one request larger than a share must not be preempted over and over."""
        active = {seq.tenant for seq in waiting} | held.keys()
        total = sum(self.tenants.get(name).weight for name in active)
        return {name for name, (num_seqs, num_blocks) in held.items()
                if num_seqs > 1 and num_blocks > pool_size * self.tenants.get(name).weight / total}

    def over_slot_share(self, running: list[Sequence], waiting: Iterable[Sequence], num_slots: int) -> set[str]:
        """Tenants running two or more sequences, more than their weight's share of the
        `num_slots` running slots (max_num_seqs) among the tenants with sequences in the
        scheduler: one request of n samples (or beams) can take every slot while holding
        little of the pool, and a tenant arriving then must get one of them back."""
        counts: dict[str, int] = {}
        for seq in running:
            counts[seq.tenant] = counts.get(seq.tenant, 0) + 1
        active = {seq.tenant for seq in waiting} | counts.keys()
        total = sum(self.tenants.get(name).weight for name in active)
        return {name for name, num_seqs in counts.items()
                if num_seqs > 1 and num_seqs > num_slots * self.tenants.get(name).weight / total}

    # -- quotas ---------------------------------------------------------------------------

    def within_quota(self, seq: Sequence, running: list[Sequence], new_block_ids: Iterable[int],
                     num_new_blocks: int, pool_size: int) -> bool:
        """Whether `seq` may run (admitted, or grown by `num_new_blocks` fresh blocks and the
        cache hits `new_block_ids`) within its tenant's max_running and max_kv_fraction. A tenant
        with no other request running may always run one, all its sequences: a limit smaller
        than one request must not stop it for good."""
        config = self.tenants.get(seq.tenant)
        if config.max_running is None and config.max_kv_fraction is None:
            return True
        mine = [s for s in running if s.tenant == seq.tenant]
        if all(s.request_id == seq.request_id for s in mine):
            return True
        admitting = all(s is not seq for s in mine)
        if admitting and config.max_running is not None and _num_committed(mine) + _width(seq, mine) > config.max_running:
            return False
        if config.max_kv_fraction is None:
            return True
        held = {b for s in mine for b in s.block_table}
        held.update(new_block_ids)
        return len(held) + num_new_blocks <= config.max_kv_fraction * pool_size

    # -- stats ----------------------------------------------------------------------------

    def stats(self, running: list[Sequence], waiting: Iterable[Sequence]) -> dict[str, dict[str, float | int]]:
        out = {name: _row(self.usage_of(name)) for name in dict.fromkeys([*self.tenants.names(), *self.usage])}
        blocks: dict[str, set[int]] = {}
        for seq in running:
            out.setdefault(seq.tenant, _row(self.usage_of(seq.tenant)))["num_running"] += 1
            blocks.setdefault(seq.tenant, set()).update(seq.block_table)
        for seq in waiting:
            out.setdefault(seq.tenant, _row(self.usage_of(seq.tenant)))["num_waiting"] += 1
        for name, held in blocks.items():
            out[name]["num_blocks"] = len(held)
        return out


def _num_committed(running: list[Sequence]) -> int:
    """The sequences `running` runs or is about to: a request whose first sequence has not
    sampled yet counts as its whole group (its samples or beams fork from it then), not as
    the one sequence it runs now (counted so, a tenant under max_running=4 started two
    requests of 3 beams together, then ran 6 sequences)."""
    counts: dict[str, int] = {}
    groups: dict[str, int] = {}
    for seq in running:
        counts[seq.request_id] = counts.get(seq.request_id, 0) + 1
        if seq.group_size > 1 and seq.num_output_tokens == 0:
            groups[seq.request_id] = seq.group_size
    return sum(max(n, groups.get(request_id, 0)) for request_id, n in counts.items())


def _width(seq: Sequence, running: list[Sequence]) -> int:
    """The sequences that admitting `seq` starts: its whole group (n samples or beams fork from
    it once its prompt is computed) unless part of the group runs already (a member preempted
    by recompute rejoins alone)."""
    if any(s.request_id == seq.request_id for s in running):
        return 1
    return seq.group_size


def _row(usage: TenantUsage) -> dict[str, float | int]:
    return {
        "virtual_time": usage.virtual_time,
        "num_running": 0,
        "num_waiting": 0,
        "prompt_tokens": usage.prompt_tokens,
        "output_tokens": usage.output_tokens,
        "prefix_cache_queries": usage.prefix_cache_queries,
        "prefix_cache_hits": usage.prefix_cache_hits,
        "num_blocks": 0,
    }
