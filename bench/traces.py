"""Seeded synthetic request traces shaped like the datasets of the PagedAttention paper.

The paper (Kwon et al., SOSP 2023, section 6.1) reports ShareGPT at a mean of 161.31 input and
337.99 output tokens, and Alpaca at 19.31 input and 58.45 output tokens. The datasets themselves
are not reachable here, so lengths are drawn from log-normal distributions clipped to
[4, 1024] whose location is solved so that the *clipped* mean equals the paper's mean; the
spreads are chosen to give ShareGPT its long tail and Alpaca its short, narrow one. Prompts are
random token ids from the tokenizer's ordinary vocabulary (special tokens excluded), so no
prefix is shared by accident and nothing depends on text that we cannot ship.

Request i is drawn from its own generator seeded by (seed, trace, i): the first N requests of a
trace are the same whatever the total, so a `--quick` run measures a prefix of the full trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceSpec:
    name: str
    prompt_mean: float
    output_mean: float
    prompt_sigma: float  # log-space spread of the prompt length
    output_sigma: float
    min_len: int = 4
    max_len: int = 1024


SHAREGPT = TraceSpec(
    "sharegpt", prompt_mean=161.31, output_mean=337.99, prompt_sigma=1.0, output_sigma=0.9
)
ALPACA = TraceSpec(
    "alpaca", prompt_mean=19.31, output_mean=58.45, prompt_sigma=0.6, output_sigma=0.8
)
TRACES: dict[str, TraceSpec] = {SHAREGPT.name: SHAREGPT, ALPACA.name: ALPACA}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    prompt_token_ids: list[int]
    output_len: int


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[min(max(X, lo), hi)] for X = exp(N(mu, sigma^2)), in closed form."""
    a, b = math.log(lo), math.log(hi)
    below = lo * _phi((a - mu) / sigma)
    above = hi * (1.0 - _phi((b - mu) / sigma))
    inside = math.exp(mu + sigma**2 / 2) * (
        _phi((b - mu - sigma**2) / sigma) - _phi((a - mu - sigma**2) / sigma)
    )
    return below + inside + above


def solve_mu(mean: float, sigma: float, lo: float, hi: float) -> float:
    """The log-space location whose clipped mean is `mean` (bisection; the mean rises with mu)."""
    if not lo < mean < hi:
        raise ValueError(f"mean {mean} must lie strictly inside the clip range [{lo}, {hi}]")
    left, right = math.log(lo) - 10 * sigma, math.log(hi) + 10 * sigma
    for _ in range(200):
        mid = (left + right) / 2
        if clipped_lognormal_mean(mid, sigma, lo, hi) < mean:
            left = mid
        else:
            right = mid
    return (left + right) / 2


def normal_token_ids(tokenizer, vocab_size: int | None = None) -> list[int]:
    """Ids of ordinary tokens: the model's vocabulary minus the tokenizer's special tokens."""
    size = vocab_size if vocab_size is not None else len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids = [i for i in range(size) if i not in special]
    if not ids:
        raise ValueError("the vocabulary has no ordinary tokens to draw prompts from")
    return ids


def make_trace(
    spec: TraceSpec,
    num_requests: int,
    token_ids: list[int],
    *,
    seed: int = 0,
    scale: float = 1.0,
    max_len: int | None = None,
) -> list[TraceRequest]:
    """`num_requests` requests of `spec`, lengths multiplied by `scale` (>= 1 token each) and
    capped at `max_len` (prompt and output separately), prompts drawn from `token_ids`."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    mu_p = solve_mu(spec.prompt_mean, spec.prompt_sigma, spec.min_len, spec.max_len)
    mu_o = solve_mu(spec.output_mean, spec.output_sigma, spec.min_len, spec.max_len)
    requests = []
    for i in range(num_requests):
        rng = random.Random(f"{seed}:{spec.name}:{i}")  # str seeds hash stably across processes
        prompt_len = _length(rng.lognormvariate(mu_p, spec.prompt_sigma), spec, scale, max_len)
        output_len = _length(rng.lognormvariate(mu_o, spec.output_sigma), spec, scale, max_len)
        prompt = [token_ids[rng.randrange(len(token_ids))] for _ in range(prompt_len)]
        requests.append(TraceRequest(prompt, output_len))
    return requests


def _length(x: float, spec: TraceSpec, scale: float, max_len: int | None) -> int:
    n = min(max(round(x), spec.min_len), spec.max_len)
    n = max(1, round(n * scale))
    return min(n, max_len) if max_len is not None else n


def summarize(trace: list[TraceRequest]) -> dict[str, float | int]:
    prompts = [len(r.prompt_token_ids) for r in trace]
    outputs = [r.output_len for r in trace]
    return {
        "num_requests": len(trace),
        "prompt_mean": sum(prompts) / len(prompts),
        "output_mean": sum(outputs) / len(outputs),
        "prompt_max": max(prompts),
        "output_max": max(outputs),
        "total_prompt_tokens": sum(prompts),
        "total_output_tokens": sum(outputs),
    }
