"""EngineCore: the synchronous engine. Intake, schedule, execute, process.

`AsyncEngine` drives it from the event loop: `schedule` and `process` run on the loop thread
(pure Python, short), `execute` runs in a worker thread. Nothing here knows about asyncio.
One step: the scheduler picks tokens (`schedule`), the runner computes them and samples
(`execute`), then each sampled token is appended to its sample, stop rules decide who is done,
and the output processor turns each advanced request into its next output (`process`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from streamengine.config import EngineConfig
from streamengine.engine import (
    core_pins,
    core_setup,
    core_start,
    core_stats,
    speculation,
    step_outputs,
)
from streamengine.engine.core_pins import seq_salt
from streamengine.engine.intake import Intake
from streamengine.engine.step_outputs import drawing_children
from streamengine.errors import GrammarError
from streamengine.kv.events import KVCacheEvent
from streamengine.kv.spec import plan_kv_cache
from streamengine.lora.registry import LoRARegistry
from streamengine.models import LoadedModel, load_model
from streamengine.models.model_runner import ModelRunner, PromptLogprobs
from streamengine.sample.output_processor import make_output
from streamengine.sample.outputs import RequestOutput
from streamengine.sample.request import Request, Sample
from streamengine.sample.sampler import SamplerOutput, SamplingRow
from streamengine.sample.sampling_params import SamplingParams
from streamengine.sample.stop_rules import StopRules
from streamengine.sched.scheduler import SchedulerOutput
from streamengine.sequence import Sequence
from streamengine.spec.acceptance import SpecStats, StepCost
from streamengine.structured.cache import HeapTrim
from streamengine.structured.compiler import GrammarCompiler
from streamengine.structured.grammar import CompiledGrammar, GrammarMatcher
from streamengine.tenancy.pinning import Pin, Pins
from streamengine.tenancy.tenants import DEFAULT_TENANT, Tenants

log = logging.getLogger(__name__)
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


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = core_setup.pick_device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.loaded = loaded or load_model(config.model, config.dtype, str(self.device), config.cache_dir)
        self.tokenizer = self.loaded.tokenizer
        draft = core_setup.load_draft(config, self.loaded, self.device)
        self.kv_spec = plan_kv_cache(config, self.loaded.model.config, draft.model.config if draft else None)
        self.runner = ModelRunner(self.loaded, config, self.device, self.kv_spec, core_setup.draft_model(
            config, draft, self.device, self.kv_spec, self.loaded.model.config.vocab_size))
        self.loras = LoRARegistry(self.loaded.model.config, config.max_lora_rank)
        for name, path in config.lora_modules:
            self.loras.add(name, path)
        self.tenants = Tenants(config.tenants)
        self.block_manager, self.scheduler = core_setup.fresh_bookkeeping(self)
        self.max_model_len = core_setup.max_model_len(self)
        self.eos_token_ids = core_setup.eos_token_ids(self.loaded)
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
        self.spec_stats = SpecStats()  # speculative decoding: drafts, proposed and accepted tokens
        self.step_cost = StepCost()  # what a step's rows cost, for how long drafts are
        self.output_history = speculation.output_history(config.speculative)  # "suffix" only

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
        self.block_manager, self.scheduler = core_setup.fresh_bookkeeping(self)
        if old.pool.kv_events is not None:  # subscribers knew the old blocks: they are all gone
            self.block_manager.pool.record_kv_events(old.pool.kv_medium, cleared=True)
        for req in self.requests.values():
            if req.lora is not None:
                self.loras.release(req.lora)
        self.requests.clear()
        self._owner.clear()
        self.pins.clear()  # their blocks went with the old block manager
        return dropped

    # -- intake --------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        cache_salt: str | None = None, tenant: str | None = None, pin: Pin | None = None,
        grammar: CompiledGrammar | None = None, lora: str | None = None,
    ) -> Request:
        """Queues a request of `tenant` (None: the default tenant); `cache_salt` is a per-user
        salt for what follows the tenant's pinned prefixes. A `pin` request pins its prompt's
        full blocks when it ends. `grammar` is `params.structured` compiled (compiled here,
        blocking, when not given). `lora` names a loaded LoRA adapter to run the request
        under (None: the base model). Raises ValueError (LimitExceededError, GrammarError,
        LoRAError) for a bad request, TenantRateLimitError past the tenant's tokens per minute."""
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
        adapter = self.loras.get(lora) if lora is not None else None  # LoRAError if not loaded
        segments = core_pins.salt_segments(self, prompt_ids, tenant, cache_salt, pin, adapter)
        max_tokens = core_pins.fit_beside_pins(
            self, prompt_ids, segments, self.intake.max_tokens(len(prompt_ids), params),
            explicit=params.max_tokens is not None, reads_cache=params.prompt_logprobs is None,
        )
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured, tenant)
        req = Request(
            request_id, prompt_ids, params, samples=[], arrival_time=time.monotonic(), max_tokens=max_tokens,
            stop_ids=stop_ids, tenant=tenant, pin=pin, salt_segments=segments,
            lora=adapter,
        )
        if params.use_beam_search:
            core_start.start_beam_search(self, req, grammar)
        else:
            core_start.start_samples(self, req, grammar)
        self.requests[request_id] = req
        if adapter is not None:
            self.loras.acquire(adapter)  # in use until _release
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

    def fail_unfittable(self) -> bool:
        """Fails the queued requests pinned prefixes left no room for (core_pins)."""
        return core_pins.fail_unfittable(self)

    def block_hashes(self, prompt: str | list[int], tenant: str | None = None,
                     cache_salt: str | None = None, lora: str | None = None) -> list[bytes]:
        """The hashes of `prompt`'s full blocks for a request of `tenant` (core_pins)."""
        return core_pins.block_hashes(self, prompt, tenant, cache_salt, lora)

    def _new_seq(self, req: Request, group_size: int, token_ids: list[int] | None = None) -> Sequence:
        segments = req.salt_segments
        return Sequence(
            next(self._seq_ids), req.request_id, req.prompt_token_ids, seq_salt(segments),
            req.arrival_time, token_ids=list(token_ids or ()), group_size=group_size,
            tenant=req.tenant, salt_segments=segments, lora=req.lora,
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
        if req is not None and req.lora is not None:  # _release will not see it: a removal waits on it
            self.loras.release(req.lora)
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
        if [b.ref_cnt for b in bm.pool.blocks] != counts or bm.num_free_blocks != counts.count(0):
            raise EngineStateError("KV block refcounts do not match the sequences' block tables")
        if num_cpu_held + bm.num_free_cpu_blocks != bm.num_cpu_blocks:
            raise EngineStateError("host swap blocks are lost or held twice")

    def _release(self, req: Request) -> None:
        self._grammar_freed |= req.params.structured is not None
        if req.lora is not None and req.request_id in self.requests:
            self.loras.release(req.lora)
        if self.output_history is not None:
            speculation.remember(self, req)
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
            self._owner.pop(seq.seq_id, None)
        self.requests.pop(req.request_id, None)

    def trim_heap(self) -> None:
        """Once requests with grammars have ended (their matchers' lexer states freed), hands
        the C heap's free pages back to the system (structured.cache.HeapTrim, at most every 2 s)."""
        if self._grammar_freed and self._heap_trim.maybe():
            self._grammar_freed = False

    def fail(self, step: StepPlan) -> list[RequestOutput]:
        """A step raised: end the requests it touched with "error", keep the engine going.
        Blocks registered for this step may hold no K/V: forget all cached content."""
        self.block_manager.pool.reset_prefix_cache()
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
        if self.config.speculative is not None:
            speculation.propose(self, self.config.speculative)
        step = StepPlan(self.scheduler.schedule())
        now = time.monotonic()
        for item in step.plan.scheduled:
            owner = self._owner.get(item.seq.seq_id)
            if owner is not None and owner[0].metrics.first_scheduled_time is None:
                owner[0].metrics.first_scheduled_time = now
            if item.samples:  # one lookup for both: a sampling sequence always has its owner
                owner = owner if owner is not None else self._owner[item.seq.seq_id]
                self._plan_sampling(step, item.seq, owner, item.num_spec_tokens)
        return step

    def _plan_sampling(self, step: StepPlan, seq: Sequence, owner: tuple[Request, Sample | None],
                       num_spec: int = 0) -> None:
        """Gives `seq`'s last logits row to its beam search (`owner`: its request and sample),
        or to its sample's sampling row; right after sample 0's prompt the children draw their
        first tokens from it too. A sequence verifying `num_spec` proposed tokens samples at
        each of them too, with the same row (speculation.take_verified)."""
        source = step.num_logits
        step.num_logits += 1 + num_spec
        req, sample = owner
        if num_spec:
            step.rows.append(sample.row)
            if sample.matcher is not None:  # each proposal's row masked by the state it leads to
                step.rows.extend(dataclasses.replace(sample.row, matcher=m) for m in sample.spec_matchers[:num_spec])
            else:
                step.rows.extend([sample.row] * num_spec)
            step.row_sources.extend(range(source, source + 1 + num_spec))
            return
        if sample is None:
            step.beam_sources.append(source)
            step.beam_matchers.append(req.beam.matcher(seq))
            return
        for s in (sample, *drawing_children(req, sample)):
            step.rows.append(s.row)
            step.row_sources.append(source)

    def execute(self, step: StepPlan) -> StepResult:
        start = time.perf_counter()
        result = self.runner.execute(step.plan, step.rows, step.row_sources, step.beam_sources, step.beam_matchers)
        if self.config.speculative is not None and _decode_only(step.plan):  # prompts cost less per row
            self.step_cost.observe(step.plan.num_batched_tokens, time.perf_counter() - start)
        return result

    def process(self, step: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Appends the step's tokens and returns the outputs of the requests it advanced
        (step_outputs.process). A fault in one request's postprocessing fails that request
        alone (see `failures`); raises EngineStateError when the bookkeeping did not survive."""
        return step_outputs.process(self, step, result)

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
                core_pins.pin_prefix(self, req.pin, seq)
            self.scheduler.remove(seq)

    # -- LoRA adapters ------------------------------------------------------------------

    def tenant_lora(self, tenant: str | None) -> str | None:
        """The adapter a tenant's config names for its requests (None: the base model)."""
        name = tenant if tenant is not None else DEFAULT_TENANT
        return self.tenants.get(name).lora if name in self.tenants else None

    def add_lora(self, name: str, path: str) -> None:
        """Loads the PEFT LoRA adapter in folder `path` as `name`; LoRAError (a ValueError)
        says what is wrong with it, before any request can use it."""
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> bool:
        """New requests may no longer name it; True if it is gone now, False while requests
        still run on it (it goes with the last of them)."""
        return self.loras.remove(name)

    def unpin(self, pin_id: str) -> None:
        """Makes a pinned prefix's blocks evictable again; KeyError for an unknown id."""
        self.block_manager.retention.unpin_blocks(self.pins.pop(pin_id).block_ids)

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        return core_stats.stats(self)

    def tenant_stats(self) -> dict[str, dict[str, int | float]]:
        return core_stats.tenant_stats(self)

    def num_tokens_to_compute(self) -> int:
        return core_stats.num_tokens_to_compute(self)

    # -- KV events -----------------------------------------------------------------------

    def record_kv_events(self, on: bool) -> None:
        """Starts (or stops) recording KV events; the medium named is where the pool lives."""
        if on:
            self.block_manager.pool.record_kv_events("GPU" if self.device.type == "cuda" else "CPU")
        else:
            self.block_manager.pool.stop_kv_events()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.block_manager.pool.take_kv_events()

    def kv_snapshot(self) -> list[KVCacheEvent]:
        return self.block_manager.pool.kv_snapshot()

    def kv_state(self) -> dict:
        return core_stats.kv_state(self)


def _decode_only(plan: SchedulerOutput) -> bool:
    """True if every sequence computes only its last token (and the tokens proposed after it)."""
    return all(item.num_new_tokens - item.num_spec_tokens == 1 for item in plan.scheduled)
