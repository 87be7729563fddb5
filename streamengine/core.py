"""EngineCore: the synchronous engine. Intake, schedule, execute, process.

`AsyncEngine` drives it from the event loop: `schedule` and `process` run on the loop thread
(pure Python, short), `execute` runs in a worker thread. Nothing here knows about asyncio.
One step: the scheduler picks tokens (`schedule`), the runner computes them and samples
(`execute`), then each sampled token is appended to its sample, stop rules decide who is done,
and the output processor turns each advanced request into its next output (`process`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from streamengine.beam_search import BeamSearch, BeamSearchState
from streamengine.block_hash import prompt_block_hashes
from streamengine.block_manager import BlockManager
from streamengine.config import EngineConfig
from streamengine.detokenizer import IncrementalDetokenizer
from streamengine.errors import GrammarError
from streamengine.grammar import CompiledGrammar, GrammarMatcher
from streamengine.grammar_cache import HeapTrim
from streamengine.grammar_compiler import GrammarCompiler
from streamengine.grammar_mask import MaskAccount
from streamengine.intake import Intake
from streamengine.kv_cache import plan_kv_cache
from streamengine.kv_events import KVCacheEvent
from streamengine.model_runner import ModelRunner, PromptLogprobs
from streamengine.models import LoadedModel, load_model
from streamengine.output_processor import make_output
from streamengine.outputs import RequestOutput
from streamengine.pinning import Pin, Pins
from streamengine.request import Request, Sample
from streamengine.sampler import SamplerOutput, SamplingRow, sample_generator
from streamengine.sampling_params import SamplingParams
from streamengine.scheduler import PreemptionPolicy, Scheduler, SchedulerOutput
from streamengine.sequence import Sequence, SequenceStatus
from streamengine.stop_rules import StopRules
from streamengine.tenants import DEFAULT_TENANT, TenantConfig, Tenants

log = logging.getLogger(__name__)
T = TypeVar("T")
# Sampled tokens; beams' log-probs; prompt logprobs of each sequence that asked, in plan order.
StepResult = tuple[SamplerOutput, torch.Tensor | None, list[PromptLogprobs]]


class EngineStateError(RuntimeError):
    """The block manager's or scheduler's bookkeeping is inconsistent: the core must restart."""


@dataclass(slots=True)
class StepPlan:
    """The scheduler's plan plus who samples from which logits row (n > 1 shares a row)."""

    plan: SchedulerOutput
    rows: list[SamplingRow] = field(default_factory=list)
    row_sources: list[int] = field(default_factory=list)  # logits row of each sampling row
    beam_sources: list[int] = field(default_factory=list)  # logits rows of beam-search beams
    beam_matchers: list[GrammarMatcher | None] = field(default_factory=list)  # each beam's grammar
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
        self.tenants = Tenants(config.tenants)
        self.block_manager, self.scheduler = self._fresh_bookkeeping()
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = eos_token_ids(self.loaded)
        self.vocab_size = self.loaded.model.config.vocab_size
        pool = f"{self.kv_spec.num_blocks} blocks x {config.block_size}"
        self.intake = Intake(self.tokenizer, self.vocab_size, self.max_model_len, config.max_tokens_cap, pool)
        self.stop_rules = StopRules(frozenset(self.eos_token_ids), self.max_model_len)
        self.grammars = GrammarCompiler(
            self.tokenizer, self.vocab_size, config.grammar_compile_timeout_s, config.grammar_cache_bytes,
            max_queued_per_tenant=config.grammar_max_queued_per_tenant, max_queued=config.grammar_max_queued,
            queue_timeout_s=config.grammar_queue_timeout_s,
        )
        self.pins = Pins(config.block_size)
        self.requests: dict[str, Request] = {}
        # Every live sequence's request, and its sample (None for a beam of a beam search).
        self._owner: dict[int, tuple[Request, Sample | None]] = {}
        self._seq_ids = itertools.count()
        # Requests ended by a fault in their own processing, with why; the engine takes them
        # (take_failures) and ends their streams with RequestFailedError, or with the error
        # itself when it is the request's own (a grammar that gave out while decoding).
        self.failures: dict[str, str | GrammarError] = {}
        self._heap_trim = HeapTrim()
        self._grammar_freed = False  # a request with a grammar ended since the last trim

    def _fresh_bookkeeping(self) -> tuple[BlockManager, Scheduler]:
        """An empty block manager (no cached prefixes) and scheduler over the KV pool."""
        config, kv = self.config, self.kv_spec
        block_manager = BlockManager(
            kv.num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks=kv.num_cpu_blocks,
            weight_of=self._tenant_weight, tenant_fair_eviction=config.tenant_fair_eviction,
        )
        scheduler = Scheduler(
            block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            self._preemption_policy(), max_prefill_chunk=config.max_prefill_chunk,
            policy=config.scheduling_policy, tenants=self.tenants,
            prompt_token_weight=config.fair_prompt_token_weight,
            output_token_weight=config.fair_output_token_weight,
            retain_waiting_prefixes=config.retain_waiting_prefixes,
        )
        return block_manager, scheduler

    def _tenant_weight(self, tenant: str) -> float:
        """A tenant's weight; 1 for names no request used (a block shared by several)."""
        return self.tenants.get(tenant).weight if tenant in self.tenants else 1.0

    def reset(self) -> list[str]:
        """Restarts the bookkeeping in place after a fault that leaves it untrusted: every
        request is dropped, a fresh block manager and scheduler take over. The model, the
        runner and its KV tensors stay (their contents are never read again: nothing is
        cached). Returns the ids of the requests that were dropped."""
        dropped = list(self.requests)
        old = self.block_manager
        self.block_manager, self.scheduler = self._fresh_bookkeeping()
        if old.kv_events is not None:  # subscribers knew the old blocks: they are all gone
            self.block_manager.record_kv_events(old.kv_medium, cleared=True)
        self.requests.clear()
        self._owner.clear()
        self.pins.clear()  # their blocks went with the old block manager
        return dropped

    def _preemption_policy(self) -> PreemptionPolicy:
        """Rough per-device costs for "auto": recompute = 2 FLOPs per parameter per token,
        swap = a block's bytes over the host link. Only their ratio matters."""
        params = sum(p.numel() for p in self.loaded.model.parameters())
        flops, link_bytes_s = (50e12, 20e9) if self.device.type == "cuda" else (80e9, 10e9)
        return PreemptionPolicy(
            mode=self.config.preemption_mode,
            recompute_cost_per_token=2 * params / flops,
            swap_cost_per_block=self.kv_spec.bytes_per_block / link_bytes_s,
        )

    def _max_model_len(self) -> int:
        pool = self.kv_spec.num_blocks * self.config.block_size
        model = getattr(self.loaded.model.config, "max_position_embeddings", None) or pool
        limit = min(pool, model)
        return min(limit, self.config.max_model_len) if self.config.max_model_len else limit

    # -- intake --------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        cache_salt: str | None = None, tenant: str | None = None, pin: Pin | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> Request:
        """Queues a request of `tenant` (None: the default tenant); `cache_salt` is a per-user
        salt for what follows the tenant's pinned prefixes. A `pin` request pins its prompt's
        full blocks when it ends. `grammar` is `params.structured` compiled (compiled here,
        blocking, when not given). Raises ValueError (LimitExceededError, GrammarError) for a
        bad request, TenantRateLimitError past the tenant's tokens per minute."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params.clone()  # the caller may edit or reuse its object while this runs
        tenant = tenant if tenant is not None else DEFAULT_TENANT
        self.tenants.check_width(tenant, params.n, params.beam_width)
        self.tenants.check_rate(tenant)
        prompt_ids = self.intake.prompt_ids(prompt)
        self.intake.check_length(len(prompt_ids), params)
        self.intake.check_logit_bias(params)
        stop_ids = self.intake.stop_ids(params)
        segments = self._salt_segments(prompt_ids, tenant, cache_salt, pin)
        max_tokens = self._fit_beside_pins(prompt_ids, segments, self.intake.max_tokens(len(prompt_ids), params),
                                           explicit=params.max_tokens is not None,
                                           reads_cache=params.prompt_logprobs is None)
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured, tenant)
        req = Request(
            request_id, prompt_ids, params, samples=[], arrival_time=time.monotonic(), max_tokens=max_tokens,
            stop_ids=stop_ids, tenant=tenant, pin=pin, salt_segments=segments,
        )
        if params.use_beam_search:
            self._start_beam_search(req, grammar)
        else:
            self._start_samples(req, grammar)
        self.requests[request_id] = req
        self._want_prompt_logprobs(req)
        self.scheduler.add(req.seqs[0])
        self.tenants.record(tenant, len(prompt_ids))
        return req

    def _want_prompt_logprobs(self, req: Request) -> None:
        """Starts collecting the prompt's logprobs when asked: the first entry has no context;
        the first sequence (the one that computes the prompt) computes the others."""
        if req.params.prompt_logprobs is None:
            return
        req.prompt_logprobs = [None]
        if len(req.prompt_token_ids) > 1:
            req.seqs[0].prompt_logprobs = req.params.prompt_logprobs

    def _fit_beside_pins(self, prompt_ids: list[int], segments: tuple, max_tokens: int, explicit: bool,
                         reads_cache: bool = True) -> int:
        """The request's max_tokens, fitted to the pool beside the pinned prefixes (plus the
        pinned blocks it hits): intake checks lengths against the whole pool, and a request
        needing more would wait, or preempt itself, forever. An implicit max_tokens (None:
        the room left in the context) shrinks to what fits; an explicit one that does not
        fit, or a prompt that does not, is refused."""
        bm, bs = self.block_manager, self.block_manager.block_size
        room = self.scheduler.room_for_one()
        if not bm.num_pinned_blocks or bm.blocks_needed(len(prompt_ids) + max_tokens) <= room:
            return max_tokens  # hits on pinned blocks can only lower the need
        # The last prompt token is always computed; a request wanting its prompt's logprobs
        # computes them all (Sequence.reads_prefix_cache).
        max_hits = (len(prompt_ids) - 1) // bs if reads_cache else 0
        hits = bm.num_pinned_hits(prompt_block_hashes(prompt_ids[: max_hits * bs], bs, segments, _seq_salt(segments)))
        fits = (room + hits) * bs - len(prompt_ids)
        if fits >= max_tokens or (not explicit and fits >= 1):
            return min(max_tokens, fits)
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) needs "
            f"{bm.blocks_needed(len(prompt_ids) + max_tokens) - hits} KV blocks of {bs} tokens, but only {room} "
            f"of the pool's {bm.num_blocks} blocks are free of pinned prefixes"
        )

    def fail_unfittable(self) -> bool:
        """Fails, each alone, the queued requests that cannot start even in a pool holding
        nothing else: prefixes pinned after they arrived took the room they need. What the
        engine does with a step that schedules nothing while work is pending; False if no
        request is in that case (the step was empty for some other reason)."""
        stuck = {seq.request_id for seq in self.scheduler.unfittable()}
        bm = self.block_manager
        for request_id in stuck:
            self.fail_request(request_id, f"the request no longer fits in the KV pool: "
                                          f"{bm.num_pinned_blocks} of its {bm.num_blocks} blocks are pinned")
        return bool(stuck)

    def _salt_segments(self, prompt_ids: list[int], tenant: str, user_salt: str | None, pin: Pin | None):
        if pin is not None and pin.info.shared:
            return ((0, None),)  # a shared prefix: hashed without any salt
        return self.pins.segments(prompt_ids, tenant, self.tenants.get(tenant).salt, user_salt)

    def block_hashes(self, prompt: str | list[int], tenant: str | None = None, cache_salt: str | None = None) -> list[bytes]:
        """The hashes of every full block of `prompt` as a request of `tenant` with this
        per-user `cache_salt` would compute them now (the pins in place decide its salt
        segments, as in add_request). Registers no tenant."""
        tenant = tenant if tenant is not None else DEFAULT_TENANT
        prompt_ids = self.intake.prompt_ids(prompt)
        config = self.tenants.get(tenant) if tenant in self.tenants else TenantConfig(tenant)
        segments = self.pins.segments(prompt_ids, tenant, config.salt, cache_salt)
        return prompt_block_hashes(prompt_ids, self.config.block_size, segments, _seq_salt(segments))

    def _start_samples(self, req: Request, grammar: CompiledGrammar | None) -> None:
        params, prompt_ids = req.params, req.prompt_token_ids
        early_stops: frozenset[int] = frozenset()  # what min_tokens keeps the sampler from drawing
        if params.min_tokens > 0:
            early_stops = req.stop_ids if params.ignore_eos else req.stop_ids | self.eos_token_ids
        account = self._mask_account(req)  # every sample's masks count against one budget
        for i in range(params.n):
            seq = self._new_seq(req, group_size=params.n)
            sample = Sample(
                i, seq, IncrementalDetokenizer(self.tokenizer, prompt_ids, params),
                logprobs=[] if params.logprobs is not None else None,
            )
            # The row reads the sample's own token list, so penalties never need a copy.
            sample.row = SamplingRow(
                params, sample_generator(params, i, self.device), prompt_ids, sample.token_ids,
                matcher=grammar.matcher(account) if grammar is not None else None, min_tokens_stop_ids=early_stops,
            )
            req.samples.append(sample)
            self._owner[seq.seq_id] = (req, sample)
        req.pending_children = req.samples[1:]  # forked from sample 0 once its prompt is computed

    def _start_beam_search(self, req: Request, grammar: CompiledGrammar | None) -> None:
        params = req.params
        req.samples = [Sample(i) for i in range(params.n)]  # filled when the search ends
        first = self._new_seq(req, group_size=params.beam_width)
        # A complete grammar allows only the end of sequence, so with one it always ends a beam.
        eos_stops = not params.ignore_eos or grammar is not None
        stops = req.stop_ids | self.eos_token_ids if eos_stops else req.stop_ids
        prompt_len = len(req.prompt_token_ids)
        state = BeamSearchState(
            width=params.beam_width,
            prompt_len=prompt_len,
            max_length=min(prompt_len + req.max_tokens, self.max_model_len),
            stop_token_ids=stops,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )
        matcher = grammar.matcher(self._mask_account(req)) if grammar is not None else None
        req.beam = BeamSearch(state, first, params.n, matcher)
        self._owner[first.seq_id] = (req, None)

    def _mask_account(self, req: Request) -> MaskAccount:
        return MaskAccount(req.tenant, self.config.grammar_mask_budget_ms / 1e3)

    def _new_seq(self, req: Request, group_size: int, token_ids: list[int] | None = None) -> Sequence:
        segments = req.salt_segments
        return Sequence(
            next(self._seq_ids), req.request_id, req.prompt_token_ids, _seq_salt(segments),
            req.arrival_time, token_ids=list(token_ids or ()), group_size=group_size,
            tenant=req.tenant, salt_segments=segments,
        )

    # -- abort and failure ---------------------------------------------------------------

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for sample in req.samples:
            if not sample.finished:
                sample.finish(reason)
        req.metrics.finished_time = time.monotonic()
        self._release(req)
        return make_output(req)

    def fail_request(self, request_id: str, why: str | GrammarError) -> None:
        """Ends a request after a fault in its own processing (postprocess, abort), even one
        that left it half released. Gives back whatever blocks it can; audit() then tells
        whether the bookkeeping survived."""
        req = self.requests.pop(request_id, None)
        self.failures[request_id] = why  # its stream ends with the error either way
        self._grammar_freed |= req is not None and req.params.structured is not None
        for seq in self._request_seqs(request_id, req):
            try:
                self.scheduler.remove(seq)  # idempotent: a freed sequence holds no blocks
            except Exception:
                log.exception("releasing sequence %d of failed request %s", seq.seq_id, request_id)
            self._owner.pop(seq.seq_id, None)

    def _request_seqs(self, request_id: str, req: Request | None) -> list[Sequence]:
        """The request's sequences, including any the scheduler still holds that a
        half-finished step did not record in the request (or after `req` was dropped)."""
        seqs = {seq.seq_id: seq for seq in (req.seqs if req is not None else ())}
        for seq in self._queued_seqs():
            if seq.request_id == request_id:
                seqs.setdefault(seq.seq_id, seq)
        return list(seqs.values())

    def _queued_seqs(self) -> Iterator[Sequence]:
        sched = self.scheduler
        return itertools.chain(sched.running, sched.swapped, sched.waiting)

    def take_failures(self) -> dict[str, str | GrammarError]:
        failures, self.failures = self.failures, {}
        return failures

    def audit(self) -> None:
        """Raises EngineStateError unless every block's refcount equals its pins plus the
        number of queued sequences whose block table holds it, every host block is free or held
        once, and every queued sequence belongs to a live request. O(blocks + tokens' blocks):
        run after faults."""
        bm = self.block_manager
        counts = [0] * bm.num_blocks
        num_cpu_held = 0
        for seq in self._queued_seqs():
            if seq.seq_id not in self._owner:
                raise EngineStateError(f"sequence {seq.seq_id} of request {seq.request_id!r} is queued but not live")
            for block_id in seq.block_table:
                counts[block_id] += 1
            num_cpu_held += len(seq.cpu_block_table)
        for pin in self.pins.all():
            for block_id in pin.block_ids:
                counts[block_id] += 1
        if [b.ref_cnt for b in bm.blocks] != counts or bm.num_free_blocks != counts.count(0):
            raise EngineStateError("KV block refcounts do not match the sequences' block tables")
        if num_cpu_held + bm.num_free_cpu_blocks != bm.num_cpu_blocks:
            raise EngineStateError("host swap blocks are lost or held twice")

    def _release(self, req: Request) -> None:
        self._grammar_freed |= req.params.structured is not None
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
            self._owner.pop(seq.seq_id, None)
        self.requests.pop(req.request_id, None)

    def trim_heap(self) -> None:
        """Once requests with grammars have ended (their matchers' lexer states freed), hands
        the C heap's free pages back to the system (grammar_cache.HeapTrim, at most every 2 s)."""
        if self._grammar_freed and self._heap_trim.maybe():
            self._grammar_freed = False

    def fail(self, step: StepPlan) -> list[RequestOutput]:
        """A step raised: end the requests it touched with "error", keep the engine going.
        Blocks registered for this step may hold no K/V: forget all cached content."""
        self.block_manager.reset_prefix_cache()
        failed = {self._owner[s.seq.seq_id][0].request_id for s in step.plan.scheduled if s.seq.seq_id in self._owner}
        return [o for rid in failed if (o := self.abort_request(rid, reason="error")) is not None]

    # -- one step ------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Synchronous convenience: one full step (used by tests and benchmarks)."""
        step = self.schedule()
        if step.plan.is_empty:
            return []
        return self.process(step, self.execute(step))

    def schedule(self) -> StepPlan:
        step = StepPlan(self.scheduler.schedule())
        now = time.monotonic()
        for item in step.plan.scheduled:
            owner = self._owner.get(item.seq.seq_id)
            if owner is not None and owner[0].metrics.first_scheduled_time is None:
                owner[0].metrics.first_scheduled_time = now
            if item.samples:  # one lookup for both: a sampling sequence always has its owner
                self._plan_sampling(step, item.seq, owner if owner is not None else self._owner[item.seq.seq_id])
        return step

    def _plan_sampling(self, step: StepPlan, seq: Sequence, owner: tuple[Request, Sample | None]) -> None:
        """Gives `seq`'s last logits row to its beam search (`owner`: its request and sample),
        or to its sample's sampling row; right after sample 0's prompt the children draw their
        first tokens from it too."""
        source = step.num_logits
        step.num_logits += 1
        req, sample = owner
        if sample is None:
            step.beam_sources.append(source)
            step.beam_matchers.append(req.beam.matcher(seq))
            return
        for s in (sample, *self._drawing_children(req, sample)):
            step.rows.append(s.row)
            step.row_sources.append(source)

    @staticmethod
    def _drawing_children(req: Request, sample: Sample) -> list[Sample]:
        return req.pending_children if sample.index == 0 else []

    def execute(self, step: StepPlan) -> StepResult:
        return self.runner.execute(step.plan, step.rows, step.row_sources, step.beam_sources, step.beam_matchers)

    def process(self, step: StepPlan, result: StepResult) -> list[RequestOutput]:
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
                req = self._owner[item.seq.seq_id][0]
                self._guarded(faults, req, self._add_prompt_logprobs, req, item.seq, entries)
            item.seq.num_computed_tokens += item.num_new_tokens
            if not item.samples:
                continue
            req, sample = self._owner[item.seq.seq_id]
            if sample is None:
                req.beam.add_logprobs(item.seq, next(beam_rows))
                beam_reqs[req.request_id] = req
                continue
            # Rows are taken before anything can fail, so a fault cannot shift another's rows.
            taken = [next(draws) for _ in range(1 + len(self._drawing_children(req, sample)))]
            self._guarded(faults, req, self._take_samples, req, sample, taken)
            touched[req.request_id] = req
        for req in beam_reqs.values():
            if req.beam.ready and self._guarded(faults, req, self._beam_step, req):
                touched[req.request_id] = req  # beam search streams only its final result
        now = time.monotonic()
        outputs = [
            out for req in touched.values()
            if req.request_id not in faults and (out := self._guarded(faults, req, self._finish_output, req, now))
        ]
        self._fail_all(faults)
        return outputs

    @staticmethod
    def _add_prompt_logprobs(req: Request, seq: Sequence, entries: PromptLogprobs) -> None:
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

    def _take_samples(self, req: Request, sample: Sample, draws: list[tuple[int, Any]]) -> None:
        targets = [sample, *self._fork_children(req, sample)]
        for target, (token, logprobs) in zip(targets, draws, strict=True):
            self._append_token(req, target, token, logprobs)

    def _fork_children(self, req: Request, parent: Sample) -> list[Sample]:
        """Samples 1..n-1 start as copies of sample 0 right after the prompt: they share all
        its blocks (refcounts), and the first write into the shared partial block copies it."""
        children = self._drawing_children(req, parent)
        if children:
            req.pending_children = []
        for child in children:
            self.block_manager.fork(parent.seq, child.seq)
            self.scheduler.add_running(child.seq)
        return children

    def _append_token(self, req: Request, sample: Sample, token: int, logprobs: dict[int, float] | None) -> None:
        seq = sample.seq
        seq.token_ids.append(token)
        sample.token_ids.append(token)
        if sample.matcher is not None:
            sample.matcher.accept(token)  # GrammarError (fails this request) if it refuses
        if sample.logprobs is not None:
            sample.logprobs.append(logprobs)
        stop_str = sample.detok.add_tokens([token])
        self.tenants.record(req.tenant, 1)
        reason, stop = self.stop_rules.check(req, sample, token, stop_str)
        if reason is not None:
            sample.finish(reason, stop)
            if req.pin is not None:
                self._pin(req.pin, seq)
            self.scheduler.remove(seq)

    def _beam_step(self, req: Request) -> bool:
        """Advances a beam search whose live beams all have their log-probs; True once it ended
        (its samples then hold the best hypotheses)."""
        results = req.beam.advance(fork=lambda parent: self._fork_beam(req, parent), drop=self._drop_beam)
        if results is None:
            return False
        skip = req.params.skip_special_tokens
        for sample, result in zip(req.samples, results, strict=True):
            sample.token_ids = result.token_ids
            sample.final_text = self.tokenizer.decode(result.token_ids, skip_special_tokens=skip)
            sample.finish_reason = result.finish_reason
        return True

    def _fork_beam(self, req: Request, parent: Sequence) -> Sequence:
        child = self._new_seq(req, parent.group_size, token_ids=parent.token_ids)
        self._owner[child.seq_id] = (req, None)
        if parent.status is SequenceStatus.RUNNING:
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
        else:  # parent preempted meanwhile: the child recomputes (mostly prefix-cache hits)
            self.scheduler.add_preempted(child)
        return child

    def _pin(self, pin: Pin, seq: Sequence) -> None:
        """Pins the cached blocks of `seq`'s prompt (computed by now) for `pin`. They are
        found by hash: a prompt already cached computes its last block again in a block of
        its own, which is not the cached one."""
        bm, n = self.block_manager, pin.info.num_blocks
        block_ids = bm.cached_block_ids(bm.compute_block_hashes(seq)[:n])
        if len(block_ids) != n:
            raise RuntimeError(f"pinned prefix {pin.info.pin_id}: only {len(block_ids)} of its {n} blocks are cached")
        bm.pin_blocks(block_ids, owner="*" if pin.info.shared else pin.info.tenant)
        pin.block_ids = block_ids
        # The segments its blocks were hashed with: a shared pin made while this one computed
        # (pins made concurrently) must not change which hashes its tenant's requests look up.
        self.pins.add(pin, seq.salt_segments)

    def unpin(self, pin_id: str) -> None:
        """Makes a pinned prefix's blocks evictable again; KeyError for an unknown id."""
        self.block_manager.unpin_blocks(self.pins.pop(pin_id).block_ids)

    def _drop_beam(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._owner.pop(seq.seq_id, None)

    def _finish_output(self, req: Request, now: float) -> RequestOutput:
        """The output of a request this step gave tokens (a beam search: its result)."""
        metrics = req.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if req.finished:
            metrics.finished_time = now
        output = make_output(req)
        if req.finished:
            self._release(req)
        return output

    def _guarded(self, faults: dict[str, str | GrammarError], req: Request, fn: Callable[..., T], *args) -> T | None:
        """Runs one request's postprocessing; a fault is logged and recorded for that request."""
        try:
            return fn(*args)
        except GrammarError as exc:
            # Its grammar refused a token its own mask allowed: the spec went past llguidance's
            # limits while decoding. The client's error, not an engine fault to log a trace for;
            # its cached grammar goes too (a spec that fails requests is not worth its memory).
            log.info("request %s failed by its grammar: %s", req.request_id, exc)
            if req.params.structured is not None:
                self.grammars.forget(req.params.structured, req.tenant)
            faults.setdefault(req.request_id, exc)
            return None
        except Exception as exc:
            log.exception("postprocessing request %s failed", req.request_id)
            faults.setdefault(req.request_id, f"{type(exc).__name__}: {exc}")
            return None

    def _fail_all(self, faults: dict[str, str | GrammarError]) -> None:
        for request_id, why in faults.items():
            self.fail_request(request_id, why)
        if faults:
            self.audit()

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        bm, sched = self.block_manager, self.scheduler
        return {
            "num_total_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_blocks": len(bm.cached),
            # Sharing: physical blocks in use vs the block-table entries that point at them.
            "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
            "num_logical_blocks": sum(len(s.block_table) for s in self._live_seqs()),
            "num_tokens_to_compute": self.num_tokens_to_compute(),
            "kv_cache_usage": bm.usage(),
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_requests": len(self.requests),
            "prefix_cache_queries": bm.stats.queries,
            "prefix_cache_hits": bm.stats.hits,
            "num_preemptions": sched.num_preemptions,
            "num_swapped": len(sched.swapped),
            "num_swap_outs": sched.num_swap_outs,
            "num_swap_blocks": bm.num_cpu_blocks,
            "num_swap_blocks_free": bm.num_free_cpu_blocks,
            "block_size": bm.block_size,
            "max_model_len": self.max_model_len,
            "num_pinned_blocks": bm.num_pinned_blocks,
            "tenants": self.tenant_stats(),
        }

    def tenant_stats(self) -> dict[str, dict[str, int | float]]:
        """Per tenant: the scheduler's share and service figures, plus its weight, requests in
        flight, pinned blocks, requests refused by its rate limit and the seconds its grammar
        masks took."""
        figures = self.scheduler.tenant_stats()
        live: dict[str, int] = {}
        for req in self.requests.values():
            live[req.tenant] = live.get(req.tenant, 0) + 1
        pinned: dict[str | None, int] = {}
        for pin in self.pins.all():
            pinned[pin.info.tenant] = pinned.get(pin.info.tenant, 0) + len(pin.block_ids)
        for name in self.tenants.names():
            row = figures.setdefault(name, {})
            row["weight"] = self.tenants.get(name).weight
            row["num_requests"] = live.get(name, 0)
            row["num_pinned_blocks"] = pinned.get(name, 0)
            row["num_rejected"] = self.tenants.num_rejected.get(name, 0)
        mask_seconds = self.runner.masker.seconds_by_tenant.copy()  # the step thread adds to it
        for name, row in figures.items():
            row["grammar_mask_seconds"] = mask_seconds.get(name, 0.0)
        return figures

    def num_tokens_to_compute(self) -> int:
        """Tokens still to run through the model for the requests held: a waiting prompt net
        of its cached prefix, the rest of a prompt prefilled in chunks, one per decoding
        sequence. A replica reports it so a router can weigh the work queued there."""
        bm = self.block_manager
        total = 0
        for seq in self._live_seqs():
            computed = seq.num_computed_tokens or len(bm.find_cached_blocks(seq)) * bm.block_size
            total += seq.num_tokens - computed
        return total

    def _live_seqs(self) -> Iterator[Sequence]:
        """Sequences holding or about to compute blocks. Samples still waiting to fork sample
        0's prompt are left out: they will share its blocks, not compute the prompt again."""
        for req in self.requests.values():
            forking = {child.seq.seq_id for child in req.pending_children}
            for seq in req.seqs:
                if not seq.is_finished and seq.seq_id not in forking:
                    yield seq

    # -- KV events -----------------------------------------------------------------------

    def record_kv_events(self, on: bool) -> None:
        """Starts (or stops) recording KV events; the medium named is where the pool lives."""
        if on:
            self.block_manager.record_kv_events("GPU" if self.device.type == "cuda" else "CPU")
        else:
            self.block_manager.stop_kv_events()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.block_manager.take_kv_events()

    def kv_snapshot(self) -> list[KVCacheEvent]:
        return self.block_manager.kv_snapshot()

    def kv_state(self) -> dict:
        bm = self.block_manager
        return {
            "block_size": bm.block_size, "num_blocks": bm.num_blocks, "blocks": bm.block_states(),
            "tenants": bm.block_tenants(),
        }


def _seq_salt(segments: tuple[tuple[int, str | None], ...]) -> str | None:
    """A sequence's `cache_salt`: its last segment's (what a block past every segment gets)."""
    return segments[-1][1] if segments else None


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """End-of-sequence ids from the model's generation config and its tokenizer."""
    ids: set[int] = set()
    gen = getattr(loaded.model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids
