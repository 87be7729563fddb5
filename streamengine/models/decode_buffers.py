"""The fixed-address inputs of decode steps replayed as graphs, and their batch-size buckets.

A captured CUDA graph replays the exact kernels it recorded, reading from the exact addresses
and shapes it saw: no Python runs, so nothing can be allocated, resized or read back on the
host. So a decode step does not hand the model new tensors; it copies its rows into buffers
allocated once (token ids, positions, slot mapping, context lengths, block tables), padded up
to the smallest bucket that holds them, and the bucket's graph runs over the first `bucket`
rows of those buffers.

Padding rows must not disturb real ones: each writes its K/V into a pad block the KV pool
never hands out (one block past the pool, allocated beside it) and attends over that one slot
alone. Every per-row computation of the model is row-independent, so real rows get the values
they would get in a batch of their own size (up to the GEMMs' own rounding for another M).

Nothing here needs a GPU: the same buffers serve the eager replay on CPU that the tests use.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from streamengine.models.attention import AttentionMetadata, KVCaches
from streamengine.models.kv_scales import KVScales

if TYPE_CHECKING:
    from streamengine.models.packed_batch import PackedBatch

MAX_GRAPH_ROWS = 256
"""The largest bucket captured, whatever max_num_seqs says: bigger decode batches are bound
by the weights' GEMMs, not by launches, and each bucket's graph holds its own activations."""


class BatchTooLarge(ValueError):
    """A decode step has more rows than the largest bucket: it runs eagerly instead."""


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8 (vLLM's buckets) up to `max_rows`, and `max_rows`
    itself, so every batch up to it has a bucket that wastes fewer than 8 rows."""
    if max_rows < 1:
        raise ValueError(f"decode graphs need at least one row per bucket, got max_rows={max_rows}")
    sizes = [s for s in (1, 2, 4) if s <= max_rows] + list(range(8, max_rows + 1, 8))
    if sizes[-1] != max_rows:
        sizes.append(max_rows)
    return tuple(sizes)


def pick_bucket(num_rows: int, sizes: tuple[int, ...]) -> int:
    """The smallest bucket holding `num_rows` rows; BatchTooLarge past the largest."""
    if num_rows < 1:
        raise ValueError(f"a decode step has at least one row, got {num_rows}")
    i = bisect.bisect_left(sizes, num_rows)
    if i == len(sizes):
        raise BatchTooLarge(f"a decode step of {num_rows} rows exceeds the largest graph bucket ({sizes[-1]})")
    return sizes[i]


class DecodeBuffers:
    """Per-row inputs of up to `max_rows` decode rows on `device`, allocated once. `fill`
    copies a step's rows in and pads the rest of its bucket; `metadata` views the first
    `bucket` rows as the attention backends' `AttentionMetadata`."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, pad_block: int,
                 device: torch.device) -> None:
        self.max_rows, self.width = max_rows, max_blocks_per_seq
        self.pad_block, self.pad_slot = pad_block, pad_block * block_size
        self.device = device
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)  # [R]
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)  # [R]
        self.slot_mapping = torch.full((max_rows,), self.pad_slot, dtype=torch.int64, device=device)  # [R]
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)  # [R]
        self.block_tables = torch.full((max_rows, max_blocks_per_seq), pad_block, dtype=torch.int32,
                                       device=device)  # [R, W]
        # One query token per row: the row starts never change.
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # [R + 1]
        # Host staging, pinned on CUDA so the copies are asynchronous; written through numpy,
        # once the previous step's copies out of it have landed (`_copied`).
        pin = device.type == "cuda"
        self._copied = torch.cuda.Event() if pin else None
        self._host_rows = torch.zeros((3, max_rows), dtype=torch.int64, pin_memory=pin)  # ids, positions, slots
        self._host_lens = torch.ones(max_rows, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.full((max_rows, max_blocks_per_seq), pad_block, dtype=torch.int32, pin_memory=pin)
        self.seq_lens_host: list[int] = []  # the last fill's context lengths, padding rows included

    def fill(self, batch: PackedBatch, bucket: int) -> None:
        """Copies the rows of `batch` (every row one token) into the buffers, then padding rows
        up to `bucket`: token 0 at position 0, writing the pad slot, a context of that slot alone."""
        n = len(batch.token_ids)
        if not n <= bucket <= self.max_rows:
            raise ValueError(f"{n} rows do not fit a bucket of {bucket} (buffers hold {self.max_rows})")
        longest = max(len(t) for t in batch.block_tables)
        if longest > self.width:
            raise ValueError(f"a block table of {longest} blocks exceeds the graph buffers' {self.width}")
        if self._copied is not None:
            self._copied.synchronize()  # sampling has usually waited for it already
        self._stage(batch, bucket)
        self._upload(bucket, longest)
        self.seq_lens_host = [*batch.seq_lens, *[1] * (bucket - n)]

    def _stage(self, batch: PackedBatch, bucket: int) -> None:
        """The step's rows and its padding rows into the host staging."""
        n = len(batch.token_ids)
        rows, lens, tables = self._host_rows.numpy(), self._host_lens.numpy(), self._host_tables.numpy()
        rows[0, :n], rows[1, :n], rows[2, :n] = batch.token_ids, batch.positions, batch.slot_mapping
        rows[:2, n:bucket], rows[2, n:bucket] = 0, self.pad_slot
        lens[:n], lens[n:bucket] = batch.seq_lens, 1
        for i, table in enumerate(batch.block_tables):
            tables[i, :len(table)] = table  # entries past a row's context are never read
        tables[n:bucket, 0] = self.pad_block

    def _upload(self, bucket: int, longest: int) -> None:
        """The staging's first `bucket` rows into the device buffers, asynchronously on CUDA."""
        self.input_ids[:bucket].copy_(self._host_rows[0, :bucket], non_blocking=True)
        self.positions[:bucket].copy_(self._host_rows[1, :bucket], non_blocking=True)
        self.slot_mapping[:bucket].copy_(self._host_rows[2, :bucket], non_blocking=True)
        self.seq_lens[:bucket].copy_(self._host_lens[:bucket], non_blocking=True)
        # Only the columns the longest table uses: rows are max_model_len wide.
        self.block_tables[:bucket, :longest].copy_(self._host_tables[:bucket, :longest], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def metadata(self, bucket: int, kv_caches: KVCaches, seq_lens_host: list[int],
                 kv_scales: KVScales | None = None) -> AttentionMetadata:
        """The first `bucket` rows as one decode step's metadata. `seq_lens_host` is what the
        backend plans with on the host: the step's own lengths, or for a captured graph an
        upper bound valid for every replay. `kv_scales`: an fp8 cache's."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[:bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            query_lens_host=[1] * bucket,
            seq_lens_host=seq_lens_host,
            max_query_len=1,
            kv_caches=kv_caches,
            kv_scales=kv_scales,
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every device buffer (their addresses must never change: graphs hold them)."""
        return (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables,
                self.query_start_loc)
