"""Beam search over one request, with the selection rules of transformers' `generate`.

The engine keeps one `Sequence` per live beam; beams share their common history through the
block manager (a new beam is a fork of its parent, its first write into a shared partial block
is copied). This module only decides, from the beams' next-token log-probs, which
continuations live on and which hypotheses are finished. The arithmetic (float32 sums, top-k
over all beams' candidates, length penalty, early-stop heuristic) follows transformers so the
results match `generate(num_beams=k, do_sample=False)` token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from streamengine.sequence import Sequence

if TYPE_CHECKING:
    from streamengine.structured.grammar import GrammarMatcher

_NEG = -1.0e9  # transformers' "impossible" score
_FLOOR = _NEG / 2  # a finite score for what an extreme length penalty would make -inf or nan


def normalized_score(scores: torch.Tensor, length: int, length_penalty: float) -> torch.Tensor:
    """`scores / length ** length_penalty` exactly as transformers computes it (a Python float
    power, then a tensor division), safe for any finite penalty: a power that overflows is
    inf (the score becomes -0.0), and a score that becomes -inf or nan (the power underflows
    to 0) is clamped to `_FLOOR`, still above `_NEG` so a finished hypothesis stays finished."""
    try:
        denominator = length**length_penalty
    except OverflowError:
        denominator = math.inf
    return torch.nan_to_num(scores / denominator, nan=_FLOOR, posinf=_FLOOR, neginf=_FLOOR)


@dataclass(slots=True)
class BeamStep:
    parents: list[int]  # for each new running beam, the index of the beam it extends
    tokens: list[int]  # and the token it appends
    done: bool


@dataclass(slots=True)
class BeamSearchState:
    width: int
    prompt_len: int
    max_length: int  # prompt + max new tokens, absolute
    stop_token_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: bool = False
    running_scores: torch.Tensor = field(init=False)  # [width] float32
    finished_scores: torch.Tensor = field(init=False)  # [width] float32, best first
    finished_flags: torch.Tensor = field(init=False)  # [width] bool
    finished_tokens: list[list[int]] = field(init=False)  # output tokens of each slot
    improvable: bool = True  # transformers' "early stop heuristic unsatisfied"

    def __post_init__(self) -> None:
        # All beams start as the prompt; only the first counts, so the first step does not
        # pick the same continuation k times.
        self.running_scores = torch.full((self.width,), _NEG, dtype=torch.float32)
        self.running_scores[0] = 0.0
        self.finished_scores = torch.full((self.width,), _NEG, dtype=torch.float32)
        self.finished_flags = torch.zeros(self.width, dtype=torch.bool)
        self.finished_tokens = [[] for _ in range(self.width)]

    def step(self, beam_outputs: list[list[int]], logprobs: torch.Tensor) -> BeamStep:
        """One step. `beam_outputs[i]` are the output tokens of running beam i and
        `logprobs[i]` its next-token log-softmax [vocab]. Before the first step there is one
        live beam; it stands in for all `width` identical starting beams."""
        if logprobs.shape[0] == 1 and self.width > 1:
            logprobs = logprobs.expand(self.width, -1)
            beam_outputs = beam_outputs * self.width
        cur_len = self.prompt_len + len(beam_outputs[0])
        vocab = logprobs.shape[1]
        num_stops = len(self.stop_token_ids)
        # Enough candidates that `width` of them survive even if every stop id is among the
        # best, but never more than exist (a request may name every token as a stop id).
        keep = min(max(2, 1 + num_stops) * self.width, self.width * vocab)
        total = (logprobs.float() + self.running_scores[:, None]).reshape(-1)  # [width * vocab]
        cand_scores, cand_index = torch.topk(total, k=keep)
        cand_beams = (cand_index // vocab).tolist()
        cand_tokens = (cand_index % vocab).tolist()
        at_max = cur_len + 1 >= self.max_length
        stops = self.stop_token_ids
        hits = torch.tensor([at_max or t in stops for t in cand_tokens], dtype=torch.bool)  # [keep]

        self._update_finished(beam_outputs, cand_scores, cand_beams, cand_tokens, hits, cur_len)
        running = cand_scores + hits.float() * _NEG
        order = torch.topk(running, k=self.width).indices
        self.running_scores = running[order]
        self.improvable = self.improvable and self._can_improve(cur_len + 1)
        all_finished_early = bool(self.finished_flags.all()) and self.early_stopping
        done = not self.improvable or all_finished_early or bool(hits.all())
        return BeamStep([cand_beams[i] for i in order.tolist()], [cand_tokens[i] for i in order.tolist()], done)

    def _update_finished(self, beam_outputs, cand_scores, cand_beams, cand_tokens, hits, cur_len) -> None:
        top_k = torch.zeros_like(hits)
        top_k[: self.width] = True
        just_finished = hits & top_k
        scores = normalized_score(cand_scores, cur_len + 1 - self.prompt_len, self.length_penalty)
        if bool(self.finished_flags.all()) and self.early_stopping:
            scores = scores + _NEG
        if not self.improvable:
            scores = scores + _NEG
        scores = scores + (~just_finished).float() * _NEG
        merged = torch.cat((self.finished_scores, scores))
        merged_flags = torch.cat((self.finished_flags, just_finished))
        new_tokens = [beam_outputs[b] + [t] for b, t in zip(cand_beams, cand_tokens, strict=True)]
        merged_tokens = self.finished_tokens + new_tokens
        best = torch.topk(merged, k=self.width).indices
        self.finished_scores = merged[best]
        self.finished_flags = merged_flags[best]
        self.finished_tokens = [merged_tokens[i] for i in best.tolist()]

    def _can_improve(self, cur_len: int) -> bool:
        # transformers' early-stop heuristic: the best running beam, scored at
        # its current length, against the worst finished hypothesis.
        best_running = normalized_score(self.running_scores[0], cur_len - self.prompt_len, self.length_penalty)
        worst = torch.where(self.finished_flags, self.finished_scores.min(), torch.tensor(_NEG))
        return bool((best_running > worst).any())


class BeamSearch:
    """The live beams of one request and the search over them, as the core drives it.

    Each step every live beam's next-token log-probs arrive (`add_logprobs`); once all have,
    `advance` extends the survivors, forking a beam that more than one survivor extends (the
    fork shares the parent's blocks) and dropping beams no survivor extends. The core supplies
    `fork` and `drop`, since only it owns sequences and blocks. With a grammar, each live beam
    has its own matcher: a forked beam starts from a copy of its parent's, and each beam's
    matcher takes the token the beam appends. Its log-probs arrive masked by it, and every
    mask allows at least one token (the end of sequence once the grammar is complete), so each
    beam has a finite candidate and every surviving continuation is an allowed one, even when
    the grammar leaves fewer allowed tokens than beams.
    """

    def __init__(
        self, state: BeamSearchState, first: Sequence, num_results: int, matcher: GrammarMatcher | None = None,
    ) -> None:
        self.state = state
        self.seqs: list[Sequence] = [first]  # live beams
        self.num_results = num_results
        self._pending: dict[int, torch.Tensor] = {}  # seq_id -> [vocab] log-probs
        self._matchers: dict[int, GrammarMatcher] = {first.seq_id: matcher} if matcher is not None else {}

    def matcher(self, seq: Sequence) -> GrammarMatcher | None:
        """The grammar matcher of live beam `seq` (None without a grammar)."""
        return self._matchers.get(seq.seq_id)

    def add_logprobs(self, seq: Sequence, logprobs: torch.Tensor) -> None:
        """Records one beam's log-probs (a beam recomputed after preemption may report twice:
        the latest counts)."""
        self._pending[seq.seq_id] = logprobs

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.state.stop_token_ids

    @property
    def ready(self) -> bool:
        """Every live beam has its next-token log-probs: the search can advance."""
        return len(self._pending) == len(self.seqs)

    def advance(self, fork: Callable[[Sequence], Sequence], drop: Callable[[Sequence], None]) -> list[BeamResult] | None:
        """One search step. None while the search goes on; at its end the `num_results` best
        hypotheses, best first (fewer "length" results if fewer finished)."""
        live = self.seqs
        logprobs = torch.stack([self._pending.pop(s.seq_id) for s in live])  # [beams, vocab]
        step = self.state.step([s.output_token_ids for s in live], logprobs)
        if step.done:
            return self._results()
        # Before the first step the `width` starting beams are all the one live beam.
        parents = step.parents if len(live) > 1 else [0] * len(step.parents)
        first_use: set[int] = set()
        new_beams: list[Sequence] = []
        for parent_index in parents:  # forks first: they copy the parent as it is
            parent = live[parent_index]
            new_beams.append(self._fork(fork, parent) if parent_index in first_use else parent)
            first_use.add(parent_index)  # the first child continues in place
        for seq, token in zip(new_beams, step.tokens, strict=True):
            seq.token_ids.append(token)
            matcher = self._matchers.get(seq.seq_id)
            if matcher is not None:
                matcher.accept(token)
        for index, seq in enumerate(live):
            if index not in first_use:  # a dropped beam frees its blocks
                self._matchers.pop(seq.seq_id, None)
                drop(seq)
        self.seqs = new_beams
        return None

    def _fork(self, fork: Callable[[Sequence], Sequence], parent: Sequence) -> Sequence:
        child = fork(parent)
        matcher = self._matchers.get(parent.seq_id)
        if matcher is not None:
            self._matchers[child.seq_id] = matcher.fork()
        return child

    def _results(self) -> list[BeamResult]:
        stops = self.state.stop_token_ids
        results = [
            BeamResult(list(tokens), "stop" if tokens and tokens[-1] in stops else "length")
            for tokens in self.state.finished_tokens[: self.num_results]
        ]
        return results + [BeamResult([], "length")] * (self.num_results - len(results))


@dataclass(slots=True)
class BeamResult:
    token_ids: list[int]  # output tokens of a finished hypothesis
    finish_reason: str
