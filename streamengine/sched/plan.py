"""The plan one scheduling step hands the model runner: the sequences to compute (how many
tokens each, whether it samples, how many prompt logprobs it gives) and the block copies and
swaps to do first. Plain records, no policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamengine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # compute positions [num_computed_tokens, num_computed_tokens + this)
    samples: bool = False  # reaches the last known token, whose logits give the next one
    # The first this many positions computed give prompt logprobs: position p's logits give
    # prompt token p + 1's (only while `seq.prompt_logprobs` asks for them).
    num_prompt_logprobs: int = 0
    # Of `num_new_tokens`, the last this many are proposed tokens (`seq.spec_token_ids`),
    # verified by this step's logits at them and at the last known token.
    num_spec_tokens: int = 0

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int, num_spec_tokens: int = 0) -> ScheduledSeq:
        """`num_new_tokens` known tokens of `seq` from its first not computed, then
        `num_spec_tokens` proposed ones (only after its last known token)."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        prompt_rows = 0
        if seq.prompt_logprobs is not None:
            prompt_rows = max(0, min(end, seq.num_prompt_tokens - 1) - start)
        return cls(seq, num_new_tokens + num_spec_tokens, end == seq.num_tokens, prompt_rows, num_spec_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    """A plain plan for one step: what to compute, which blocks to copy first."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
