"""Core start: a new request's samples (or its beam search), set up by EngineCore.add_request.

Functions over the `EngineCore`: each sample gets its sequence, detokenizer and sampling row
(and a draft gate where it may speculate); a beam search gets its state and first beam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamengine.engine import speculation
from streamengine.sample.beam_search import BeamSearch, BeamSearchState
from streamengine.sample.detokenizer import IncrementalDetokenizer
from streamengine.sample.request import Request, Sample
from streamengine.sample.sampler import SamplingRow, sample_generator
from streamengine.spec.acceptance import ProposalGate
from streamengine.structured.grammar import CompiledGrammar
from streamengine.structured.mask import MaskAccount

if TYPE_CHECKING:
    from streamengine.engine.core import EngineCore


def start_samples(core: EngineCore, req: Request, grammar: CompiledGrammar | None) -> None:
    """The request's n samples: a sequence each (sample 0's runs first; the others fork it
    once its prompt is computed), detokenizer, sampling row and, where it may, a draft gate."""
    params, prompt_ids = req.params, req.prompt_token_ids
    early_stops: frozenset[int] = frozenset()  # what min_tokens keeps the sampler from drawing
    if params.min_tokens > 0:
        early_stops = req.stop_ids if params.ignore_eos else req.stop_ids | core.eos_token_ids
    account = mask_account(core, req)  # every sample's masks count against one budget
    for i in range(params.n):
        seq = core._new_seq(req, group_size=params.n)
        sample = Sample(
            i, seq, IncrementalDetokenizer(core.tokenizer, prompt_ids, params),
            logprobs=[] if params.logprobs is not None else None,
        )
        # The row reads the sample's own token list, so penalties never need a copy.
        sample.row = SamplingRow(
            params, sample_generator(params, i, core.device), prompt_ids, sample.token_ids,
            matcher=grammar.matcher(account) if grammar is not None else None, min_tokens_stop_ids=early_stops,
        )
        if core.config.speculative is not None and speculation.speculates(params):
            sample.spec_gate = ProposalGate()
        req.samples.append(sample)
        core._owner[seq.seq_id] = (req, sample)
    req.pending_children = req.samples[1:]  # forked from sample 0 once its prompt is computed


def start_beam_search(core: EngineCore, req: Request, grammar: CompiledGrammar | None) -> None:
    """The request's beam search, from its first sequence; its n samples fill when it ends."""
    params = req.params
    req.samples = [Sample(i) for i in range(params.n)]  # filled when the search ends
    first = core._new_seq(req, group_size=params.beam_width)
    # A complete grammar allows only the end of sequence, so with one it always ends a beam.
    eos_stops = not params.ignore_eos or grammar is not None
    stops = req.stop_ids | core.eos_token_ids if eos_stops else req.stop_ids
    prompt_len = len(req.prompt_token_ids)
    state = BeamSearchState(
        width=params.beam_width,
        prompt_len=prompt_len,
        max_length=min(prompt_len + req.max_tokens, core.max_model_len),
        stop_token_ids=stops,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
    )
    matcher = grammar.matcher(mask_account(core, req)) if grammar is not None else None
    req.beam = BeamSearch(state, first, params.n, matcher)
    core._owner[first.seq_id] = (req, None)


def mask_account(core: EngineCore, req: Request) -> MaskAccount:
    """One grammar-mask budget for all of a request's rows."""
    return MaskAccount(req.tenant, core.config.grammar_mask_budget_ms / 1e3)
