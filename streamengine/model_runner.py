"""Turns a scheduler plan into tensors, runs one packed forward over the paged cache, samples.

All scheduled tokens of all sequences form one flat batch (`input_ids` [T]); only the last
token of each sequence that samples goes through the output projection.
"""

from __future__ import annotations

import torch

from streamengine.config import EngineConfig
from streamengine.kv_cache import KVCacheSpec
from streamengine.models.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from streamengine.models.loader import LoadedModel
from streamengine.models.native import NativeDecoder, unsupported_reason
from streamengine.sampling import Sampler, SamplerOutput, SamplingRow
from streamengine.scheduler import SchedulerOutput


def model_shape(model_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a HF decoder config."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return model_config.num_hidden_layers, kv_heads, head_dim


def select_backend(
    name: str, device: torch.device, model_config, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype,
) -> AttentionBackend:
    if name in ("cpu", "auto") and device.type == "cpu":
        from streamengine.models.cpu_backend import CpuPagedAttention

        _, num_kv_heads, head_dim = model_shape(model_config)
        if CpuPagedAttention.available(
            model_config.num_attention_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype
        ):
            return CpuPagedAttention()
        if name == "cpu":
            raise ValueError(
                "attention_backend='cpu' needs a float32 model, a float32 or float16 KV cache, AVX-512, "
                "a C++ compiler and a supported head shape"
            )
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchPagedAttention()
    if kv_dtype != dtype:
        raise ValueError(
            f"attention_backend='triton' keeps the KV cache in the model's dtype ({dtype}); "
            f"kv_cache_dtype={kv_dtype} runs on CPU only"
        )
    from streamengine.models.triton_backend import TritonPagedAttention  # needs triton

    return TritonPagedAttention.create(device)


def select_native(model_impl: str, model, device: torch.device) -> NativeDecoder | None:
    """The native decoder for "native", and for "auto" on CPU when the model qualifies;
    None means transformers' own modules run (with the paged attention hook)."""
    if model_impl == "transformers":
        return None
    reason = unsupported_reason(model)
    if model_impl == "native" and reason is not None:
        raise ValueError(f"EngineConfig.model_impl='native' cannot run this model: {reason}")
    if reason is None and (model_impl == "native" or device.type == "cpu"):
        return NativeDecoder(model)
    return None


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, kv: KVCacheSpec) -> None:
        self.model = loaded.model
        self.device = device
        self.dtype = getattr(torch, config.dtype)
        self.kv_dtype = kv.dtype
        self.block_size = config.block_size
        self.num_blocks = kv.num_blocks
        num_layers, num_kv_heads, head_dim = model_shape(self.model.config)
        shape = (self.num_blocks, self.block_size, num_kv_heads, head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=device),
             torch.zeros(shape, dtype=self.kv_dtype, device=device))
            for _ in range(num_layers)
        ]
        self.num_cpu_blocks = kv.num_cpu_blocks
        pin = device.type == "cuda"
        self.cpu_caches = [
            (torch.zeros((self.num_cpu_blocks, *shape[1:]), dtype=self.kv_dtype, pin_memory=pin),
             torch.zeros((self.num_cpu_blocks, *shape[1:]), dtype=self.kv_dtype, pin_memory=pin))
            for _ in range(num_layers if self.num_cpu_blocks else 0)
        ]
        # Swaps run on their own stream on CUDA; the forward waits on an event, so blocks
        # swapped out are not overwritten before their copy has landed.
        self.swap_stream = torch.cuda.Stream(device) if pin else None
        self.backend = select_backend(
            config.attention_backend, device, self.model.config, self.block_size, self.dtype, self.kv_dtype
        )
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.native = select_native(config.model_impl, self.model, device)
        self.sampler = Sampler()
        self.generator = torch.Generator().manual_seed(config.seed)

    @torch.inference_mode()
    def execute(
        self, plan: SchedulerOutput, rows: list[SamplingRow], row_sources: list[int],
        beam_sources: list[int] = (),
    ) -> tuple[SamplerOutput, torch.Tensor | None]:
        """Runs one step. The scheduled sequences that sample give one logits row each, in
        plan order; sampling row j draws from logits row `row_sources[j]`; beam-search rows
        get their full log-softmax back instead of a sampled token."""
        if plan.blocks_to_swap_out or plan.blocks_to_swap_in:
            self._swap(plan.blocks_to_swap_out, plan.blocks_to_swap_in)
        if plan.blocks_to_copy:
            self._copy_blocks(plan.blocks_to_copy)
        input_ids, positions, meta, logits_indices = self._prepare(plan)
        hidden = self._forward(input_ids, positions, meta)  # [T, hidden]
        if len(logits_indices) == 0:
            return SamplerOutput([], []), None
        logits = self._logits(hidden[logits_indices]).float()  # [num_samplers, vocab]
        beam = None
        if beam_sources:
            beam = torch.log_softmax(logits[list(beam_sources)], dim=-1).cpu()  # [beams, vocab]
        if not rows:
            return SamplerOutput([], []), beam
        if row_sources != list(range(len(logits_indices))):
            logits = logits[torch.tensor(row_sources, device=logits.device)]  # [num_rows, vocab]
        return self.sampler(logits, rows, self.generator), beam

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.native is not None:
            return self.native.forward(input_ids, positions, meta)
        return self.decoder(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=False, attn_metadata=meta
        ).last_hidden_state[0]  # transformers runs the packed batch as one sequence: [1, T, hidden]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.native.logits(hidden) if self.native is not None else self.lm_head(hidden)

    def _prepare(self, plan: SchedulerOutput):
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        tables: list[list[int]] = []
        for item in plan.scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            table = seq.block_table
            tokens.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            if item.samples:
                logits_indices.append(len(tokens) - 1)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max(query_lens),
            kv_caches=self.kv_caches,
            backend=self.backend,
        )
        self.backend.prepare(meta)
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=dev)  # [T]
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)  # [T]
        return input_ids, pos, meta, torch.tensor(logits_indices, dtype=torch.int64, device=dev)

    def _swap(self, out_pairs: list[tuple[int, int]], in_pairs: list[tuple[int, int]]) -> None:
        """Swap-outs then swap-ins, layer by layer. On CUDA they run on the swap stream after
        the work already queued, and the next forward waits on an event: device blocks freed
        by a swap-out are not overwritten before their copy has landed. The host pool is
        pinned and only ever read by later copies on the same stream."""
        from streamengine.kernels import swap_blocks

        out_map = torch.tensor(out_pairs, dtype=torch.int64).view(-1, 2)  # (device, host)
        in_map = torch.tensor(in_pairs, dtype=torch.int64).view(-1, 2)  # (host, device)
        if self.swap_stream is not None:
            self.swap_stream.wait_stream(torch.cuda.current_stream(self.device))
        for (key_cache, value_cache), (cpu_k, cpu_v) in zip(self.kv_caches, self.cpu_caches, strict=True):
            for src, dst, mapping in ((key_cache, cpu_k, out_map), (value_cache, cpu_v, out_map),
                                      (cpu_k, key_cache, in_map), (cpu_v, value_cache, in_map)):
                swap_blocks(src, dst, mapping, stream=self.swap_stream)
        if self.swap_stream is not None:
            done = torch.cuda.Event()
            done.record(self.swap_stream)
            torch.cuda.current_stream(self.device).wait_event(done)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies: the Triton kernel on CUDA, its PyTorch reference on CPU."""
        from streamengine.kernels import copy_blocks, ref_copy_blocks

        mapping = torch.tensor(pairs, dtype=torch.int64)  # [num_pairs, 2] (src, dst)
        copy = copy_blocks if self.device.type == "cuda" else ref_copy_blocks
        copy([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)
