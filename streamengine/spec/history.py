"""The "suffix" method's memory: recent outputs of each tenant (and user), searched like the prompt.

Agentic and templated traffic repeats itself across requests: the same tool-call scaffolding,
the same answer layout, the same code. Besides the request's own tokens (ngram.py), "suffix"
looks up the request's last n tokens in the outputs its tenant's earlier requests gave, and
proposes what followed there. The outputs are kept per (tenant, cache salt), packed in one
buffer per key with a separator between them, the oldest dropped first past `max_tokens` per
key, and at most `max_keys` keys (least recently used dropped): one tenant's outputs (or one
user's, under a per-user salt) never become another's proposals. Proposals are verified, so
they never change an output; kept apart, they cannot make one tenant's text speed up another's
either, which would tell it what the other generated.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from streamengine.spec.ngram import ITEM, last_occurrence, pack

# No token id is negative, so no token packs with a 0xff top byte: ff ff ff ff occurs only as
# a whole separator, never across two tokens, and no match runs across two outputs.
SEPARATOR = pack([-1])
MAX_KEYS = 256

HistoryKey = tuple[str, str | None]  # (tenant, cache salt)


class OutputHistory:
    def __init__(self, max_tokens: int, max_keys: int = MAX_KEYS) -> None:
        self.max_tokens = max_tokens
        self.max_keys = max_keys
        self._buffers: OrderedDict[HistoryKey, bytearray] = OrderedDict()

    def add(self, key: HistoryKey, output_ids: list[int]) -> None:
        """Remembers one finished output of `key`'s."""
        if not output_ids:
            return
        buffer = self._buffers.pop(key, None) or bytearray()
        buffer += pack(output_ids[-self.max_tokens:]) + SEPARATOR
        excess = len(buffer) - (self.max_tokens + 1) * ITEM
        if excess > 0:  # drop whole outputs from the front
            del buffer[:buffer.find(SEPARATOR, excess) + ITEM]
        self._buffers[key] = buffer
        while len(self._buffers) > self.max_keys:
            self._buffers.popitem(last=False)

    def lookup(self, key: HistoryKey, token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
        """Up to `k` tokens that followed the latest occurrence, in `key`'s outputs, of the
        last n tokens of `token_ids` (the largest n in [n_min, n_max] that occurs)."""
        buffer = self._buffers.get(key)
        if buffer is None or k <= 0 or len(token_ids) < n_min:
            return []
        self._buffers.move_to_end(key)
        tokens = len(buffer) // ITEM
        for n in range(min(n_max, len(token_ids)), n_min - 1, -1):
            start = last_occurrence(buffer, pack(token_ids[-n:]), tokens - 1)
            if start is not None:
                follow = bytes(buffer[(start + n) * ITEM:(start + n + k) * ITEM])
                end = follow.find(SEPARATOR)
                return _unpack(follow if end < 0 else follow[:end])
        return []


def _unpack(packed: bytes) -> list[int]:
    out = array("i")
    out.frombytes(packed)
    return out.tolist()
