"""Step outputs: what EngineCore.process does with one step's results.

Each scheduled sequence's prompt logprobs and sampled tokens are taken (children of an n > 1
request fork from sample 0 as they draw their first tokens), beam searches advance once all
their beams have log-probs, and every request the step advanced gets its next output. A fault
in one request's postprocessing fails that request alone. Functions over the `EngineCore`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from streamengine.engine import speculation
from streamengine.errors import GrammarError
from streamengine.models.model_runner import PromptLogprobs
from streamengine.sample.output_processor import make_output
from streamengine.sample.outputs import RequestOutput
from streamengine.sample.request import Request, Sample
from streamengine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from streamengine.engine.core import EngineCore, StepPlan, StepResult

log = logging.getLogger("streamengine.engine.core")
T = TypeVar("T")


def drawing_children(req: Request, sample: Sample) -> list[Sample]:
    return req.pending_children if sample.index == 0 else []


def process(core: EngineCore, step: StepPlan, result: StepResult) -> list[RequestOutput]:
    """Appends the step's tokens and returns the outputs of the requests it advanced.

    A fault in one request's postprocessing fails that request alone (see `failures`);
    raises EngineStateError when the bookkeeping did not survive such a fault."""
    sampler_out, beam_logprobs, prompt_logprobs = result
    faults: dict[str, str | GrammarError] = {}
    touched: dict[str, Request] = {}
    draws = iter(zip(sampler_out.token_ids, sampler_out.logprobs, strict=True))
    beam_rows = iter(beam_logprobs if beam_logprobs is not None else ())
    prompt_rows = iter(prompt_logprobs)
    beam_reqs: dict[str, Request] = {}
    for item in step.plan.scheduled:
        if item.num_prompt_logprobs:
            entries = next(prompt_rows)  # taken first: a fault cannot shift another's rows
            req = core._owner[item.seq.seq_id][0]
            guarded(core, faults, req, add_prompt_logprobs, req, item.seq, entries)
        # Proposed tokens count as computed once verified (speculation.take_verified).
        item.seq.num_computed_tokens += item.num_new_tokens - item.num_spec_tokens
        if not item.samples:
            continue
        req, sample = core._owner[item.seq.seq_id]
        if sample is None:
            req.beam.add_logprobs(item.seq, next(beam_rows))
            beam_reqs[req.request_id] = req
            continue
        # Rows are taken before anything can fail, so a fault cannot shift another's rows.
        if item.num_spec_tokens:
            taken = [next(draws) for _ in range(1 + item.num_spec_tokens)]
            guarded(core, faults, req, speculation.take_verified, core, req, sample, item, taken)
        else:
            taken = [next(draws) for _ in range(1 + len(drawing_children(req, sample)))]
            guarded(core, faults, req, take_samples, core, req, sample, taken)
        touched[req.request_id] = req
    for req in beam_reqs.values():
        if req.beam.ready and guarded(core, faults, req, beam_step, core, req):
            touched[req.request_id] = req  # beam search streams only its final result
    now = time.monotonic()
    outputs = [
        out for req in touched.values()
        if req.request_id not in faults and (out := guarded(core, faults, req, finish_output, core, req, now))
    ]
    fail_all(core, faults)
    return outputs


def add_prompt_logprobs(req: Request, seq: Sequence, entries: PromptLogprobs) -> None:
    """Adds the entries of prompt tokens num_computed_tokens + 1 onwards (this step's,
    before `seq` counts them computed). A sequence recomputing its prompt after a
    preemption gives again the entries it gave before: those are skipped, so each is
    delivered once. Complete, the sequence asks for no more (and may read the cache)."""
    collected = req.prompt_logprobs
    skip = len(collected) - (seq.num_computed_tokens + 1)
    if skip < 0:
        raise RuntimeError(f"prompt logprobs of {req.request_id!r} would skip prompt tokens")
    collected.extend(entries[skip:])
    if len(collected) == len(req.prompt_token_ids):
        seq.prompt_logprobs = None


def take_samples(core: EngineCore, req: Request, sample: Sample, draws: list[tuple[int, Any]]) -> None:
    targets = [sample, *fork_children(core, req, sample)]
    for target, (token, logprobs) in zip(targets, draws, strict=True):
        core._append_token(req, target, token, logprobs)


def fork_children(core: EngineCore, req: Request, parent: Sample) -> list[Sample]:
    """Samples 1..n-1 start as copies of sample 0 right after the prompt: they share all
    its blocks (refcounts), and the first write into the shared partial block copies it."""
    children = drawing_children(req, parent)
    if children:
        req.pending_children = []
    for child in children:
        core.block_manager.fork(parent.seq, child.seq)
        core.scheduler.add_running(child.seq)
    return children


def beam_step(core: EngineCore, req: Request) -> bool:
    """Advances a beam search whose live beams all have their log-probs; True once it ended
    (its samples then hold the best hypotheses)."""
    results = req.beam.advance(fork=lambda parent: fork_beam(core, req, parent), drop=lambda seq: drop_beam(core, seq))
    if results is None:
        return False
    skip = req.params.skip_special_tokens
    for sample, result in zip(req.samples, results, strict=True):
        sample.token_ids = result.token_ids
        sample.final_text = core.tokenizer.decode(result.token_ids, skip_special_tokens=skip)
        sample.finish_reason = result.finish_reason
    return True


def fork_beam(core: EngineCore, req: Request, parent: Sequence) -> Sequence:
    child = core._new_seq(req, parent.group_size, token_ids=parent.token_ids)
    core._owner[child.seq_id] = (req, None)
    if parent.status is SequenceStatus.RUNNING:
        core.block_manager.fork(parent, child)
        core.scheduler.add_running(child)
    else:  # parent preempted meanwhile: the child recomputes (mostly prefix-cache hits)
        core.scheduler.add_preempted(child)
    return child


def drop_beam(core: EngineCore, seq: Sequence) -> None:
    core.scheduler.remove(seq)
    core._owner.pop(seq.seq_id, None)


def finish_output(core: EngineCore, req: Request, now: float) -> RequestOutput:
    """The output of a request this step gave tokens (a beam search: its result)."""
    metrics = req.metrics
    if metrics.first_token_time is None:
        metrics.first_token_time = now
    if req.finished:
        metrics.finished_time = now
    output = make_output(req)
    if req.finished:
        core._release(req)
    return output


def guarded(core: EngineCore, faults: dict[str, str | GrammarError], req: Request, fn: Callable[..., T], *args) -> T | None:
    """Runs one request's postprocessing; a fault is logged and recorded for that request."""
    try:
        return fn(*args)
    except GrammarError as exc:
        # Its grammar refused a token its own mask allowed: the spec went past llguidance's
        # limits while decoding. The client's error, not an engine fault to log a trace for;
        # its cached grammar goes too (a spec that fails requests is not worth its memory).
        log.info("request %s failed by its grammar: %s", req.request_id, exc)
        if req.params.structured is not None:
            core.grammars.forget(req.params.structured, req.tenant)
        # Kept without its traceback: its frames hold the request (and its matchers' lexer
        # states) in a cycle that would live until the next full collection.
        faults.setdefault(req.request_id, exc.with_traceback(None))
        return None
    except Exception as exc:
        log.exception("postprocessing request %s failed", req.request_id)
        faults.setdefault(req.request_id, f"{type(exc).__name__}: {exc}")
        return None


def fail_all(core: EngineCore, faults: dict[str, str | GrammarError]) -> None:
    for request_id, why in faults.items():
        core.fail_request(request_id, why)
    if faults:
        core.audit()
