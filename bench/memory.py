"""KV-cache memory: waste of paged allocation vs contiguous reservation, and savings from sharing.

No model runs here (except with `--engine-beam`): the REAL `Scheduler` and `BlockManager` of
streamengine are driven step by
step the way the engine drives them (schedule a step; every scheduled sequence computes its
`num_new_tokens`; full blocks are hashed; a sequence that reaches its last known token samples
one synthetic token; a finished sequence is removed), with every request of a seeded synthetic
trace (bench/traces.py: ShareGPT-like and Alpaca-like lengths) submitted at once into a pool of
`--num-blocks` blocks of 16 tokens (when it fills up, the scheduler preempts by recompute, as
configured by default). What is measured is the block accounting, which does not depend on
what the tokens are.

Waste (sampled right after every `schedule()`, when the step's slots are allocated):

  paged       slots in the block tables of running sequences that hold no token:
              sum(len(block_table) * block_size - num_tokens) / sum(len(block_table) * block_size)
  contiguous  the same running sequences, each with a contiguous reservation, as systems without
              paging do (the paper's Orca baselines):
                max     max_model_len (2048) slots per request  <- `contiguous_waste_pct`
                pow2    the next power of two >= the request's final length (prompt + output)
                oracle  exactly the request's final length (waste = tokens not generated yet)

Percentages are time averages weighted by memory: the sum over all steps of wasted slots over
the sum over all steps of allocated slots. Batch size: the mean number of running requests over
the steps in which requests were still waiting (the pool, not the queue, was the limit), for the
paged scheduler and for a contiguous allocator simulated on the same trace, budget and step rule.

Sharing (`--num-blocks` pool, same traces): memory = physical blocks in use (refcount > 0) vs
logical blocks (block-table entries of live sequences, i.e. what the same sequences would hold
without sharing); saving = 1 - sum_t physical / sum_t logical.

  parallel n  as the engine does it: one sequence prefills the prompt; when it samples its first
              token, n - 1 children fork its block table (refcounts), each appends its own token;
              the first write into the shared partial last block is copied on write by
              `allocate_slots`. Every sample runs for the request's trace output length.
  beam k      simulated on the block manager at trace scale (a real model over thousands of
              ShareGPT-length beams is too slow on CPU): every step each live beam computes its
              last token; a synthetic language model (`BeamModel`, fitted to SmolLM2's
              next-token statistics) gives each beam next-token log-probabilities; the k best
              cumulative log-probs over all beams' candidates survive, as in real beam search.
              So parents are not drawn by hand: they come out of the score competition, and
              beams collapse onto a common history whenever one beam's continuations dominate.
              As in the engine, a parent's first survivor continues in place, further survivors
              fork it (`BlockManager.fork`: all blocks shared, the partial last block copied on
              the first write), and beams left without survivors are freed. No EOS and no
              length penalty: every beam runs for the trace's output length.
              `--engine-beam` also measures beam search in the real engine (`stats()` after each
              `schedule()`: num_used_blocks vs num_logical_blocks) on a few shortened requests,
              next to the simulation of the same requests.

KV cache element types (`kv_dtypes`): the engine's pool sizing for each kv_cache_dtype at one
byte budget (the default model's shape; bench/kv_dtypes.py), and the paged batch size the
simulation reaches on the ShareGPT-like trace when the float16 pool of `--num-blocks` is an fp8
pool of the same bytes (twice the blocks).

    python bench/memory.py --quick --json out.json     # < 1 min
    python bench/memory.py --trace sharegpt --num-requests 1000
    python bench/memory.py --trace sharegpt --num-requests 8 --engine-beam   # + real engine
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

import numpy as np  # noqa: E402  (a dependency of transformers, hence always installed)
from tqdm import tqdm  # noqa: E402
from traces import TRACES, TraceRequest, make_trace, normal_token_ids, summarize  # noqa: E402

from streamengine.kv.block_manager import BlockManager  # noqa: E402
from streamengine.sched.scheduler import Scheduler  # noqa: E402
from streamengine.sequence import Sequence, SequenceStatus  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
VOCAB = 32000  # synthetic token ids; only their hashes matter to the block manager
SHARING_WIDTHS = (2, 4, 6)
CONTIGUOUS = ("max", "pow2", "oracle")
# (waste requests, sharing requests) per trace
QUICK = {"sharegpt": (400, 60), "alpaca": (1500, 200)}
FULL = {"sharegpt": (2000, 200), "alpaca": (5000, 600)}


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_blocks: int = 1024  # 16K token slots: a 13B model's KV budget on a 40 GB GPU, roughly
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = 512  # high enough that the KV pool, not this cap, bounds the batch
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True

    @property
    def budget_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class BeamModel:
    """A synthetic language model for beam search.

    At each step, each beam's next-token logits over an effective vocabulary of `vocab` tokens
    are `sigma * z`, z ~ N(0, I); the confidence `sigma` is drawn per beam and step, uniformly
    in [sigma_lo, sigma_hi], so some steps are near-deterministic and some are open, as in real
    text. The defaults were fitted to the language model, not to any memory result: to the
    next-token distributions of SmolLM2-135M-Instruct decoding chat answers greedily (720 steps): top-1
    probability mean 0.67 (model here 0.65), share of steps with top-1 > 0.9 0.31 (0.32) and
    < 0.5 0.30 (0.32), entropy 1.43 nats (1.29). How much beams collapse follows from the score
    competition; it is not set directly.
    """

    vocab: int = 256
    sigma_lo: float = 1.0
    sigma_hi: float = 15.0

    def describe(self) -> str:
        return (
            f"synthetic LM: per beam and step, logits = sigma * N(0, I_{self.vocab}), "
            f"sigma ~ U({self.sigma_lo}, {self.sigma_hi}); keep the top-k cumulative log-probs"
        )

    def log_probs(self, rng: np.random.Generator, num_beams: int) -> np.ndarray:
        sigma = rng.uniform(self.sigma_lo, self.sigma_hi, size=(num_beams, 1))
        logits = sigma * rng.standard_normal((num_beams, self.vocab))  # [beams, vocab]
        top = logits.max(axis=1, keepdims=True)
        return logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))


# -- requests: how each kind of request reacts when its sequences sample ---------------------


class Sim:
    """The engine's step loop without a model, around the real scheduler and block manager."""

    def __init__(self, cfg: SimConfig, seed: int) -> None:
        self.cfg = cfg
        self.bm = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.bm, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.rng = random.Random(seed)
        self.seq_ids = itertools.count()
        self.owner: dict[int, Group] = {}  # seq_id -> its request
        self.num_finished = 0

    def new_seq(self, group: Group, token_ids: list[int], arrival: float) -> Sequence:
        seq = Sequence(
            next(self.seq_ids), group.request_id, group.prompt, arrival_time=arrival,
            token_ids=list(token_ids),
        )
        self.owner[seq.seq_id] = group
        return seq

    def token(self) -> int:
        return self.rng.randrange(VOCAB)

    def finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        del self.owner[seq.seq_id]

    def step(self, observe: Callable[[Sim], None]) -> None:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            raise RuntimeError("no progress: the pool cannot hold the head request (raise --num-blocks)")
        observe(self)
        sampled: dict[int, list[Sequence]] = {}
        groups: dict[int, Group] = {}
        for item in plan.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.bm.cache_full_blocks(seq)
            if item.samples:
                group = self.owner[seq.seq_id]
                groups[id(group)] = group
                sampled.setdefault(id(group), []).append(seq)
        for key, group in groups.items():
            if group.on_sampled(self, sampled[key]):
                self.num_finished += 1


@dataclass(slots=True, eq=False)
class Group:
    """One request: a prompt, its trace output length, and the sequences decoding it."""

    request_id: str
    prompt: list[int]
    output_len: int
    arrival: float
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def final_len(self) -> int:
        return len(self.prompt) + self.output_len

    def start(self, sim: Sim) -> None:
        seq = sim.new_seq(self, self.prompt, self.arrival)
        self.seqs = [seq]
        sim.scheduler.add(seq)

    def on_sampled(self, sim: Sim, sampled: list[Sequence]) -> bool:
        """Appends tokens after a step; True once the whole request has finished."""
        raise NotImplementedError


@dataclass(slots=True, eq=False)
class ParallelGroup(Group):
    """n independent samples of one prompt; n = 1 is a plain request."""

    n: int = 1
    forked: bool = False

    def on_sampled(self, sim: Sim, sampled: list[Sequence]) -> bool:
        if not self.forked:
            self.forked = True
            parent = self.seqs[0]
            for _ in range(self.n - 1):
                child = sim.new_seq(self, parent.token_ids, parent.arrival_time)
                sim.bm.fork(parent, child)
                sim.scheduler.add_running(child)
                self.seqs.append(child)
                sampled.append(child)
        for seq in sampled:
            seq.token_ids.append(sim.token())
            if seq.num_output_tokens >= self.output_len:
                sim.finish(seq)
                self.seqs.remove(seq)
        return not self.seqs


@dataclass(slots=True, eq=False)
class BeamGroup(Group):
    width: int = 4
    model: BeamModel = field(default_factory=BeamModel)
    np_rng: np.random.Generator | None = None
    scores: np.ndarray | None = None  # cumulative log-prob of each live beam
    num_steps: int = 0
    num_parents: int = 0  # distinct parents summed over steps (how much beams collapse)

    def on_sampled(self, sim: Sim, sampled: list[Sequence]) -> bool:
        if not all(s.status is SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens
                   for s in self.seqs):
            return False  # a beam was preempted: select once every beam has its logits again
        beams = self.seqs
        scores = self.scores if self.scores is not None else np.zeros(1)
        cand = scores[:, None] + self.model.log_probs(self.np_rng, len(beams))  # [beams, vocab]
        flat = cand.ravel()
        best = np.argpartition(-flat, self.width - 1)[: self.width]
        best = best[np.argsort(-flat[best])]
        self.scores = flat[best]
        parents, tokens = np.divmod(best, self.model.vocab)
        self.num_steps += 1
        self.num_parents += len(set(parents.tolist()))
        if beams[0].num_output_tokens + 1 >= self.output_len:
            for seq in beams:
                sim.finish(seq)
            self.seqs = []
            return True
        # As the engine does it: the first survivor of a parent continues in place, the others
        # fork it (sharing every block), and parents with no survivor free their blocks.
        new: list[Sequence] = []
        used: set[int] = set()
        for parent in parents.tolist():
            src = beams[parent]
            if parent in used:
                child = sim.new_seq(self, src.token_ids, src.arrival_time)
                sim.bm.fork(src, child)
                sim.scheduler.add_running(child)
                new.append(child)
            else:
                used.add(parent)
                new.append(src)
        for seq, token in zip(new, tokens.tolist(), strict=True):
            seq.token_ids.append(1000 + token)  # the candidate index names the token
        for i, seq in enumerate(beams):
            if i not in used:
                sim.finish(seq)
        self.seqs = new
        return False


# -- measurements ---------------------------------------------------------------------------


@dataclass(slots=True)
class WasteMeter:
    """Sums over steps of allocated / wasted slots (paged and contiguous) and batch sizes."""

    cfg: SimConfig
    allocated: int = 0
    wasted: int = 0
    reserved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONTIGUOUS, 0))
    tokens: int = 0
    steps: int = 0
    saturated_steps: int = 0
    saturated_running: int = 0
    total_running: int = 0

    def __call__(self, sim: Sim) -> None:
        bs = self.cfg.block_size
        self.steps += 1
        self.total_running += len(sim.scheduler.running)
        for seq in sim.scheduler.running:
            cap = len(seq.block_table) * bs
            held = min(seq.num_tokens, cap)  # a chunked prompt holds only what is allocated
            self.allocated += cap
            self.wasted += cap - held
            self.tokens += held
            final = sim.owner[seq.seq_id].final_len
            self.reserved["max"] += self.cfg.max_model_len
            self.reserved["pow2"] += min(1 << (final - 1).bit_length(), self.cfg.max_model_len)
            self.reserved["oracle"] += final
        if sim.scheduler.waiting:
            self.saturated_steps += 1
            self.saturated_running += len(sim.scheduler.running)

    def paged_pct(self) -> float:
        return 100.0 * self.wasted / max(self.allocated, 1)

    def contiguous_pct(self, scheme: str) -> float:
        return 100.0 * (self.reserved[scheme] - self.tokens) / max(self.reserved[scheme], 1)

    def batch(self) -> float:
        if not self.saturated_steps:  # the pool never filled up: the batch is all there was
            return self.total_running / max(self.steps, 1)
        return self.saturated_running / self.saturated_steps


@dataclass(slots=True)
class ShareMeter:
    physical: int = 0
    logical: int = 0
    steps: int = 0

    def __call__(self, sim: Sim) -> None:
        self.steps += 1
        self.physical += sim.bm.num_blocks - sim.bm.num_free_blocks
        # waiting (preempted) sequences hold no blocks, so the running ones are all live ones
        self.logical += sum(len(s.block_table) for s in sim.scheduler.running)

    def saving_pct(self) -> float:
        return 100.0 * (1.0 - self.physical / max(self.logical, 1))


def run_groups(sim: Sim, groups: list[Group], observe, bar: tqdm | None) -> None:
    for group in groups:
        group.start(sim)
    done = 0
    while sim.scheduler.has_work():
        sim.step(observe)
        if bar is not None and sim.num_finished > done:
            bar.update(sim.num_finished - done)
            done = sim.num_finished


def measure_waste(trace: list[TraceRequest], cfg: SimConfig, seed: int, bar: tqdm | None) -> dict:
    sim = Sim(cfg, seed)
    groups = [ParallelGroup(f"r{i}", r.prompt_token_ids, r.output_len, float(i)) for i, r in enumerate(trace)]
    meter = WasteMeter(cfg)
    run_groups(sim, groups, meter, bar)
    contiguous_batch = {s: contiguous_batch_size(trace, cfg, s) for s in CONTIGUOUS}
    paged_batch = meter.batch()
    return {
        "paged_waste_pct": meter.paged_pct(),
        "contiguous_waste_pct": {s: meter.contiguous_pct(s) for s in CONTIGUOUS},
        "batch_size": {"paged": paged_batch, **{f"contiguous_{s}": b for s, b in contiguous_batch.items()}},
        "batch_size_gain_vs_max": paged_batch / max(contiguous_batch["max"], 1e-9),
        "num_steps": meter.steps,
        "num_preemptions": sim.scheduler.num_preemptions,
    }


def contiguous_batch_size(trace: list[TraceRequest], cfg: SimConfig, scheme: str) -> float:
    """Mean running requests (while any wait; else overall) of a contiguous allocator on the
    same trace.

    Same step rule as the paged scheduler: FCFS admission when the whole reservation fits the
    free slots and the prompt fits the step's token budget; one token per running request per
    step; a request leaves when its output is done.
    """
    queue = list(reversed(trace))
    running: list[list[int]] = []  # [reservation, tokens left to generate]
    free = cfg.budget_tokens
    steps = total = sat_steps = sat_total = 0
    while queue or running:
        budget = cfg.max_num_batched_tokens - len(running)
        while queue and len(running) < cfg.max_num_seqs:
            req = queue[-1]
            final = len(req.prompt_token_ids) + req.output_len
            need = {"max": cfg.max_model_len, "oracle": final}.get(scheme) or min(
                1 << (final - 1).bit_length(), cfg.max_model_len
            )
            prompt = len(req.prompt_token_ids)
            if need > free or (prompt > budget and running):
                break
            queue.pop()
            free -= need
            budget -= prompt
            running.append([need, req.output_len])
        steps += 1
        total += len(running)
        if queue:
            sat_steps += 1
            sat_total += len(running)
        for r in running:
            r[1] -= 1
        free += sum(r[0] for r in running if r[1] <= 0)
        running = [r for r in running if r[1] > 0]
    return sat_total / sat_steps if sat_steps else total / max(steps, 1)


def measure_sharing(
    trace: list[TraceRequest], cfg: SimConfig, seed: int, kind: str, width: int,
    model: BeamModel, bar: tqdm | None,
) -> dict:
    sim = Sim(cfg, seed)
    groups: list[Group] = []
    for i, r in enumerate(trace):
        if kind == "parallel":
            groups.append(ParallelGroup(f"r{i}", r.prompt_token_ids, r.output_len, float(i), n=width))
        else:
            rng = np.random.default_rng([seed, i, width])
            groups.append(BeamGroup(f"r{i}", r.prompt_token_ids, r.output_len, float(i),
                                    width=width, model=model, np_rng=rng))
    meter = ShareMeter()
    run_groups(sim, groups, meter, bar)
    out = {
        "saving_pct": meter.saving_pct(),
        "mean_physical_blocks": meter.physical / max(meter.steps, 1),
        "mean_logical_blocks": meter.logical / max(meter.steps, 1),
        "num_steps": meter.steps,
        "num_preemptions": sim.scheduler.num_preemptions,
    }
    if kind == "beam":
        num_steps = sum(g.num_steps for g in groups)
        out["mean_distinct_parents"] = sum(g.num_parents for g in groups) / max(num_steps, 1)
    return out


# -- beam search in the real engine ----------------------------------------------------------


def engine_supports_beam_search() -> bool:
    from streamengine import SamplingParams

    try:
        return SamplingParams(beam_width=2).beam_width == 2
    except (TypeError, ValueError):
        return False


def measure_engine_beam(args: argparse.Namespace, cfg: SimConfig, model: BeamModel) -> dict:
    """Beam search in the real engine (a real model picks the beams): physical vs logical
    blocks from `stats()` after every `schedule()`, on the first `--engine-requests` requests of
    the ShareGPT-like trace with lengths scaled by `--engine-scale` (a forward pass per token is
    slow on CPU). The simulation runs the same requests, for a side-by-side check of BeamModel."""
    from streamengine import EngineConfig, SamplingParams
    from streamengine.engine.core import EngineCore

    core = EngineCore(EngineConfig(
        model=args.engine_model, num_gpu_blocks=cfg.num_blocks, block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        seed=args.seed,
    ))
    trace = make_trace(TRACES["sharegpt"], args.engine_requests,
                       normal_token_ids(core.tokenizer, core.vocab_size),
                       seed=args.seed, scale=args.engine_scale)
    out: dict = {"model": args.engine_model or "SmolLM2-135M-Instruct", "device": str(core.device), "trace": summarize(trace)}
    with tqdm(total=len(SHARING_WIDTHS) * len(trace), desc="engine beam", unit="req",
              file=sys.stderr, dynamic_ncols=True, disable=args.no_progress) as bar:
        for width in SHARING_WIDTHS:
            physical = logical = 0
            for i, r in enumerate(trace):
                params = SamplingParams(beam_width=width, max_tokens=r.output_len, ignore_eos=True)
                core.add_request(f"beam{width}-{i}", r.prompt_token_ids, params)
            while core.has_work():
                step = core.schedule()
                stats = core.stats()
                physical += stats["num_used_blocks"]
                logical += stats["num_logical_blocks"]
                if step.plan.is_empty:
                    raise RuntimeError("engine made no progress (raise --num-blocks)")
                finished = [o for o in core.process(step, core.execute(step)) if o.finished]
                bar.update(len(finished))
            sim = measure_sharing(trace, cfg, args.seed, "beam", width, model, None)
            out[f"beam{width}"] = {
                "saving_pct": 100.0 * (1.0 - physical / max(logical, 1)),
                "sim_saving_pct": sim["saving_pct"],
            }
    return out


# -- KV cache element types -------------------------------------------------------------------


def measure_kv_dtypes(args: argparse.Namespace, cfg: SimConfig) -> dict:
    """Capacity per kv_cache_dtype at the bytes of a float16 pool of `cfg.num_blocks` blocks of
    the default model, and the simulated paged batch size of the float16 pool vs the fp8 pool of
    the same bytes, on the ShareGPT-like trace."""
    import kv_dtypes
    from common import default_model_folder
    from transformers import AutoConfig

    from streamengine.kv.spec import AttentionShape

    model_config = AutoConfig.from_pretrained(default_model_folder())
    shape = AttentionShape.of(model_config)
    float16_block = 2 * shape.num_layers * BLOCK_SIZE * shape.num_kv_heads * shape.head_dim * 2
    budget = cfg.num_blocks * float16_block
    n_waste = (QUICK if args.quick else FULL)["sharegpt"][0] if args.num_requests is None else args.num_requests
    trace = make_trace(TRACES["sharegpt"], n_waste, list(range(VOCAB)), seed=args.seed, max_len=cfg.max_model_len // 2)
    pools = {}
    for name, blocks in (("float16", cfg.num_blocks), ("fp8", 2 * cfg.num_blocks)):
        waste = measure_waste(trace, replace(cfg, num_blocks=blocks), args.seed, None)
        pools[name] = {"num_blocks": blocks, "batch_size": waste["batch_size"]["paged"],
                       "paged_waste_pct": waste["paged_waste_pct"]}
    return {"budget_bytes": budget, "model": "SmolLM2-135M-Instruct", "capacity": kv_dtypes.capacity(model_config, budget),
            "simulated_sharegpt": pools,
            "fp8_batch_vs_float16": pools["fp8"]["batch_size"] / pools["float16"]["batch_size"]}


def print_kv_dtypes(kv: dict) -> None:
    print(f"\nKV cache element types at {kv['budget_bytes'] / 2**20:.0f} MiB ({kv['model']}):")
    for name, row in kv["capacity"].items():
        print(f"  {name:<9} {row['bytes_per_token']:>6} B/token {row['tokens']:>8} tokens "
              f"({row['tokens_vs_float16']:.2f}x float16)")
    for name, row in kv["simulated_sharegpt"].items():
        print(f"  simulated ShareGPT-like, {name} pool of {row['num_blocks']} blocks: "
              f"batch {row['batch_size']:.1f}, waste {row['paged_waste_pct']:.2f}%")


# -- the run --------------------------------------------------------------------------------


def run_trace(name: str, args: argparse.Namespace, cfg: SimConfig, model: BeamModel) -> dict:
    n_waste, n_share = (QUICK if args.quick else FULL)[name]
    if args.num_requests is not None:
        n_waste = n_share = args.num_requests
    spec = TRACES[name]
    trace = make_trace(spec, n_waste, list(range(VOCAB)), seed=args.seed, max_len=cfg.max_model_len // 2)
    share_trace = trace[:n_share]  # request i is the same whatever the total (see traces.py)
    total = n_waste + 2 * len(SHARING_WIDTHS) * n_share
    with tqdm(total=total, desc=name, unit="req", file=sys.stderr, dynamic_ncols=True,
              disable=args.no_progress) as bar:
        waste = measure_waste(trace, cfg, args.seed, bar)
        sharing = {
            f"{kind}{w}": measure_sharing(share_trace, cfg, args.seed, kind, w, model, bar)
            for kind in ("parallel", "beam")
            for w in SHARING_WIDTHS
        }
    return {
        "trace": summarize(trace),
        "sharing_trace": summarize(share_trace),
        "waste": waste,
        "sharing": sharing,
    }


def headline(results: dict[str, dict]) -> dict[str, float]:
    """The issue's keys, from the ShareGPT-like trace when it ran."""
    r = results.get("sharegpt") or next(iter(results.values()))
    return {
        "paged_waste_pct": r["waste"]["paged_waste_pct"],
        "contiguous_waste_pct": r["waste"]["contiguous_waste_pct"]["max"],
        "beam4_saving_pct": r["sharing"]["beam4"]["saving_pct"],
        "parallel4_saving_pct": r["sharing"]["parallel4"]["saving_pct"],
    }


def print_table(results: dict[str, dict], cfg: SimConfig) -> None:
    print(f"\nKV pool {cfg.num_blocks} blocks x {cfg.block_size} tokens, max_model_len {cfg.max_model_len}")
    print(f"{'trace':10s} {'paged':>7s} {'c-max':>7s} {'c-pow2':>7s} {'c-oracle':>8s}   "
          f"batch: {'paged':>6s} {'c-max':>6s} {'c-pow2':>6s} {'c-orcl':>6s} {'gain':>6s}")
    for name, r in results.items():
        w = r["waste"]
        c, b = w["contiguous_waste_pct"], w["batch_size"]
        print(f"{name:10s} {w['paged_waste_pct']:6.2f}% {c['max']:6.2f}% {c['pow2']:6.2f}% {c['oracle']:7.2f}%"
              f"          {b['paged']:6.1f} {b['contiguous_max']:6.1f} {b['contiguous_pow2']:6.1f}"
              f" {b['contiguous_oracle']:6.1f} {w['batch_size_gain_vs_max']:5.1f}x")
    keys = [f"{k}{w}" for k in ("parallel", "beam") for w in SHARING_WIDTHS]
    print("\nmemory saved by sharing (1 - physical / logical blocks, time-averaged)")
    print(f"{'trace':10s} " + " ".join(f"{k:>10s}" for k in keys))
    for name, r in results.items():
        print(f"{name:10s} " + " ".join(f"{r['sharing'][k]['saving_pct']:9.2f}%" for k in keys))


def plot(results: dict[str, dict], path: Path) -> None:
    from common import pyplot, save_figure

    plt = pyplot()

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    schemes = [("paged", "streamengine (paged)")] + [(s, f"contiguous ({s})") for s in CONTIGUOUS]
    hatches = ["", "//", "\\\\", ".."]
    for ax, metric, ylabel in ((axes[0], "waste", "KV cache waste (%)"), (axes[1], "batch", "Running requests")):
        width = 0.8 / len(schemes)
        for j, (scheme, label) in enumerate(schemes):
            vals = [_scheme_value(results[n]["waste"], metric, scheme) for n in names]
            bars = ax.bar([i + (j - 1.5) * width for i in range(len(names))], vals, width,
                          label=label, hatch=hatches[j], edgecolor="black", linewidth=0.6)
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
        ax.set_xticks(range(len(names)), [_title(n) for n in names])
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, frameon=False)
    axes[0].set_title("(a) Memory waste")
    axes[1].set_title("(b) Batch size in the same KV budget")
    ax = axes[2]
    keys = [(f"{k}{w}", f"{'n' if k == 'parallel' else 'beam'}={w}") for k in ("parallel", "beam") for w in SHARING_WIDTHS]
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        vals = [results[n]["sharing"][k]["saving_pct"] for k, _ in keys]
        bars = ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(keys))], vals, width,
                      label=_title(n), hatch=hatches[j], edgecolor="black", linewidth=0.6)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
    ax.set_xticks(range(len(keys)), [label for _, label in keys])
    ax.set_ylabel("Memory saving (%)")
    ax.set_title("(c) Memory saved by sharing (beams simulated)")
    ax.legend(fontsize=7, frameon=False)
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
    save_figure(fig, path, dpi=130)


def _scheme_value(waste: dict, metric: str, scheme: str) -> float:
    if metric == "waste":
        return waste["paged_waste_pct"] if scheme == "paged" else waste["contiguous_waste_pct"][scheme]
    return waste["batch_size"]["paged" if scheme == "paged" else f"contiguous_{scheme}"]


def _title(name: str) -> str:
    return {"sharegpt": "ShareGPT-like", "alpaca": "Alpaca-like"}.get(name, name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (< 1 min)")
    p.add_argument("--trace", choices=("sharegpt", "alpaca", "both"), default="both")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per trace for every measurement (overrides --quick/full sizes)")
    p.add_argument("--num-blocks", type=int, default=SimConfig().num_blocks)
    p.add_argument("--max-num-seqs", type=int, default=SimConfig().max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=SimConfig().max_model_len,
                   help="contiguous (max) reservation per request; trace lengths are capped at half")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None,
                   help="the plot (default: beside --json, same name; without --json, results/memory.png)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--engine-beam", action="store_true",
                   help="also measure beam search in the real engine (slow on CPU)")
    p.add_argument("--engine-model", default=None, help="model for --engine-beam (default SmolLM2)")
    p.add_argument("--engine-requests", type=int, default=4)
    p.add_argument("--engine-scale", type=float, default=0.25, help="length scale for --engine-beam")
    args = p.parse_args(argv)
    args.png = args.png or (args.json.with_suffix(".png") if args.json else RESULTS_DIR / "memory.png")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if args.engine_requests < 1 or not args.engine_scale > 0:
        p.error("--engine-requests must be >= 1 and --engine-scale > 0")
    if args.num_blocks < 1 or args.max_num_seqs < 1 or args.max_model_len < 2:
        p.error("--num-blocks and --max-num-seqs must be >= 1, --max-model-len >= 2")
    if args.max_model_len > args.num_blocks * BLOCK_SIZE:
        p.error("--max-model-len must fit the pool (--num-blocks * 16 tokens)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = SimConfig(num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    model = BeamModel()
    names = ["sharegpt", "alpaca"] if args.trace == "both" else [args.trace]
    start = time.perf_counter()
    results = {name: run_trace(name, args, cfg, model) for name in names}
    engine_beam = None
    if args.engine_beam:
        if not engine_supports_beam_search():
            raise SystemExit("--engine-beam: this engine has no beam search (SamplingParams.beam_width)")
        engine_beam = measure_engine_beam(args, cfg, model)
    kv = measure_kv_dtypes(args, cfg)
    out = {
        **headline(results),
        "fp8_tokens_vs_float16": kv["capacity"]["fp8"]["tokens_vs_float16"],
        "kv_dtypes": kv,
        "config": asdict(cfg) | {"quick": args.quick, "seed": args.seed},
        "method": {
            "waste": "sum over steps of (allocated - held) / allocated slots of running sequences, "
                     "sampled after each schedule()",
            "contiguous": "same running sequences; max = max_model_len reserved per request "
                          "(headline), pow2 = next power of two >= final length, oracle = final length",
            "batch_size": "mean running requests over steps with requests waiting (all steps if none)",
            "sharing": "1 - sum over steps of physical blocks in use / block-table entries of live sequences",
            "parallel": "engine's fork after the prompt, copy-on-write of the partial last block",
            "beam": "simulated on the block manager: " + model.describe(),
        },
        "traces": results,
        "engine_beam": engine_beam,
        "elapsed_s": time.perf_counter() - start,
        "python": platform.python_version(),
    }
    print_table(results, cfg)
    print_kv_dtypes(kv)
    print(f"\nbeam model: {model.describe()}")
    if engine_beam is not None:
        out["beam4_engine_saving_pct"] = engine_beam["beam4"]["saving_pct"]
        print(f"\nbeam search in the engine ({engine_beam['model']}, {engine_beam['device']}, "
              f"{engine_beam['trace']['num_requests']} requests x{args.engine_scale} lengths):")
        for w in SHARING_WIDTHS:
            r = engine_beam[f"beam{w}"]
            print(f"  beam{w}: engine {r['saving_pct']:6.2f}%   simulated, same requests {r['sim_saving_pct']:6.2f}%")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    if args.png is not None:
        plot(results, args.png)
        print(f"wrote {args.png}")
    return out


if __name__ == "__main__":
    main()
