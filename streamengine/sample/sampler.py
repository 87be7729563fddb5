"""The batched sampler of the decode step, and the per-sample generators it draws from.

The sampler turns one row of logits per running request into one token per request. Every
filter is applied to the whole batch at once where the parameters allow; the only per-row
Python loop left is the draw of each seeded row's noise from its own generator, which is
what makes a seeded request reproducible whatever requests it shares a batch with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from streamengine.sample.sampling_params import SamplingParams
from streamengine.structured.grammar import GrammarMatcher
from streamengine.structured.mask import TokenMasker

_UINT64_MASK = 0xFFFF_FFFF_FFFF_FFFF


def sample_generator(
    params: SamplingParams, index: int, device: torch.device | str
) -> torch.Generator | None:
    """The generator of sample `index` of a request: seeded with seed + index (wrapped to 64
    bits), so each sample of a seeded request draws from its own stream, reproducible whatever
    else is in the batch. It lives on the logits' `device` (torch draws into a CUDA tensor only
    from a CUDA generator). None when unseeded: the engine's default generator is used."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed((params.seed + index) & _UINT64_MASK)


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits: the request's params, its own generator (when seeded), its
    tokens, and its grammar matcher (structured outputs only)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    matcher: GrammarMatcher | None = None
    # The ids that would end the sample (EOS unless ignore_eos, stop_token_ids): forbidden
    # while it has fewer than params.min_tokens output tokens. Empty without min_tokens.
    min_tokens_stop_ids: frozenset[int] = frozenset()
    # Index tensors on the logits' device, built at the row's first step (adjust_logits):
    # per step they would cost a host-to-device copy per row.
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias ids, values
    early_stop_index: torch.Tensor | None = None  # min_tokens_stop_ids


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row; None where the row asked for none


class Sampler:
    """Grammar mask -> logit bias -> min_tokens mask -> penalties -> temperature -> top-k -> top-p -> min-p
    -> sample, for a batch.

    `logits` is never modified. Greedy rows take the argmax of their penalized logits. Random
    rows run an exponential race (the Gumbel-max trick): argmax(p / q), q ~ Exp(1) made from
    uniform noise of shape [V] drawn from the row's own generator (or `default_generator` when
    the row has none), so a seeded row's token depends only on its logits and its generator,
    never on its batch mates. Rows with a grammar matcher first have every token their grammar
    forbids set to -inf (one bitmask for all of them, `masker`); rows without one are untouched.
    Logprobs are of these logits (masked where constrained), before the logit bias, the
    min_tokens mask, penalties and temperature.
    """

    def __init__(self, masker: TokenMasker | None = None) -> None:
        self.masker = masker if masker is not None else TokenMasker()

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        default_generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        logits = logits.float()  # no copy when already float32
        if any(row.matcher is not None for row in rows):
            logits = self.masker.apply(logits, [row.matcher for row in rows])  # a masked copy
        params = [row.params for row in rows]
        want_logprobs = any(p.logprobs is not None for p in params)
        allowed = adjust_logits(logits, rows)  # a copy only when some row has a bias or min_tokens
        if not want_logprobs and all(p.greedy and not p.has_penalties for p in params):
            # The common greedy decode step: one kernel, no per-row work.
            return SamplerOutput(greedy_tokens(allowed).tolist(), [None] * len(rows))

        scores = apply_penalties(allowed, rows)  # [B, V]; a private copy unless it is `logits`
        private = scores is not logits
        greedy = [i for i, p in enumerate(params) if p.greedy]
        stochastic = [i for i, p in enumerate(params) if not p.greedy]
        if not stochastic:
            token_ids = greedy_tokens(scores)  # [B]
        elif not greedy:
            token_ids = _sample_random(scores, rows, default_generator, private)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)  # [B]
            idx = _index(greedy, logits.device)
            token_ids[idx] = greedy_tokens(scores.index_select(0, idx))
            idx = _index(stochastic, logits.device)
            sub = scores.index_select(0, idx)  # [R, V], a copy
            token_ids[idx] = _sample_random(
                sub, [rows[i] for i in stochastic], default_generator, True
            )
        logprobs = (
            _gather_logprobs(logits, params, token_ids) if want_logprobs else [None] * len(rows)
        )
        return SamplerOutput(token_ids.tolist(), logprobs)


def adjust_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`logits` with each row's `params.logit_bias` added, then its `min_tokens_stop_ids` at
    -inf while it has fewer than `min_tokens` output tokens (vLLM's min-tokens processor: a
    sample may not end, nor carry an end-of-sequence token mid-output, before min_tokens).
    A grammar's -inf stays (a bias cannot undo it), and rows with a grammar keep their stop
    ids (a complete grammar allows only the end of sequence), as does a row whose ids would
    forbid the whole vocabulary. One copy for all rows; `logits` itself when none needs it."""
    vocab = logits.shape[1]
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    early = [
        i for i, row in enumerate(rows)
        if row.min_tokens_stop_ids and row.matcher is None
        and len(row.output_token_ids) < row.params.min_tokens and len(row.min_tokens_stop_ids) < vocab
    ]
    if not biased and not early:
        return logits
    out = logits.clone()  # [B, V]
    for i in biased:
        ids, values = _bias_index(rows[i], logits.device)
        out[i].index_add_(0, ids, values)
    for i in early:
        out[i].index_fill_(0, _early_stop_index(rows[i], vocab, logits.device), -math.inf)
    return out


def _bias_index(row: SamplingRow, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if row.bias_index is None:
        bias = row.params.logit_bias
        row.bias_index = (_index(list(bias), device), torch.tensor(list(bias.values()), dtype=torch.float32, device=device))
    return row.bias_index


def _early_stop_index(row: SamplingRow, vocab: int, device: torch.device) -> torch.Tensor:
    if row.early_stop_index is None:
        row.early_stop_index = _index(sorted(t for t in row.min_tokens_stop_ids if t < vocab), device)
    return row.early_stop_index


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """The argmax of each row, first index on ties (as argmax)."""
    return _row_arg(scores, np.argmax, torch.argmax)


def _row_arg(scores: torch.Tensor, numpy_arg, torch_arg) -> torch.Tensor:
    """Each row's argmax or argmin: NumPy's on CPU float tensors (the same index, first on ties
    and at the first NaN, and faster than torch's reduction over a vocabulary on CPU), torch's
    elsewhere."""
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(numpy_arg(scores.numpy(), axis=-1))
    return torch_arg(scores, dim=-1)


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


def _column(
    values: list[float] | list[int], like: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Per-row values as an [R, 1] column on `like`'s device (in its dtype unless given)."""
    return torch.tensor(values, dtype=dtype or like.dtype, device=like.device).unsqueeze(1)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties of each row, as the sampler applies them.

    Returns a new tensor when some row uses penalties, else `logits` itself (never modified).
    Only the logits of tokens that occurred are touched: the work grows with the number of
    tokens, not with batch x vocab.
    """
    if not any(row.params.has_penalties for row in rows):
        return logits
    out = logits.clone()  # [B, V]
    vocab = logits.shape[1]
    # HF semantics: every token seen in prompt or output is pushed toward "less likely"
    # (positive logits divided, negative multiplied), however often it was seen.
    seen = [
        (i, r.prompt_token_ids + r.output_token_ids)
        for i, r in enumerate(rows)
        if r.params.repetition_penalty != 1.0
    ]
    if seen:
        row_idx, token_idx, _ = _token_counts(seen, vocab, out.device)
        penalty = _per_pair([r.params.repetition_penalty for r in rows], row_idx, out)  # [U]
        values = out[row_idx, token_idx]  # [U], positions are unique
        out[row_idx, token_idx] = torch.where(values > 0, values / penalty, values * penalty)
    # OpenAI semantics, over generated tokens only: logit -= presence * [count > 0] + frequency * count
    generated = [
        (i, r.output_token_ids)
        for i, r in enumerate(rows)
        if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
    ]
    if generated:
        row_idx, token_idx, counts = _token_counts(generated, vocab, out.device)
        presence = _per_pair([r.params.presence_penalty for r in rows], row_idx, out)  # [U]
        frequency = _per_pair([r.params.frequency_penalty for r in rows], row_idx, out)  # [U]
        out[row_idx, token_idx] -= presence + frequency * counts
    return out


def _per_pair(per_row: list[float], row_idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each row's value, repeated for every (row, token) pair of that row."""
    return torch.tensor(per_row, dtype=like.dtype, device=like.device)[row_idx]


def _token_counts(
    groups: list[tuple[int, list[int]]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs of `groups` and how often each occurs, as [U] tensors."""
    lengths = torch.tensor([len(ids) for _, ids in groups], dtype=torch.long)
    rows = torch.repeat_interleave(
        torch.tensor([row for row, _ in groups], dtype=torch.long), lengths
    )
    ids = torch.tensor(list(chain.from_iterable(ids for _, ids in groups)), dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}) to be penalized")
    keys, counts = torch.unique(rows * vocab + ids, return_counts=True)  # one key per (row, token)
    keys, counts = keys.to(device), counts.to(device)
    return keys // vocab, keys % vocab, counts.float()


_MIN_THRESHOLD = 1e-30
"""Floor of a row's probability threshold: probabilities are divided by it, and below e^-69
a token is never drawn in practice anyway."""
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1: `x > _BELOW_ONE` is `x >= 1`


def _sample_random(
    scores: torch.Tensor, rows: list[SamplingRow], default: torch.Generator | None, private: bool
) -> torch.Tensor:
    """One token per row of `scores` [R, V]; edits `scores` in place only when `private`."""
    params = [row.params for row in rows]
    if any(p.temperature != 1.0 for p in params):
        temperature = _column([p.temperature for p in params], scores)  # [R, 1]
        scores = scores.div_(temperature) if private else scores / temperature
    probs = scores.softmax(dim=-1)  # [R, V]
    threshold = _filter_threshold(probs, params)  # [R, 1] or None
    if threshold is not None:
        # top-k, top-p and min-p each keep the tokens at or above a probability. Scaling each
        # row by 1/threshold turns that into one scalar cut, which torch's threshold_ does in
        # a single fast pass (a per-row mask through masked_fill_ costs several times more);
        # the scale does not change which token the race below picks.
        probs.div_(threshold.clamp_(min=_MIN_THRESHOLD))
        torch.nn.functional.threshold_(probs, _BELOW_ONE, 0.0)
    # Exponential race: argmax(p / q), q = -log(u) ~ Exp(1) for u ~ U[0, 1), is a sample of p
    # (the Gumbel-max trick in probability space) and equals argmin(p / log u). Dropped
    # tokens give -0.0 and never win; u < 1 keeps log u < 0, so no division by zero or NaN.
    log_u = _uniform_noise(probs, rows, default).log_()  # [R, V]
    return _row_arg(probs.div_(log_u), np.argmin, torch.argmin)  # [R]


def _uniform_noise(
    like: torch.Tensor, rows: list[SamplingRow], default: torch.Generator | None
) -> torch.Tensor:
    noise = torch.empty_like(like)  # [R, V]
    shared = [j for j, row in enumerate(rows) if row.generator is None]
    if len(shared) == len(rows):
        return noise.uniform_(generator=default)
    # A seeded row draws a full [V] row from its own generator, so its draw never depends on
    # its batch mates; unseeded rows share one draw from the default generator.
    for j, row in enumerate(rows):
        if row.generator is not None:
            noise[j].uniform_(generator=row.generator)
    if shared:
        shape = (len(shared), like.shape[1])
        noise[_index(shared, like.device)] = torch.empty(
            shape, dtype=like.dtype, device=like.device
        ).uniform_(generator=default)
    return noise


def _filter_threshold(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """The smallest probability each row keeps after top-k, then top-p, then min-p [R, 1].

    Every filter keeps the most likely tokens down to some probability, so their composition
    is one threshold. Top-p acts on the top-k survivors renormalized, as when applied in turn;
    min-p is relative to the largest probability, which no filter removes.
    """
    vocab = probs.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    use_k = min(ks) < vocab
    use_p = any(p.top_p < 1.0 for p in params)
    if use_p:
        threshold = _top_k_top_p_threshold(probs, ks, [p.top_p for p in params])
    elif use_k:
        top = probs.topk(max(k for k in ks if k < vocab), dim=-1).values  # [R, k_max], descending
        kth = _column([min(k, top.shape[1]) - 1 for k in ks], top, torch.long)  # [R, 1]
        threshold = top.gather(1, kth)  # [R, 1]
        threshold.masked_fill_(_column(ks, top, torch.long) == vocab, 0.0)  # rows without top-k
    elif any(p.min_p > 0.0 for p in params):
        threshold = torch.zeros(len(params), 1, dtype=probs.dtype, device=probs.device)
    else:
        return None
    if any(p.min_p > 0.0 for p in params):
        min_p = _column([p.min_p for p in params], probs)  # [R, 1]
        threshold = torch.maximum(threshold, min_p * probs.amax(dim=-1, keepdim=True))
    return threshold


def _top_k_top_p_threshold(probs: torch.Tensor, ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = probs.shape[1]
    ascending = _sort_ascending(probs)  # [R, V]
    cumulative = ascending.cumsum(dim=-1)  # [R, V], non-decreasing
    total = cumulative[:, -1:]  # [R, 1]
    # The mass before the token at ascending position j, counted from the most likely one, is
    # total - cumulative[j]. Top-k keeps the last k positions: their mass is total - below_k.
    num_out = _column([vocab - k for k in ks], probs, torch.long)  # [R, 1]
    below_k = cumulative.gather(1, (num_out - 1).clamp_(min=0))  # [R, 1]
    below_k.masked_fill_(num_out == 0, 0.0)
    top_p = _column(top_ps, probs)  # [R, 1]
    limit = top_p * (total - below_k)  # [R, 1]
    # Keep a token while the mass before it is below the limit: drop the positions with
    # cumulative <= total - limit. The most likely token (mass before it 0) always stays.
    dropped = torch.searchsorted(cumulative, total - limit, right=True)  # [R, 1]
    # Rows without top-p take exactly their top-k cut (the sum above may round across it).
    first_kept = torch.where(top_p < 1.0, torch.maximum(dropped, num_out), num_out)  # [R, 1]
    return ascending.gather(1, first_kept.clamp_(max=vocab - 1))  # [R, 1]


def _sort_ascending(probs: torch.Tensor) -> torch.Tensor:
    """Each row sorted, smallest first. Only the values are needed, not the token order."""
    if probs.device.type != "cpu":
        return probs.sort(dim=-1).values
    # torch's CPU sort always tracks indices and is much slower than numpy's SIMD sort; a
    # full-vocab sort is the costliest step of top-p.
    return torch.from_numpy(np.sort(probs.detach().numpy(), axis=-1))  # [R, V]


def _gather_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: torch.Tensor
) -> list[dict[int, float] | None]:
    chosen = [i for i, p in enumerate(params) if p.logprobs is not None]
    idx = _index(chosen, logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, idx), dim=-1)  # [R, V]
    sampled = token_ids.index_select(0, idx)  # [R]
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()  # [R]
    k_max = max(params[i].logprobs or 0 for i in chosen)
    top_lp: list[list[float]] = [[] for _ in chosen]
    top_ids: list[list[int]] = [[] for _ in chosen]
    if k_max > 0:
        values, ids = logprobs.topk(k_max, dim=-1)  # [R, k_max]
        top_lp, top_ids = values.tolist(), ids.tolist()
    result: list[dict[int, float] | None] = [None] * len(params)
    for j, (i, token) in enumerate(zip(chosen, sampled.tolist(), strict=True)):
        k = params[i].logprobs or 0
        # A constrained row may allow fewer than k tokens: the forbidden ones (-inf) are left out.
        entry = {t: lp for t, lp in zip(top_ids[j][:k], top_lp[j][:k], strict=True) if lp != -math.inf}
        entry.setdefault(token, sampled_lp[j])
        result[i] = entry
    return result
