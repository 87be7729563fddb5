"""Turns a scheduler plan into tensors, runs one packed forward over the paged cache, samples.

All scheduled tokens of all sequences form one flat batch (`input_ids` [T]); only the last
token of each sequence that samples goes through the output projection, plus the positions
whose logits give a prompt's logprobs where a request asks for them. The attention backend
and the model implementation are chosen once, when the runner is built.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from streamengine.config import EngineConfig
from streamengine.kernels import cpu_build, cpu_quant_linear
from streamengine.kv.spec import AttentionShape, KVCacheSpec
from streamengine.lora.adapter import TARGET_MODULES
from streamengine.models.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionPlan,
    KVCaches,
)
from streamengine.models.cpu_backend import CpuPagedAttention
from streamengine.models.decode_graphs import DecodeGraphRunner, pad_blocks
from streamengine.models.gguf_weights import GgufWeights, check_against, read_gguf
from streamengine.models.kv_scales import KVScales
from streamengine.models.loader import LoadedModel
from streamengine.models.lora import LoRAStacks, LoRAStep, lora_dtype
from streamengine.models.native import NativeDecoder, unsupported_reason
from streamengine.models.packed_batch import PackedBatch, PromptRows, attention_metadata, pack_batch
from streamengine.models.torch_backend import TorchPagedAttention
from streamengine.models.triton_backend import TritonPagedAttention
from streamengine.sample.sampler import Sampler, SamplerOutput, SamplingRow
from streamengine.sched.plan import SchedulerOutput
from streamengine.structured.grammar import GrammarMatcher
from streamengine.structured.mask import TokenMasker

if TYPE_CHECKING:
    from streamengine.models.draft import DraftModel

log = logging.getLogger(__name__)

PROMPT_LOGPROBS_ROWS_PER_PASS = 256
"""Prompt positions whose logits one pass holds at once ([rows, vocab] float32 and its
log-softmax): bounds their memory whatever the chunk size."""
PromptLogprobs = list[dict[int, float]]  # per prompt position: {token id: logprob}


def select_backend(
    name: str, device: torch.device, model_config, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype,
) -> AttentionBackend:
    """The backend `EngineConfig.attention_backend` names; "auto" takes the C++ kernel where it
    runs, else PyTorch on CPU and Triton on CUDA."""
    if name in ("cpu", "auto") and device.type == "cpu":
        if CpuPagedAttention.available(AttentionShape.of(model_config), block_size, dtype, kv_dtype):
            return CpuPagedAttention()
        if name == "cpu":
            raise ValueError(
                "attention_backend='cpu' needs a float32 model, a float32, float16 or fp8 KV cache, AVX-512 or AVX2, "
                "a C++ compiler and a supported head shape"
            )
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchPagedAttention()
    return TritonPagedAttention.create(device, dtype, kv_dtype)


def select_native(config: EngineConfig, loaded: LoadedModel, device: torch.device,
                  backend: AttentionBackend) -> NativeDecoder | None:
    """The native decoder for "native", and for "auto" on CPU when the model qualifies;
    None means transformers' own modules run (with the paged attention hook). Its weights are
    kept as `config.weight_format` says, where the C++ kernels can hold them."""
    model_impl, model = config.model_impl, loaded.model
    reason = "model_impl='transformers'" if model_impl == "transformers" else unsupported_reason(model)
    if model_impl == "native" and reason is not None:
        raise ValueError(f"EngineConfig.model_impl='native' cannot run this model: {reason}")
    if reason is None and not (model_impl == "native" or device.type == "cpu"):
        reason = f"model_impl='auto' on {device.type}"
    kernels = kernels_unavailable(config, device, reason)
    if config.weight_format == "int8" and kernels is not None:
        raise ValueError(f"EngineConfig.weight_format='int8' cannot run: {kernels}")
    packed = select_packed(config, loaded, kernels)
    if config.int8_activations and packed is None:
        why = (kernels or (f"weight_format={config.weight_format!r}" if config.weight_format in ("dequantized", "int8")
                           else "the model is not a GGUF file"))
        raise ValueError(f"EngineConfig.int8_activations needs a GGUF model's Q4 weights running packed, not here: {why}")
    if reason is not None:
        return None
    # Float weights: "int8" quantizes them; "auto" keeps those that are all bfloat16 values
    # (a bfloat16 checkpoint) as bfloat16, which is exact.
    unpacked = {"int8": "int8", "auto": "bfloat16"}.get(config.weight_format, "float32") if kernels is None else "float32"
    native = NativeDecoder(model, backend, packed, unpacked, config.int8_activations)
    log.info("weights: %d of %d weight matrices packed (%s)", native.num_packed, native.num_linears,
             "GGUF blocks" if packed is not None else f"float weights kept as {unpacked}")
    if config.int8_activations:
        if native.num_int8_activations == 0:
            raise ValueError("EngineConfig.int8_activations needs Q4_0, Q4_1 or Q8_0 weights running packed; "
                             f"{loaded.gguf.name} has none ({packed.type_counts()})")
        log.info("weights: %d of %d weight matrices multiply int8-quantized inputs (int8_activations; not exact)",
                 native.num_int8_activations, native.num_linears)
    if packed is not None and native.num_packed == 0 and config.weight_format == "packed":
        raise ValueError(f"EngineConfig.weight_format='packed' cannot run: no tensor of {loaded.gguf.name} "
                         f"has a packed kernel ({packed.type_counts()})")
    return native


def select_packed(config: EngineConfig, loaded: LoadedModel, kernels_reason: str | None) -> GgufWeights | None:
    """The GGUF file's blocks when the weights run packed (weight_format "packed", or "auto"
    where it can), else None; "packed" where it cannot run is an error saying why. Logs the
    choice either way."""
    if config.weight_format == "int8":
        return None  # select_native logs what the quantization built
    if config.weight_format == "dequantized":
        log.info("weights: dequantized to float32 (weight_format='dequantized')")
        return None
    reason = "the model is not a GGUF file" if loaded.gguf is None else kernels_reason
    if reason is not None:
        if config.weight_format == "packed":
            raise ValueError(f"EngineConfig.weight_format='packed' cannot run: {reason}")
        log.info("weights: dequantized to float32 (%s)", reason)
        return None
    shape = AttentionShape.of(loaded.model.config)
    try:
        packed = read_gguf(loaded.gguf, shape.num_heads, shape.num_kv_heads)
        check_against(packed, loaded.model)
    except ValueError as exc:  # a file this module cannot line up with the model
        if config.weight_format == "packed":
            raise ValueError(f"EngineConfig.weight_format='packed' cannot run: {exc}") from exc
        log.warning("weights: dequantized to float32 (%s)", exc)
        return None
    counts = packed.type_counts()
    unpacked = {name: n for name, n in counts.items() if name not in cpu_quant_linear.FORMAT_NAMES}
    log.info("weights: packed as stored in %s %s, fused dequantizing GEMM (%s)%s", loaded.gguf.name, counts,
             cpu_build.selected_instruction_set(),
             f"; no packed kernel for {unpacked}: those run as float32" if unpacked else "")
    return packed


def kernels_unavailable(config: EngineConfig, device: torch.device, native_reason: str | None) -> str | None:
    """Why the C++ kernels cannot hold the weights here (packed, bfloat16 or int8), or None."""
    if device.type != "cpu" or config.dtype != "float32":
        return f"packed weights run on CPU in float32, not {device.type} {config.dtype}"
    if native_reason is not None:
        return f"the native decoder does not run ({native_reason})"
    if cpu_quant_linear.load_library() is None:
        return "the C++ kernels do not run here (they need x86-64 with AVX-512 or AVX2 + FMA + F16C, and a C++ compiler; see the log)"
    return None


def allocate_kv_caches(kv: KVCacheSpec, num_blocks: int, device: torch.device | str, pin_memory: bool = False) -> KVCaches:
    """Per layer, a zeroed K and V tensor of [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, *kv.block_shape)
    return [
        (torch.zeros(shape, dtype=kv.dtype, device=device, pin_memory=pin_memory),
         torch.zeros(shape, dtype=kv.dtype, device=device, pin_memory=pin_memory))
        for _ in range(kv.shape.num_layers)
    ]


def _logprob_entries(logits: torch.Tensor, targets: list[int], top_k: list[int]) -> PromptLogprobs:
    """Per row of `logits` [R, vocab]: its top `top_k[r]` tokens' logprobs, then its target's
    (the order of a sampled token's logprobs: sampler._gather_logprobs)."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, vocab]
    target_ids = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    target_lp = logprobs.gather(1, target_ids.unsqueeze(1)).squeeze(1).tolist()  # [R]
    k_max = max(top_k)
    top_lp: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if k_max > 0:
        values, ids = logprobs.topk(k_max, dim=-1)  # [R, k_max]
        top_lp, top_ids = values.tolist(), ids.tolist()
    entries = []
    for r, (token, k) in enumerate(zip(targets, top_k, strict=True)):
        entry = dict(zip(top_ids[r][:k], top_lp[r][:k], strict=True))
        entry.setdefault(token, target_lp[r])
        entries.append(entry)
    return entries


class PagedModel:
    """A model over its own paged KV tensors: packed forward passes and their logits. The
    target model's runner is one; a draft model (speculative decoding) is another, its tensors
    indexed by the same block ids."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, kv: KVCacheSpec,
                 extra_blocks: int = 0) -> None:
        self.model = loaded.model
        self.device = device
        self.kv_dtype = kv.dtype
        self.block_size = kv.block_size
        pin = device.type == "cuda"
        self.kv_caches = allocate_kv_caches(kv, kv.num_blocks + extra_blocks, device)  # extra: never handed out
        self.kv_scales = KVScales.of(config, kv.shape.num_layers, kv.dtype)  # None unless the cache is fp8
        self.cpu_caches = allocate_kv_caches(kv, kv.num_cpu_blocks, "cpu", pin) if kv.num_cpu_blocks else []
        self.backend = select_backend(
            config.attention_backend, device, self.model.config, kv.block_size, getattr(torch, config.dtype), kv.dtype
        )
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.native = select_native(config, loaded, device, self.backend)
        self.lora_step: LoRAStep | None = None

    def _forward(self, batch: PackedBatch, lora: LoRAStep | None = None) -> torch.Tensor:
        meta = attention_metadata(batch, self.kv_caches, self.device, self.kv_scales)
        input_ids = torch.tensor(batch.token_ids, dtype=torch.int64, device=self.device)  # [T]
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=self.device)  # [T]
        return self.forward_tensors(input_ids, positions, meta, lora)

    def forward_tensors(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        lora: LoRAStep | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of one step given as tensors: what a decode graph captures."""
        attn_plan = self.backend.plan(meta)
        if self.native is not None:
            return self.native.forward(input_ids, positions, attn_plan, lora)
        self.lora_step = lora  # read by the projections' hooks (ModelRunner._hook_lora)
        try:
            return self._transformers_forward(input_ids, positions, attn_plan)
        finally:
            self.lora_step = None

    def _transformers_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_plan: AttentionPlan) -> torch.Tensor:
        # transformers runs the packed batch as one sequence; every layer's attention call
        # gets `attn_plan` (models/attention.py).
        return self.decoder(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=False, attn_plan=attn_plan
        ).last_hidden_state[0]  # [1, T, hidden] -> [T, hidden]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.native.logits(hidden) if self.native is not None else self.lm_head(hidden)


class ModelRunner(PagedModel):
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, kv: KVCacheSpec,
                 draft: DraftModel | None = None) -> None:
        super().__init__(loaded, config, device, kv, extra_blocks=pad_blocks(config, device))
        # Swaps run on their own stream on CUDA; the forward waits on an event, so blocks
        # swapped out are not overwritten before their copy has landed.
        self.swap_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        packed = self.native is not None and self.native.num_packed > 0  # what was built, not what was asked
        self.weight_format = ("int8" if config.weight_format == "int8" else "packed") if packed else "dequantized"
        self.masker = TokenMasker()  # grammar masks, of sampled rows and of beams alike
        self.sampler = Sampler(self.masker)
        self.generator = torch.Generator(device).manual_seed(config.seed)  # on the logits' device
        self.draft = draft  # speculative decoding's draft model, its KV in the same blocks
        self.loras = LoRAStacks(self.model.config, config.max_loras, config.max_lora_rank, device,
                                lora_dtype(config.lora_dtype, packed))
        self._lora_hooked = False  # transformers' projections get their hooks with the first adapter rows
        self.decode_graphs = DecodeGraphRunner.build(config, device, self.backend, self.forward_tensors,
                                                     self.kv_caches, kv, self.model.config, self.kv_scales)

    def _hook_lora(self) -> None:
        """On transformers' modules, each adaptable projection adds its rows' LoRA deltas to
        its output (when the step has adapters: `lora_step`)."""
        for i, layer in enumerate(self.decoder.layers):
            for module in TARGET_MODULES:
                parent = layer.mlp if module in ("gate_proj", "up_proj", "down_proj") else layer.self_attn
                linear = getattr(parent, module, None)
                if linear is not None:
                    linear.register_forward_hook(self._lora_hook(i, module))

    def _lora_hook(self, layer: int, module: str):
        def add_delta(_module, inputs, output):
            if self.lora_step is not None:  # transformers runs the packed batch as [1, T, features]
                x = inputs[0].reshape(-1, inputs[0].shape[-1])
                self.lora_step.stacks.apply(layer, module, x, output.view(-1, output.shape[-1]), self.lora_step.slots)
        return add_delta

    @torch.inference_mode()
    def execute(
        self, plan: SchedulerOutput, rows: list[SamplingRow], row_sources: list[int],
        beam_sources: list[int] = (), beam_matchers: list[GrammarMatcher | None] = (),
    ) -> tuple[SamplerOutput, torch.Tensor | None, list[PromptLogprobs]]:
        """Runs one step. The scheduled sequences that sample give one logits row each, in
        plan order; sampling row j draws from logits row `row_sources[j]`; beam-search rows
        get their full log-softmax back instead of a sampled token, masked first by their
        beam's grammar matcher where `beam_matchers` has one. Last, the prompt logprobs of
        each scheduled sequence with `num_prompt_logprobs`, in plan order."""
        self._move_blocks(plan)
        if self.draft is not None:
            self.draft.propose(plan)
        batch = pack_batch(plan, self.block_size)
        graphs = self.decode_graphs  # decode steps replay a CUDA graph of their batch size
        hidden = graphs.run(batch) if graphs and graphs.takes(batch) else self._forward(batch, self._lora_step(batch))
        if self.draft is not None:
            self.draft.follow(batch)
        prompt = self._prompt_logprobs(hidden, batch.prompt_rows) if batch.prompt_rows else []
        sampled, beam = self._sample(hidden, batch, rows, row_sources, beam_sources, beam_matchers)
        return sampled, beam, prompt

    def _lora_step(self, batch: PackedBatch) -> LoRAStep | None:
        if batch.lora_rows is None:
            return None
        slots = self.loras.slot_rows(batch.lora_rows)
        if slots is None:
            return None
        if self.native is None and not self._lora_hooked:
            self._hook_lora()
            self._lora_hooked = True
        return LoRAStep(self.loras, slots)

    def _sample(
        self, hidden: torch.Tensor, batch: PackedBatch, rows: list[SamplingRow], row_sources: list[int],
        beam_sources: list[int], beam_matchers: list[GrammarMatcher | None],
    ) -> tuple[SamplerOutput, torch.Tensor | None]:
        if not batch.logits_indices:
            return SamplerOutput([], []), None
        logits_indices = torch.tensor(batch.logits_indices, dtype=torch.int64, device=self.device)
        logits = self._logits(hidden[logits_indices]).float()  # [num_samplers, vocab]
        beam = None
        if beam_sources:
            beam_logits = self.masker.apply(logits[list(beam_sources)], beam_matchers or [])  # [beams, vocab]
            beam = torch.log_softmax(beam_logits, dim=-1).cpu()
        if not rows:
            return SamplerOutput([], []), beam
        if row_sources != list(range(len(batch.logits_indices))):
            logits = logits[torch.tensor(row_sources, device=logits.device)]  # [num_rows, vocab]
        return self.sampler(logits, rows, self.generator), beam

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: PromptRows) -> list[PromptLogprobs]:
        """Each row's {prompt token: logprob} plus its top-k alternatives, split per sequence.
        The log-softmax is of the model's float32 logits, as for sampled tokens' logprobs (a
        prompt has no grammar mask, penalties or temperature to apply)."""
        entries: PromptLogprobs = []
        for lo in range(0, len(rows.indices), PROMPT_LOGPROBS_ROWS_PER_PASS):
            hi = lo + PROMPT_LOGPROBS_ROWS_PER_PASS
            index = torch.tensor(rows.indices[lo:hi], dtype=torch.int64, device=self.device)
            entries.extend(_logprob_entries(self._logits(hidden[index]).float(), rows.targets[lo:hi], rows.top_k[lo:hi]))
        out, start = [], 0
        for count in rows.counts:
            out.append(entries[start:start + count])
            start += count
        return out

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        """The plan's swaps and copy-on-write copies, before its forward reads the cache."""
        if plan.blocks_to_swap_out or plan.blocks_to_swap_in:
            self._swap(plan.blocks_to_swap_out, plan.blocks_to_swap_in)
        if plan.blocks_to_copy:
            self._copy_blocks(plan.blocks_to_copy)

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
        for (key_cache, value_cache), (cpu_k, cpu_v) in self._cache_pairs():
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
        for caches in (self.kv_caches, self.draft.kv_caches if self.draft is not None else []):
            if caches:  # one call per model: the draft's layers have their own shape
                copy([k for k, _ in caches], [v for _, v in caches], mapping)

    def _cache_pairs(self) -> list[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
        """Each layer's device K and V beside its host K and V, the draft's layers after the model's."""
        pairs = list(zip(self.kv_caches, self.cpu_caches, strict=True))
        if self.draft is not None:
            pairs += zip(self.draft.kv_caches, self.draft.cpu_caches, strict=True)
        return pairs
