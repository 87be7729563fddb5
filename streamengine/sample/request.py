"""A request's state inside the core: its prompt, its parameters and its n samples.

A `Sample` is one of the n outputs: the sequence it grows, its detokenizer, its sampling row,
its logprobs, why it finished, and how much of it has been handed out (for delta outputs).
Beam search keeps its live beams in its own object (beam_search.BeamSearch); its n samples
stay empty until the search ends and fills them with the best hypotheses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamengine.sample.beam_search import BeamSearch
from streamengine.sample.detokenizer import IncrementalDetokenizer
from streamengine.sample.outputs import RequestMetrics
from streamengine.sample.sampler import SamplingRow
from streamengine.sample.sampling_params import SamplingParams
from streamengine.sequence import Sequence
from streamengine.spec.acceptance import ProposalGate
from streamengine.structured.grammar import GrammarMatcher
from streamengine.tenancy.pinning import Pin

if TYPE_CHECKING:
    from streamengine.lora.adapter import LoRAAdapter


@dataclass(slots=True, eq=False)
class Sample:
    index: int  # which of the request's n samples
    seq: Sequence | None = None  # None for a beam-search result
    detok: IncrementalDetokenizer | None = None  # None for a beam-search result
    row: SamplingRow | None = None
    token_ids: list[int] = field(default_factory=list)  # generated tokens
    logprobs: list[dict[int, float]] | None = None  # per generated token, when asked for
    final_text: str = ""  # a beam-search result's text, decoded once at the end
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_sent_tokens: int = 0  # tokens (and logprobs) already in an output (delta outputs)
    num_sent_chars: int = 0  # characters of text already in an output
    finish_sent: bool = False  # its finish reason is out: no further delta
    spec_gate: ProposalGate | None = None  # set when its request may speculate
    # With a grammar: its matcher's state after each proposed token, for that row's mask.
    spec_matchers: list[GrammarMatcher] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text that may be shown now (it never shrinks)."""
        return self.detok.text if self.detok is not None else self.final_text

    @property
    def matcher(self) -> GrammarMatcher | None:
        """Where the sample stands in its grammar (structured outputs), on its sampling row."""
        return self.row.matcher if self.row is not None else None

    def text_since(self, offset: int) -> str:
        """`text[offset:]`, without copying the whole text."""
        if self.detok is not None:
            return self.detok.text_since(offset)
        return self.final_text[offset:]

    def finish(self, reason: str, stop: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop
        if self.detok is not None:
            self.detok.finish()


@dataclass(slots=True, eq=False)
class Request:
    """One prompt and its n samples (`samples[i].index == i`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sample]
    arrival_time: float
    max_tokens: int  # params.max_tokens, or what max_tokens=None resolves to (cap, context)
    stop_ids: frozenset[int]  # params.stop_token_ids as a set: one lookup per sampled token
    # Samples 1..n-1 wait for sample 0's prompt: they then fork its blocks and draw their
    # first token from the same logits.
    pending_children: list[Sample] = field(default_factory=list)
    beam: BeamSearch | None = None
    tenant: str = "default"
    salt_segments: tuple[tuple[int, str | None], ...] = ()  # see pinning.Pins.segments
    pin: Pin | None = None  # a pin_prefix request: its prompt's full blocks are pinned at the end
    lora: LoRAAdapter | None = None  # the LoRA adapter it runs under, None for the base model
    # With params.prompt_logprobs: [None] + an entry per prompt token computed so far (each
    # once, even when a preempted prompt is computed again); complete at len(prompt_token_ids).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs_sent: bool = False  # a delta output carried them: later ones do not
    metrics: RequestMetrics = field(init=False)  # stage times, stamped by the core

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(self.arrival_time)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def seqs(self) -> list[Sequence]:
        """The sequences the request holds blocks for: its live beams, or its samples'."""
        if self.beam is not None:
            return self.beam.seqs
        return [s.seq for s in self.samples if s.seq is not None]

    @property
    def prompt_logprobs_ready(self) -> bool:
        """Every prompt token has its entry (asked for, and the prompt is computed)."""
        plp = self.prompt_logprobs
        return plp is not None and len(plp) == len(self.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        seqs = self.seqs
        return seqs[0].num_cached_tokens if seqs else 0
