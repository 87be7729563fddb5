"""Prompt lookup ("ngram"): propose what followed the last time the request's latest tokens occurred.

Text that quotes its input (edits of given code, extraction from a passage, templated answers)
repeats runs of tokens already in the context. The request's last n tokens are searched for
earlier in its own tokens (prompt and output), longest n first; the tokens that followed the
most recent earlier occurrence (one followed by k tokens, if any is) are the proposal. No
model runs: the search is a substring search over the tokens packed as 4-byte integers
(bytes.rfind, in C).
"""

from __future__ import annotations

from array import array

ITEM = 4  # bytes per packed token


def pack(token_ids: list[int]) -> bytes:
    return array("i", token_ids).tobytes()


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens to follow `token_ids`: those after an earlier occurrence of its last n
    tokens, for the largest n in [n_min, n_max] that occurs. The most recent occurrence that
    k tokens follow, else the most recent (fewer follow it); [] if none occurs."""
    num = len(token_ids)
    if num <= n_min or k <= 0:
        return []
    packed = pack(token_ids)
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        suffix = packed[(num - n) * ITEM:]
        start = last_occurrence(packed, suffix, num - k) if num - k >= n else None
        if start is None:
            start = last_occurrence(packed, suffix, num - 1)
        if start is not None:
            return token_ids[start + n:start + n + k]
    return []


def last_occurrence(packed: bytes, needle: bytes, end: int) -> int | None:
    """The token index where the last whole-token occurrence of `needle` within the first
    `end` tokens of `packed` starts, or None."""
    limit = end * ITEM
    while True:
        at = packed.rfind(needle, 0, limit)
        if at < 0:
            return None
        if at % ITEM == 0:
            return at // ITEM
        limit = at + len(needle) - 1  # a match straddling tokens: look further left
