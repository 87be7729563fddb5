"""One step's scheduled tokens packed into one flat batch, and its attention metadata.

All scheduled tokens of all sequences form one flat batch, in plan order: their ids,
positions and cache slots, each sequence's query and context lengths and block table, the
rows whose logits are sampled (the last known token of each sampling sequence, then each of
its proposed tokens), the positions whose logits give prompt logprobs, and each token's LoRA
adapter. `attention_metadata` turns it into the tensors every attention backend reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamengine.models.attention import AttentionMetadata, KVCaches
from streamengine.models.kv_scales import KVScales
from streamengine.sched.plan import SchedulerOutput


@dataclass(slots=True)
class PackedBatch:
    """One step's scheduled tokens as flat host lists, in plan order."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    # The last known token of each sampling sequence, then each of its proposed tokens.
    logits_indices: list[int] = field(default_factory=list)
    prompt_rows: PromptRows | None = None  # positions whose logits give prompt logprobs
    # Each token's LoRA adapter (None: the base model), filled only when some sequence has one.
    lora_rows: list | None = None


@dataclass(slots=True)
class PromptRows:
    """The positions of one step whose logits give prompt logprobs, in plan order: each row's
    index in the flat batch, the prompt token it scores (the next one), and how many top
    alternatives its request wants; `counts` splits the rows by scheduled sequence."""

    indices: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, first_index: int, targets: list[int], k: int) -> None:
        self.indices.extend(range(first_index, first_index + len(targets)))
        self.targets.extend(targets)
        self.top_k.extend([k] * len(targets))
        self.counts.append(len(targets))


def pack_batch(plan: SchedulerOutput, block_size: int) -> PackedBatch:
    batch = PackedBatch()
    for item in plan.scheduled:
        seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
        table = seq.block_table
        if item.num_prompt_logprobs:
            rows = batch.prompt_rows = batch.prompt_rows or PromptRows()
            targets = seq.token_ids[start + 1:start + 1 + item.num_prompt_logprobs]
            rows.add(len(batch.token_ids), targets, seq.prompt_logprobs or 0)
        k = item.num_spec_tokens
        if seq.lora is not None and batch.lora_rows is None:
            batch.lora_rows = [None] * len(batch.token_ids)
        if batch.lora_rows is not None:
            batch.lora_rows.extend([seq.lora] * n)
        batch.token_ids.extend(seq.token_ids[start:start + n - k])
        if k:
            batch.token_ids.extend(seq.spec_token_ids[:k])
        batch.positions.extend(range(start, start + n))
        batch.slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        # Each proposed token is a row of its own over the same blocks, its context ending
        # at itself: causal among the proposals, and a decode row for the attention kernels.
        batch.query_lens.append(n - k)
        batch.seq_lens.append(start + n - k)
        batch.block_tables.append(table)
        for end in range(start + n - k + 1, start + n + 1):
            batch.query_lens.append(1)
            batch.seq_lens.append(end)
            batch.block_tables.append(table)
        if item.samples:  # the last known token's row, then each proposed token's
            last = len(batch.token_ids) - 1
            batch.logits_indices.extend(range(last - k, last + 1))
    return batch


def attention_metadata(batch: PackedBatch, kv_caches: KVCaches, device: torch.device,
                       kv_scales: KVScales | None = None) -> AttentionMetadata:
    max_blocks = max(len(t) for t in batch.block_tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in batch.block_tables]
    starts = [0]
    for n in batch.query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        query_lens_host=batch.query_lens,
        seq_lens_host=batch.seq_lens,
        max_query_len=max(batch.query_lens),
        kv_caches=kv_caches,
        kv_scales=kv_scales,
    )
