"""How many proposed tokens are worth verifying, and the engine's counts of proposed and accepted ones.

Verifying a proposed token costs a row of the step (its GEMM row, its attention, its logits);
accepting it saves the sequence a row in a later step and its share of that step's fixed cost
(reading the weights once for the whole batch). With the step's time modelled as
`fixed + per_row * rows` (`StepCost`, fitted as the engine runs) and B sequences in the batch,
an accepted token is worth `fixed / B + per_row` and a proposed one costs `per_row`, so a
proposal at draft position j pays when the chance that the draft is accepted up to it beats

    threshold = 1 / (1 + fixed / (per_row * B)).

At batch 1 that is a low bar (a decode step is mostly weight reads); at large batches it
nears 1, and speculation turns itself off. `ProposalGate` estimates, per request, the chance
that a draft goes on being accepted at the next position (decayed counts of accepted positions
and of first rejections, as a geometric model: position j is reached with chance c**j) and
proposes the longest draft whose last position clears the threshold. A request whose drafts
do not pay proposes one token now and then (after a cool-down that doubles each time) to
notice when its text starts repeating its input, unless the bar is higher than such probes
could ever show it clears (large batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPTED = 0.6  # a new request's drafts are assumed to go on with chance 0.6,
PRIOR_REJECTED = 0.4  # an assumption its first drafts soon outweigh
DECAY = 0.85  # weight of a request's older drafts, per draft: the estimate follows its text
MAX_COOLDOWN = 64  # steps
# The highest continuation estimate one-token probes can build (every probe accepted, the
# decayed count at its limit): where the bar is above it, probing could never turn into drafts.
PROBE_CEILING = (1 / (1 - DECAY) + PRIOR_ACCEPTED) / (1 / (1 - DECAY) + PRIOR_ACCEPTED + PRIOR_REJECTED)
FIXED_PER_ROW = 2.7  # fixed / per-row cost before the engine has measured its own steps


@dataclass(slots=True)
class ProposalGate:
    accepted: float = 0.0  # decayed count of accepted draft positions
    rejected: float = 0.0  # decayed count of drafts cut short by a rejection
    cooldown: int = 0  # steps left without proposing
    next_cooldown: int = 2

    @property
    def continuation(self) -> float:
        """The estimated chance that a draft accepted so far is accepted at its next position."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.accepted + self.rejected + PRIOR_ACCEPTED + PRIOR_REJECTED)

    def draft_length(self, k: int, threshold: float) -> int:
        """How many tokens (at most `k`) to propose this step."""
        if self.cooldown:
            self.cooldown -= 1
            return 0
        c = self.continuation
        length, reach = 0, c
        while length < k and reach > threshold:
            length += 1
            reach *= c
        if length:
            self.next_cooldown = 2
            return length
        if threshold >= PROBE_CEILING:  # a bar no probe could show this request clears
            return 0
        self.cooldown = self.next_cooldown  # not worth it now: probe with one token, then wait
        self.next_cooldown = min(2 * self.next_cooldown, MAX_COOLDOWN)
        return 1

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (num_accepted < num_proposed)


@dataclass(slots=True)
class StepCost:
    """A step's time as `fixed + per_row * rows`, fitted by least squares over recent steps
    (older ones decay), and the acceptance threshold that follows from it."""

    decay: float = 0.98
    _n: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    ratio: float = FIXED_PER_ROW  # fixed / per_row, as last fitted

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._n, self._x, self._y = d * self._n + 1, d * self._x + rows, d * self._y + seconds
        self._xx, self._xy = d * self._xx + rows * rows, d * self._xy + rows * seconds
        var = self._n * self._xx - self._x ** 2
        if self._n < 8 or var < 0.25 * self._n ** 2:  # too few steps, or too alike in size, to tell
            return
        per_row = (self._n * self._xy - self._x * self._y) / var
        fixed = (self._y - per_row * self._x) / self._n
        if per_row > 0 and fixed > 0:
            self.ratio = fixed / per_row

    def threshold(self, batch_size: int) -> float:
        """The chance of acceptance a proposed token must beat, with `batch_size` sequences."""
        return 1.0 / (1.0 + self.ratio / max(1, batch_size))


@dataclass(slots=True)
class SpecStats:
    """Counts since the engine started, as vLLM's spec-decode metrics count them: drafts
    (verifications with at least one proposed token), proposed and accepted tokens, and
    accepted tokens by their position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos.extend([0] * (num_proposed - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified draft yields on average: its accepted ones plus the one sampled."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
