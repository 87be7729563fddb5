"""EngineCore: the synchronous engine. Intake, schedule, execute, postprocess.

`AsyncEngine` drives it from the event loop: `schedule` and `process` run on the loop thread
(pure Python, short), `execute` runs in a worker thread. Nothing here knows about asyncio.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from streamengine.beam_search import BeamSearchState
from streamengine.block_manager import BlockManager
from streamengine.config import EngineConfig
from streamengine.detokenizer import IncrementalDetokenizer
from streamengine.errors import LimitExceededError
from streamengine.kv_cache import plan_kv_cache
from streamengine.model_runner import ModelRunner
from streamengine.models import LoadedModel, load_model
from streamengine.outputs import CompletionOutput, RequestOutput
from streamengine.sampling import SamplerOutput, SamplingParams, SamplingRow
from streamengine.scheduler import PreemptionPolicy, Scheduler, SchedulerOutput
from streamengine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineStateError(RuntimeError):
    """The block manager's or scheduler's bookkeeping is inconsistent: the core must restart."""


@dataclass(slots=True, eq=False)
class Request:
    """One prompt and its n samples; sample i is `seqs[i]`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    rows: list[SamplingRow]
    logprobs: list[list[dict[int, float]]] | None
    finish_reasons: list[str | None]
    stop_reasons: list[int | str | None]
    arrival_time: float
    max_tokens: int  # params.max_tokens, or what max_tokens=None resolves to (cap, context)
    stop_ids: frozenset[int]  # params.stop_token_ids as a set: one lookup per sampled token
    num_cached_tokens: int = 0
    pending_children: list[Sequence] = field(default_factory=list)  # forked after the prompt
    beam: BeamSearchState | None = None  # beam search: `seqs` are the live beams
    beam_pending: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> logprobs
    beam_results: list[list[int]] = field(default_factory=list)  # best finished beams

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.finish_reasons)


@dataclass(slots=True)
class StepPlan:
    """The scheduler's plan plus who samples from which logits row (n > 1 shares a row)."""

    plan: SchedulerOutput
    rows: list[SamplingRow] = field(default_factory=list)
    row_sources: list[int] = field(default_factory=list)  # logits row of each sampling row
    beam_sources: list[int] = field(default_factory=list)  # logits rows of beam-search beams
    num_logits: int = 0


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = pick_device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.loaded = loaded or load_model(config.model, config.dtype, str(self.device), config.cache_dir)
        self.tokenizer = self.loaded.tokenizer
        self.kv_spec = plan_kv_cache(config, self.loaded.model.config)
        self.runner = ModelRunner(self.loaded, config, self.device, self.kv_spec)
        self.block_manager, self.scheduler = self._fresh_bookkeeping()
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = self._eos_token_ids()
        self.vocab_size = self.loaded.model.config.vocab_size
        self.requests: dict[str, Request] = {}
        self._seq_of: dict[int, tuple[Request, int]] = {}  # seq_id -> (request, sample index)
        self._seq_ids = itertools.count()
        # Requests ended by a fault in their own processing, with why; the engine takes them
        # (take_failures) and ends their streams with RequestFailedError.
        self.failures: dict[str, str] = {}

    def _fresh_bookkeeping(self) -> tuple[BlockManager, Scheduler]:
        """An empty block manager (no cached prefixes) and scheduler over the runner's pool."""
        config = self.config
        block_manager = BlockManager(
            self.kv_spec.num_blocks, config.block_size, config.enable_prefix_caching,
            num_cpu_blocks=self.kv_spec.num_cpu_blocks,
        )
        scheduler = Scheduler(
            block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            self._preemption_policy(), max_prefill_chunk=config.max_prefill_chunk,
        )
        return block_manager, scheduler

    def reset(self) -> list[str]:
        """Restarts the bookkeeping in place after a fault that leaves it untrusted: every
        request is dropped, a fresh block manager and scheduler take over. The model, the
        runner and its KV tensors stay (their contents are never read again: nothing is
        cached). Returns the ids of the requests that were dropped."""
        dropped = list(self.requests)
        self.block_manager, self.scheduler = self._fresh_bookkeeping()
        self.requests.clear()
        self._seq_of.clear()
        return dropped

    # -- intake --------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = self._tokenize(prompt)
        self._check_length(len(prompt_ids), params)
        stop_ids = self._stop_ids(params)
        max_tokens = self._max_tokens(len(prompt_ids), params)
        now = time.monotonic()
        num_seqs = 1 if params.use_beam_search else params.n
        group = params.beam_width if params.use_beam_search else params.n
        seqs = [
            Sequence(next(self._seq_ids), request_id, prompt_ids, cache_salt, now, group_size=group)
            for _ in range(num_seqs)
        ]
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            seqs=seqs,
            detoks=[IncrementalDetokenizer(self.tokenizer, prompt_ids, params) for _ in range(params.n)],
            rows=[
                SamplingRow(params, _sample_generator(params, i, self.device), prompt_ids, [])
                for i in range(num_seqs)
            ],
            logprobs=[[] for _ in range(params.n)] if params.logprobs is not None else None,
            finish_reasons=[None] * params.n,
            stop_reasons=[None] * params.n,
            arrival_time=now,
            max_tokens=max_tokens,
            stop_ids=stop_ids,
        )
        req.pending_children = seqs[1:]  # forked from sample 0 once its prompt is computed
        if params.use_beam_search:
            req.beam = self._beam_state(req)
        self.requests[request_id] = req
        for i, seq in enumerate(seqs):
            self._seq_of[seq.seq_id] = (req, i)
        self.scheduler.add(seqs[0])
        return req

    def _beam_state(self, req: Request) -> BeamSearchState:
        params, prompt_len = req.params, len(req.prompt_token_ids)
        stops = req.stop_ids if params.ignore_eos else req.stop_ids | self.eos_token_ids
        return BeamSearchState(
            width=params.beam_width,
            prompt_len=prompt_len,
            max_length=min(prompt_len + req.max_tokens, self.max_model_len),
            stop_token_ids=stops,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The request's stop token ids as a set (a set, not a list scan: a long list must not
        stall the event loop), each checked against this model's vocabulary."""
        stop_ids = frozenset(params.stop_token_ids)
        if stop_ids and max(stop_ids) >= self.vocab_size:
            raise ValueError(
                f"stop_token_ids must be < the model's vocabulary size ({self.vocab_size}), "
                f"got {max(stop_ids)}"
            )
        return stop_ids

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's output limit: its own max_tokens (refused above the engine's cap), or
        for max_tokens=None the cap or the room left in the context, whichever is smaller."""
        cap = self.config.max_tokens_cap
        if params.max_tokens is None:
            room = self.max_model_len - prompt_len
            return room if cap is None else min(cap, room)
        if cap is not None and params.max_tokens > cap:
            raise LimitExceededError(
                "max_tokens_cap",
                f"max_tokens ({params.max_tokens}) exceeds this engine's limit of {cap} output "
                f"tokens per request (EngineConfig.max_tokens_cap)",
            )
        return params.max_tokens

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t!r} is out of range [0, {self.vocab_size})")
        return list(prompt)

    def _check_length(self, prompt_len: int, params: SamplingParams) -> None:
        room = self.max_model_len - prompt_len
        wanted = params.max_tokens if params.max_tokens is not None else 1
        if wanted > room:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({wanted}) exceeds the maximum "
                f"context length of {self.max_model_len} tokens (model context and KV pool of "
                f"{self.block_manager.num_blocks} blocks x {self.config.block_size})"
            )

    def _preemption_policy(self) -> PreemptionPolicy:
        """Rough per-device costs for "auto": recompute = 2 FLOPs per parameter per token,
        swap = a block's bytes over the host link. Only their ratio matters."""
        params = sum(p.numel() for p in self.loaded.model.parameters())
        flops, link_bytes_s = (50e12, 20e9) if self.device.type == "cuda" else (80e9, 10e9)
        block_bytes = self.kv_spec.bytes_per_block
        return PreemptionPolicy(
            mode=self.config.preemption_mode,
            recompute_cost_per_token=2 * params / flops,
            swap_cost_per_block=block_bytes / link_bytes_s,
        )

    def _max_model_len(self) -> int:
        pool = self.block_manager.num_blocks * self.config.block_size
        model = getattr(self.loaded.model.config, "max_position_embeddings", None) or pool
        limit = min(pool, model)
        return min(limit, self.config.max_model_len) if self.config.max_model_len else limit

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.loaded.model, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return ids

    # -- abort ---------------------------------------------------------------------------

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        # One finish reason per returned sample (n); beam search has more live beams than
        # that, and _release frees every one of them.
        for i in range(req.params.n):
            if req.finish_reasons[i] is None:
                req.finish_reasons[i] = reason
                req.detoks[i].finish()
        self._release(req)
        return self._output(req)

    def fail_request(self, request_id: str, why: str) -> None:
        """Ends a request after a fault in its own processing (postprocess, abort), even one
        that left it half released. Gives back whatever blocks it can; audit() then tells
        whether the bookkeeping survived."""
        req = self.requests.pop(request_id, None)
        self.failures[request_id] = why  # its stream ends with the error either way
        for seq in self._request_seqs(request_id, req):
            try:
                self.scheduler.remove(seq)  # idempotent: a freed sequence holds no blocks
            except Exception:
                log.exception("releasing sequence %d of failed request %s", seq.seq_id, request_id)
            self._seq_of.pop(seq.seq_id, None)

    def _request_seqs(self, request_id: str, req: Request | None) -> list[Sequence]:
        """The request's sequences, including any the scheduler still holds that a
        half-finished step did not record in `req.seqs` (or after `req` was dropped)."""
        seqs = {seq.seq_id: seq for seq in (req.seqs if req is not None else ())}
        for seq in self._queued_seqs():
            if seq.request_id == request_id:
                seqs.setdefault(seq.seq_id, seq)
        return list(seqs.values())

    def _queued_seqs(self) -> Iterator[Sequence]:
        sched = self.scheduler
        return itertools.chain(sched.running, sched.swapped, sched.waiting)

    def take_failures(self) -> dict[str, str]:
        failures, self.failures = self.failures, {}
        return failures

    def audit(self) -> None:
        """Raises EngineStateError unless every block's refcount equals the number of queued
        sequences whose block table holds it, every host block is free or held once, and every
        queued sequence belongs to a live request. O(blocks + tokens' blocks): run after faults."""
        bm = self.block_manager
        counts = [0] * bm.num_blocks
        num_cpu_held = 0
        for seq in self._queued_seqs():
            if seq.seq_id not in self._seq_of:
                raise EngineStateError(f"sequence {seq.seq_id} of request {seq.request_id!r} is queued but not live")
            for block_id in seq.block_table:
                counts[block_id] += 1
            num_cpu_held += len(seq.cpu_block_table)
        if [b.ref_cnt for b in bm.blocks] != counts or bm.num_free_blocks != counts.count(0):
            raise EngineStateError("KV block refcounts do not match the sequences' block tables")
        if num_cpu_held + bm.num_free_cpu_blocks != bm.num_cpu_blocks:
            raise EngineStateError("host swap blocks are lost or held twice")

    def _release(self, req: Request) -> None:
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
            self._seq_of.pop(seq.seq_id, None)
        self.requests.pop(req.request_id, None)

    # -- one step ------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        step = StepPlan(plan)
        for item in plan.scheduled:
            if not item.samples:
                continue
            source = step.num_logits
            step.num_logits += 1
            req, i = self._seq_of[item.seq.seq_id]
            if req.beam is not None:
                step.beam_sources.append(source)
                continue
            step.rows.append(self._row(item.seq))
            step.row_sources.append(source)
            if i == 0 and req.pending_children:
                # The prompt's last logits are shared: every child draws its first token
                # from them with its own generator, then forks the parent's blocks.
                for child in req.pending_children:
                    step.rows.append(self._row(child))
                    step.row_sources.append(source)
        return step

    def _row(self, seq: Sequence) -> SamplingRow:
        req, i = self._seq_of[seq.seq_id]
        row = req.rows[i]
        if req.params.has_penalties:  # only penalties read the history: no copy per decode step otherwise
            row.output_token_ids = seq.output_token_ids
        return row

    def execute(self, step: StepPlan) -> tuple[SamplerOutput, torch.Tensor | None]:
        return self.runner.execute(step.plan, step.rows, step.row_sources, step.beam_sources)

    def step(self) -> list[RequestOutput]:
        """Synchronous convenience: one full step (used by tests and benchmarks)."""
        step = self.schedule()
        if step.plan.is_empty:
            return []
        return self.process(step, self.execute(step))

    def process(self, step: StepPlan, result: tuple[SamplerOutput, torch.Tensor | None]) -> list[RequestOutput]:
        """Appends the step's tokens and returns the outputs of the requests it advanced.

        A fault in one request's postprocessing fails that request alone (see `failures`);
        raises EngineStateError when the bookkeeping did not survive such a fault."""
        sampler_out, beam_logprobs = result
        touched: dict[str, Request] = {}
        faults: dict[str, str] = {}
        sampled = iter(zip(sampler_out.token_ids, sampler_out.logprobs, strict=True))
        beam_rows = iter(beam_logprobs if beam_logprobs is not None else ())
        beam_reqs: dict[str, Request] = {}
        for item in step.plan.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if not item.samples:
                continue
            req, i = self._seq_of[seq.seq_id]
            if req.beam is not None:
                req.beam_pending[seq.seq_id] = next(beam_rows)
                beam_reqs[req.request_id] = req
                continue
            # Rows are taken before anything can fail, so a fault cannot shift another's rows.
            draws = [next(sampled) for _ in range(1 + (len(req.pending_children) if i == 0 else 0))]
            self._guarded(faults, req, self._take_samples, req, i, seq, draws)
            touched[req.request_id] = req
        for req in beam_reqs.values():
            if len(req.beam_pending) == len(req.seqs) and self._guarded(faults, req, self._beam_step, req):
                touched[req.request_id] = req  # beam search streams only its final result
        outputs = [
            out for req in touched.values()
            if req.request_id not in faults and (out := self._guarded(faults, req, self._finish_output, req))
        ]
        self._fail_all(faults)
        return outputs

    def _take_samples(self, req: Request, i: int, seq: Sequence, draws: list[tuple[int, Any]]) -> None:
        children = self._fork_children(req, i, seq)
        targets = [(seq, i), *((c, self._seq_of[c.seq_id][1]) for c in children)]
        for (s, index), (token, logprobs) in zip(targets, draws, strict=True):
            self._append_token(req, index, s, token, logprobs)

    def _finish_output(self, req: Request) -> RequestOutput:
        output = self._output(req)
        if req.finished:
            self._release(req)
        return output

    def _guarded(self, faults: dict[str, str], req: Request, fn: Callable[..., T], *args) -> T | None:
        """Runs one request's postprocessing; a fault is logged and recorded for that request."""
        try:
            return fn(*args)
        except Exception as exc:
            log.exception("postprocessing request %s failed", req.request_id)
            faults.setdefault(req.request_id, f"{type(exc).__name__}: {exc}")
            return None

    def _fail_all(self, faults: dict[str, str]) -> None:
        for request_id, why in faults.items():
            self.fail_request(request_id, why)
        if faults:
            self.audit()

    def _beam_step(self, req: Request) -> bool:
        """Advances a beam request once every live beam has its next-token log-probs.
        Returns True when the search is over."""
        live = req.seqs
        logprobs = torch.stack([req.beam_pending.pop(s.seq_id) for s in live])  # [beams, vocab]
        step = req.beam.step([s.output_token_ids for s in live], logprobs)
        if step.done:
            req.beam_results = [list(t) for t in req.beam.finished_tokens[: req.params.n]]
            for i, tokens in enumerate(req.beam_results):
                stopped = bool(tokens) and tokens[-1] in req.beam.stop_token_ids
                req.finish_reasons[i] = "stop" if stopped else "length"
            for i in range(len(req.beam_results), req.params.n):
                req.finish_reasons[i] = "length"
            return True
        first_use: dict[int, int] = {}
        new_beams: list[Sequence] = []
        for j, parent_index in enumerate(step.parents):  # forks first: they copy the parent
            if parent_index in first_use:
                new_beams.append(self._fork_beam(req, live[parent_index]))
            else:
                first_use[parent_index] = j
                new_beams.append(live[parent_index])  # the first child continues in place
        for seq, token in zip(new_beams, step.tokens, strict=True):
            seq.token_ids.append(token)
        for index, seq in enumerate(live):
            if index not in first_use:  # a dropped beam frees its blocks
                self.scheduler.remove(seq)
                self._seq_of.pop(seq.seq_id, None)
        req.seqs = new_beams
        for index, seq in enumerate(new_beams):
            self._seq_of[seq.seq_id] = (req, index)
        return False

    def _fork_beam(self, req: Request, parent: Sequence) -> Sequence:
        child = Sequence(
            next(self._seq_ids), req.request_id, req.prompt_token_ids, parent.cache_salt,
            parent.arrival_time, token_ids=list(parent.token_ids), group_size=parent.group_size,
        )
        if parent.status is SequenceStatus.RUNNING:
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
        else:  # parent preempted meanwhile: the child recomputes (mostly prefix-cache hits)
            self.scheduler.add_preempted(child)
        return child

    def _fork_children(self, req: Request, i: int, parent: Sequence) -> list[Sequence]:
        """Samples 1..n-1 start as copies of sample 0 right after the prompt: they share all
        its blocks (refcounts), and the first write into the shared partial block copies it."""
        if i != 0 or not req.pending_children:
            return []
        children, req.pending_children = req.pending_children, []
        for child in children:
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
        return children

    def fail(self, step: StepPlan) -> list[RequestOutput]:
        """A step raised: end the requests it touched with "error", keep the engine going.
        Blocks registered for this step may hold no K/V: forget all cached content."""
        self.block_manager.reset_prefix_cache()
        failed = {
            self._seq_of[s.seq.seq_id][0].request_id
            for s in step.plan.scheduled
            if s.seq.seq_id in self._seq_of
        }
        return [o for rid in failed if (o := self.abort_request(rid, reason="error")) is not None]

    def _append_token(self, req: Request, i: int, seq: Sequence, token: int, logprobs) -> None:
        seq.token_ids.append(token)
        if req.logprobs is not None:
            req.logprobs[i].append(logprobs)
        reason, stop = self._stop_reason(req, i, seq, token)
        if reason is not None:
            req.finish_reasons[i], req.stop_reasons[i] = reason, stop
            req.detoks[i].finish()
            self.scheduler.remove(seq)

    def _stop_reason(self, req: Request, i: int, seq: Sequence, token: int) -> tuple[str | None, int | str | None]:
        params = req.params
        stop_str = req.detoks[i].add_tokens([token])
        num_out = seq.num_output_tokens
        past_min = num_out >= params.min_tokens
        if past_min and not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if past_min and token in req.stop_ids:
            return "stop", token
        if stop_str is not None:
            return "stop", stop_str
        if num_out >= req.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _output(self, req: Request) -> RequestOutput:
        if req.beam is not None:
            return self._beam_output(req)
        completions = [
            CompletionOutput(
                index=i,
                text=req.detoks[i].text,
                token_ids=seq.output_token_ids,
                finish_reason=req.finish_reasons[i],
                logprobs=list(req.logprobs[i]) if req.logprobs is not None else None,
                stop_reason=req.stop_reasons[i],
            )
            for i, seq in enumerate(req.seqs)
        ]
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
        )

    def _beam_output(self, req: Request) -> RequestOutput:
        completions = []
        for i in range(req.params.n):
            tokens = req.beam_results[i] if i < len(req.beam_results) else []
            text = self.tokenizer.decode(tokens, skip_special_tokens=req.params.skip_special_tokens)
            completions.append(CompletionOutput(i, text, tokens, req.finish_reasons[i]))
        return RequestOutput(
            req.request_id, req.prompt_token_ids, completions, req.finished,
            req.seqs[0].num_cached_tokens if req.seqs else 0,
        )

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        bm = self.block_manager
        return {
            "num_total_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_blocks": len(bm.cached),
            # Sharing: physical blocks in use vs the block-table entries that point at them.
            "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
            "num_logical_blocks": sum(len(s.block_table) for s in self._live_seqs()),
            "kv_cache_usage": bm.usage(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_requests": len(self.requests),
            "prefix_cache_queries": bm.stats.queries,
            "prefix_cache_hits": bm.stats.hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped": len(self.scheduler.swapped),
            "num_swap_outs": self.scheduler.num_swap_outs,
            "num_swap_blocks": bm.num_cpu_blocks,
            "num_swap_blocks_free": bm.num_free_cpu_blocks,
            "block_size": bm.block_size,
            "max_model_len": self.max_model_len,
        }

    def _live_seqs(self):
        for req in self.requests.values():
            for seq in req.seqs:
                if not seq.is_finished:
                    yield seq

    def kv_state(self) -> dict:
        bm = self.block_manager
        return {"block_size": bm.block_size, "num_blocks": bm.num_blocks, "blocks": bm.block_states()}


def _sample_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    """Sample i of a seeded request draws from its own stream (seed + i): reproducible
    whatever else is in the batch."""
    if params.seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed((params.seed + index) & 0xFFFF_FFFF_FFFF_FFFF)
