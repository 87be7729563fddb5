"""Speculative decoding in the core: proposing before a step, verifying after it.

Before each step, every running request that may speculate (`speculates`) and whose gate is
open gets proposed tokens (`seq.spec_token_ids`); the scheduler verifies as many as its
budget and the free blocks hold (Scheduler._fit_proposals), in the same forward pass as the
request's next token. The logits at the last known token and at each proposed one are sampled
like any row; the sampled tokens are the target model's choices at those positions. A
proposal is accepted while it equals the token sampled before it; the first sampled token
that differs (or the one after the last proposal) is appended too, so a step yields between 1
and k + 1 tokens, and they are exactly the tokens decoding one at a time would give.

Under a grammar, the tokens it forces next are proposed first (jump-forward), then lookup goes
on after them; each verified row is masked by the grammar's state after the proposals before
it (a fork of the sample's matcher), so a forced token is accepted when the model's masked
choice is that token (another tokenization of the same bytes is not), and the request keeps
exactly the tokens it would have drawn.

Greedy requests get exactly the tokens of one-at-a-time decoding. A sampled request gets
exactly its distribution: a draft from lookup is one token per position (a point mass), for
which speculative sampling's rule (accept x with chance p(x), else draw from p without x)
is the same as drawing y from p at that position and accepting x iff y == x, emitting y
otherwise; every row draws its own noise, so the emitted tokens are distributed as sequential
sampling (tests/test_speculative.py checks it by a chi-square test). Logprobs are each row's,
the target model's at that position. Requests whose token depends on more than the position's
logits and noise do not speculate (`speculates`). Rejected positions' K/V is never read: the sequence
counts only verified positions as computed, the next step overwrites the rest, and the blocks
past its tokens go back to the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamengine.config import SpeculativeConfig
from streamengine.sample.request import Request, Sample
from streamengine.sample.sampling_params import SamplingParams
from streamengine.sched.plan import ScheduledSeq
from streamengine.sequence import DRAFT_SLOT, SequenceStatus
from streamengine.spec.history import HistoryKey, OutputHistory
from streamengine.spec.ngram import propose_ngram

if TYPE_CHECKING:
    from streamengine.engine.core import EngineCore


def output_history(config: SpeculativeConfig | None) -> OutputHistory | None:
    """The tenants' earlier outputs, kept for the "suffix" method only."""
    if config is None or config.method != "suffix":
        return None
    return OutputHistory(config.suffix_history_tokens)


def speculates(params: SamplingParams) -> bool:
    """Whether a request with `params` uses speculative decoding when the engine has it on:
    one whose token at each position depends only on that position's logits and its own
    noise. Penalties and min_tokens depend on the tokens before, a grammar on its matcher's
    state; a seeded request's stream of draws would depend on how many proposals each step
    verified (its tokens would change with the batch)."""
    return (
        params.speculate and params.n == 1 and params.beam_width == 1
        and (params.greedy or params.seed is None)
        and not params.has_penalties and params.min_tokens == 0
    )


def propose(core: EngineCore, config: SpeculativeConfig) -> None:
    """Fills `spec_token_ids` of each running sequence whose sample may speculate now, as
    many as pay at this batch size (spec.acceptance)."""
    threshold = core.step_cost.threshold(len(core.scheduler.running))
    for seq in core.scheduler.running:
        owner = core._owner.get(seq.seq_id)
        sample = owner[1] if owner is not None else None
        if sample is None or sample.spec_gate is None or seq.num_computed_tokens != seq.num_tokens - 1:
            seq.spec_token_ids = []
            continue
        sample.spec_matchers = []  # a previous draft's grammar states, if it was not verified
        room = core.max_model_len - seq.num_tokens  # proposals past the context could not be kept
        left = owner[0].max_tokens - len(sample.token_ids) - 1  # the step's own token comes first
        k = min(config.num_speculative_tokens, room, left)
        if k > 0:
            k = sample.spec_gate.draft_length(k, threshold)
        seq.spec_token_ids = draft(core, sample, seq.token_ids, k, config) if k > 0 else []


def draft(core: EngineCore, sample: Sample, token_ids: list[int], k: int, config: SpeculativeConfig) -> list[int]:
    """Up to `k` proposed tokens: under a grammar, first the tokens it forces (jump-forward),
    then lookup over the tokens with them; cut where the grammar refuses one (it could not be
    accepted), with the matcher's state after each kept in `sample.spec_matchers`. Without a
    grammar, "draft" leaves k slots for the draft model (models/draft.py)."""
    matcher = sample.matcher
    if matcher is None:
        if config.method == "draft":
            return [DRAFT_SLOT] * k  # the draft model fills them once the step has their slots
        return lookup(core, sample, token_ids, k, config)
    forced = matcher.forced_tokens()[:k]
    proposed = forced
    if len(forced) < k:
        proposed = forced + lookup(core, sample, token_ids + forced, k - len(forced), config)
    states, state = [], matcher
    for token in proposed:
        state = state.fork()
        if not state.try_accept(token):
            break
        states.append(state)
    sample.spec_matchers = states
    return proposed[:len(states)]


def lookup(core: EngineCore, sample: Sample, token_ids: list[int], k: int, config: SpeculativeConfig) -> list[int]:
    """The request's own tokens first; with "suffix", then its tenant's earlier outputs."""
    own = propose_ngram(token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max)
    if own or core.output_history is None:
        return own
    return core.output_history.lookup(history_key(sample), token_ids, k, config.prompt_lookup_min,
                                      config.prompt_lookup_max)


def history_key(sample: Sample) -> HistoryKey:
    return sample.seq.tenant, sample.seq.cache_salt


def remember(core: EngineCore, req: Request) -> None:
    """Keeps a finished request's outputs for the "suffix" method's lookups."""
    for sample in req.samples:
        if sample.spec_gate is not None and sample.finish_reason in ("stop", "length"):
            core.output_history.add(history_key(sample), sample.token_ids)


def take_verified(core: EngineCore, req: Request, sample: Sample, item: ScheduledSeq,
                  draws: list[tuple[int, Any]]) -> None:
    """Appends the tokens a verified step yields: the sampled token at the last known token,
    then, while each proposal equals the token sampled before it, the token sampled at it."""
    seq, k = item.seq, item.num_spec_tokens
    proposed = seq.spec_token_ids[:k]
    seq.spec_token_ids, sample.spec_matchers = [], []
    accepted = 0
    while accepted < k and proposed[accepted] == draws[accepted][0]:
        accepted += 1
    core.spec_stats.record(k, accepted)
    req.metrics.spec_draft_tokens += k
    req.metrics.spec_accepted_tokens += accepted
    sample.spec_gate.record(k, accepted)
    core.scheduler.share.charge_accepted(seq, accepted)
    for i, (token, logprobs) in enumerate(draws[:accepted + 1]):
        seq.num_computed_tokens += i > 0  # the accepted proposal before it was computed right
        core._append_token(req, sample, token, logprobs)
        if sample.finished:
            return
    if seq.status is SequenceStatus.RUNNING:
        core.block_manager.free_unused(seq)
