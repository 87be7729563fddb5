"""Per-sequence state: the tokens known so far, how many have K/V in the cache, and where."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

DRAFT_SLOT = -1
"""A proposed token the draft model has yet to choose (models/draft.py)."""

class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its blocks copied to the host pool
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens with its own block table.

    `token_ids` holds prompt and output tokens; `num_computed_tokens` of them have K/V in the
    cache. Scheduling only ever asks that `num_computed_tokens` catch up to `num_tokens`, which
    covers prefill, chunked prefill, decode, prefix-cache hits and recompute after preemption.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    # Owned by the block manager: physical block ids, and chained hashes of the full blocks
    # of `token_ids` (computed lazily, so len(block_hashes) <= num_tokens // block_size).
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    cpu_block_table: list[int] = field(default_factory=list)  # host blocks while SWAPPED
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    group_size: int = 1  # sequences of the same request (n > 1): they share blocks
    tenant: str = "default"  # whose share this sequence's service counts against
    # Salts by token range, for prefixes shared more widely than the request's own salt:
    # ((start_token, salt), ...) in increasing start order. A block is hashed with the salt of
    # the last segment starting at or before the block's last token, so a block that mixes a
    # shared preamble with private tokens is private. Empty: `cache_salt` for every block.
    salt_segments: tuple[tuple[int, str | None], ...] = ()
    # Top logprobs per prompt position while its prompt's logprobs are still to compute
    # (SamplingParams.prompt_logprobs), else None: every prompt position must then run, so the
    # sequence reads no prefix-cache hits (it still caches its own blocks).
    prompt_logprobs: int | None = None
    # Speculative decoding: tokens proposed to follow `token_ids`, for the next step to verify
    # (the scheduler verifies those the budget and the pool hold room for); DRAFT_SLOT where
    # the draft model fills them in, once the step has their slots.
    spec_token_ids: list[int] = field(default_factory=list)
    # The request's LoRA adapter (lora/adapter.py's LoRAAdapter), None for the base model.
    lora: Any = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """False while its prompt's logprobs are wanted: its first step starts at position 0."""
        return self.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
