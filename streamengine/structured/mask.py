"""The grammar mask of a decode step, with each request's share of its cost bounded.

`TokenMasker` (one per model runner) fills one bitmask [rows, ceil(vocab / 32)] for the rows
that follow a grammar and sets the logits of every token a grammar forbids to -inf. Most
grammars mask a row in well under a millisecond, but a hostile one (a regex such as
`(a{100}){100}`) can take many milliseconds per row, and the whole batch waits for the mask.
So the rows are filled one at a time, timed, and charged to their request's `MaskAccount`:
a request whose rows take more than its budget within one step is failed (its remaining rows
are not filled, and its next `accept` raises GrammarError), so a step waits at most about one
budget per such request. Every account's time is also added up per tenant.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance.torch
import numpy as np
import torch


@dataclass(slots=True)
class MaskAccount:
    """One request's mask time: every sample and beam of the request charges the same one."""

    tenant: str
    budget_s: float  # the most its rows may take within one step
    step: int = -1  # the masker's step its `step_s` belongs to
    step_s: float = 0.0
    total_s: float = 0.0
    # Why it went over its budget, once it did. A message, not an exception: a raised
    # exception keeps its traceback, whose frames hold the request's matchers, which hold this
    # account, a cycle that only the cyclic collector frees (tens of MB of lexer states each).
    error: str | None = None

    def charge(self, step: int, seconds: float) -> None:
        if step != self.step:
            self.step, self.step_s = step, 0.0
        self.step_s += seconds
        self.total_s += seconds
        if self.step_s > self.budget_s and self.error is None:
            self.error = (
                f"the structured-output grammar took {self.step_s * 1e3:.0f} ms to mask one decode step, "
                f"more than the budget of {self.budget_s * 1e3:g} ms (grammar_mask_budget_ms): use a simpler spec"
            )


class Maskable:
    """What the masker needs of a matcher (grammar.GrammarMatcher)."""

    account: MaskAccount | None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...


class TokenMasker:
    """Sets the forbidden tokens' logits to -inf, for the rows that have a matcher.

    One per model runner: it owns a reusable host bitmask, and the mask seconds per tenant."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._bitmask: torch.Tensor | None = None  # int32 [capacity, words], CPU
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._clock = clock
        self._step = 0
        self.seconds_by_tenant: dict[str, float] = {}

    def apply(self, logits: torch.Tensor, matchers: Sequence[Maskable | None]) -> torch.Tensor:
        """`logits` [rows, vocab] float32 with every row that has a matcher masked: a new
        tensor, or `logits` itself when no row has one (it is never modified)."""
        constrained = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not constrained:
            return logits
        self._step += 1
        bitmask = self._fill(constrained, logits.shape[1])  # [R, words] int32: bit set = allowed
        rows = [i for _, i in constrained]
        if logits.device.type == "cpu" and sys.byteorder == "little":
            return _mask_on_host(logits, rows, bitmask)
        return self._mask_on_device(logits, rows, bitmask)

    def _fill(self, constrained: list[tuple[Maskable, int]], vocab: int) -> torch.Tensor:
        """The allowed tokens of each constrained row, as int32 [R, words] on the host. A row
        whose request is over its budget allows every token: it is never sampled from (the
        request fails when the draw is accepted), and an all-forbidden row would be NaN."""
        rows, words = len(constrained), (vocab + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < rows or self._bitmask.shape[1] != words:
            self._bitmask = llguidance.torch.allocate_token_bitmask(max(rows, 8), vocab)
        bitmask = self._bitmask[:rows]  # the leading rows of a contiguous tensor: contiguous
        for j, (matcher, _) in enumerate(constrained):
            account = matcher.account
            if account is not None and account.error is not None:
                bitmask[j] = -1
                continue
            start = self._clock()
            matcher.fill_bitmask(bitmask, j)
            if account is not None:
                seconds = self._clock() - start
                account.charge(self._step, seconds)
                self.seconds_by_tenant[account.tenant] = self.seconds_by_tenant.get(account.tenant, 0.0) + seconds
        return bitmask

    def _mask_on_device(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
        # Bit b of word w is token 32 w + b (llguidance's layout), unpacked without a loop.
        bits = (bitmask.to(device).unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
        forbidden_tokens = bits.view(len(rows), -1)[:, :vocab] == 0  # [R, vocab]
        out = logits.clone()
        index = torch.tensor(rows, dtype=torch.long, device=device)
        out[index] = out[index].masked_fill_(forbidden_tokens, float("-inf"))
        return out


def _mask_on_host(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """The CPU form of the mask, in numpy: single-threaded and cheaper than torch's ops on
    tensors this small. On a little-endian host the int32 words, read as bytes with the low
    bit first, are the tokens in order."""
    vocab = logits.shape[1]
    out = logits.numpy().copy()  # [B, vocab] float32, contiguous
    forbidden = np.invert(bitmask.numpy()).view(np.uint8)  # [R, 4 * words]
    forbidden_tokens = np.unpackbits(forbidden, axis=1, count=vocab, bitorder="little")  # [R, vocab]
    for j, i in enumerate(rows):
        np.copyto(out[i], -np.inf, where=forbidden_tokens[j].view(bool))
    return torch.from_numpy(out)
