"""The draft model of speculative decoding: a smaller model with the target's tokenizer that
proposes the next tokens of the requests the core marked for it.

Its K and V live in the target's blocks (one block id holds both models' K and V of the same
16 tokens, KVCacheSpec.draft_shape): it computes every token the target computes, in the same
step (`follow`), so prefix-cache hits, chunked prefill, copy-on-write, swaps and recompute
keep the two caches of a block in step without bookkeeping of their own. Before the target's
forward, `propose` runs k batched one-token passes for the sequences whose proposals are
placeholders (DRAFT_SLOT): the last known token, then each greedy choice after it. Those
passes write the draft's K/V at the positions the step then verifies, into slots the scheduler
already allocated for the proposals; `follow` writes the same tokens there again.

The proposals are the draft's argmax, a point mass per position: the verifier's rule (accept
while the token the target draws equals the proposal) keeps the target's outputs exact,
greedy and sampled alike, whatever the draft proposes.
"""

from __future__ import annotations

import dataclasses

import torch

from streamengine.config import EngineConfig
from streamengine.kv.spec import KVCacheSpec
from streamengine.models.loader import LoadedModel
from streamengine.models.model_runner import PagedModel
from streamengine.models.packed_batch import PackedBatch
from streamengine.sched.plan import ScheduledSeq, SchedulerOutput
from streamengine.sequence import DRAFT_SLOT


def check_draft(draft: LoadedModel, target: LoadedModel) -> None:
    """A draft must share the target's tokenizer: its token ids are the target's."""
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"SpeculativeConfig.model: the draft model {draft.name!r} has another tokenizer than "
                         f"{target.name!r}; a draft must use the target's token ids")


class DraftModel(PagedModel):
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, kv: KVCacheSpec,
                 vocab_size: int) -> None:
        # The draft runs as its own files allow: the target's weight format may not apply to it.
        own = dataclasses.replace(config, weight_format="auto", int8_activations=False,
                                  model_impl="transformers" if config.model_impl == "transformers" else "auto")
        super().__init__(loaded, own, device, kv.draft())
        self.vocab_size = vocab_size  # the target's: a draft's padded rows past it are never proposed

    @torch.inference_mode()
    def propose(self, plan: SchedulerOutput) -> None:
        """Fills the proposals of the scheduled sequences that wait for the draft's."""
        items = [item for item in plan.scheduled
                 if item.num_spec_tokens and DRAFT_SLOT in item.seq.spec_token_ids[:item.num_spec_tokens]]
        if not items:
            return
        drafts = self._greedy_drafts(items)
        for item, tokens in zip(items, drafts, strict=True):
            item.seq.spec_token_ids = tokens

    def _greedy_drafts(self, items: list[ScheduledSeq]) -> list[list[int]]:
        """Each item's `num_spec_tokens` greedy tokens after its last token, one batched pass per
        position; a sequence leaves the batch once it has its number."""
        drafts: list[list[int]] = [[] for _ in items]
        last = [item.seq.token_ids[-1] for item in items]
        for r in range(max(item.num_spec_tokens for item in items)):
            live = [i for i, item in enumerate(items) if item.num_spec_tokens > r]
            batch = PackedBatch()
            for i in live:
                seq = items[i].seq
                position = seq.num_tokens - 1 + r
                table = seq.block_table
                batch.token_ids.append(last[i])
                batch.positions.append(position)
                batch.slot_mapping.append(table[position // self.block_size] * self.block_size + position % self.block_size)
                batch.query_lens.append(1)
                batch.seq_lens.append(position + 1)
                batch.block_tables.append(table)
            logits = self._logits(self._forward(batch))[:, :self.vocab_size]  # [live, vocab]
            for i, token in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(token)
                last[i] = token
        return drafts

    @torch.inference_mode()
    def follow(self, batch: PackedBatch) -> None:
        """Computes the draft's K/V of the tokens the target's step computed (no logits)."""
        self._forward(batch)
