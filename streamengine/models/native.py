"""A compact forward for Llama-family decoders (Llama, Qwen2) over the paged cache.

Why not only transformers' modules: on a 2-core CPU a decode step of SmolLM2-135M is bound by
reading the weights, and transformers' layers add per-module Python and seven separate matmuls
per layer to it. Here the same weights run as four GEMMs per layer (q/k/v and gate/up fused),
packed once for the CPU GEMM (kernels/cpu_linear.py), with the packed batch kept 2-D
([num_tokens, hidden]) end to end; with the C++ libraries each layer is two calls
(kernels/cpu_layer.py), without them the same steps run as PyTorch ops (kernels/cpu_ops.py).
`bench/roofline.py --compare-transformers` measures both paths side by side. Given a GGUF
file's blocks (models/gguf_weights.py), the projections and the LM head use them as stored
(kernels/cpu_quant_linear.py) instead of float32 panels. The math is transformers' own: RMSNorm
in float32, RoPE from the model's rotary module, the SiLU-gated MLP, and the same attention
backends.

Anything else (other architectures, sliding windows, other activations) keeps the transformers
path; `unsupported_reason` says why a model does not qualify.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from streamengine.kernels import cpu_layer, cpu_quant_linear
from streamengine.kernels.cpu_linear import PanelLinear, TorchLinear, make_linear
from streamengine.kernels.cpu_ops import add_rms_norm, rope_, silu_mul
from streamengine.kernels.cpu_quant_linear import QuantLinear
from streamengine.kv.spec import AttentionShape
from streamengine.models.attention import AttentionBackend, AttentionPlan, store_and_attend
from streamengine.models.gguf_weights import BlockTensor, GgufWeights
from streamengine.models.lora import LoRAStep

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

Linear = PanelLinear | TorchLinear


def unsupported_reason(model) -> str | None:
    """None when `NativeDecoder` reproduces this model, else a short reason."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "layers other than full attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None


@dataclass(slots=True)
class NativeLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o: Linear  # heads * head_dim -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


class NativeDecoder:
    """forward(input_ids [T], positions [T], plan) -> hidden [T, hidden]; logits(hidden rows).

    Built for one attention backend: with one that declares `fused_cpu_layers` (and the C++
    libraries here) each layer is two calls and a decode-only step one call for the whole
    stack; with any other, each layer runs op by op around the backend's store and attend.
    With `packed` (the model's own GGUF file, checked against it) every weight in a block
    format the kernels support runs as stored; the rest run as float32 panels.
    """

    def __init__(self, model, backend: AttentionBackend, packed: GgufWeights | None = None,
                 unpacked: str = "float32", int8_activations: bool = False) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"native decoder cannot run this model: {reason}")
        config = model.config
        decoder = model.get_decoder()
        shape = AttentionShape.of(config)
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.intermediate_size = config.intermediate_size
        self.embed = decoder.embed_tokens.weight  # [vocab, hidden]
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm.weight
        blocks = packed.layers if packed else [None] * len(decoder.layers)
        self.layers = [self._layer(layer, b, unpacked, int8_activations)
                       for layer, b in zip(decoder.layers, blocks, strict=True)]
        head = model.get_output_embeddings()
        self.lm_head = _projection([head.weight], [packed.output] if packed else None, head.bias, unpacked,
                                   int8_activations)
        linears = [self.lm_head, *(lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))]
        self.num_packed = sum(isinstance(lin, QuantLinear) for lin in linears)  # of len(linears) weight matrices
        self.num_int8_activations = sum(getattr(lin, "int8_activations", False) for lin in linears)
        self.num_linears = len(linears)
        self.fused = self._fused_layers() if backend.fused_cpu_layers else None
        self.stack = None if self.fused is None else cpu_layer.DecodeStack(
            self.fused, [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        )

    @staticmethod
    def _layer(layer, blocks: dict[str, BlockTensor] | None, unpacked: str, int8_activations: bool) -> NativeLayer:
        attn, mlp = layer.self_attn, layer.mlp

        def of(*names: str) -> list[BlockTensor] | None:
            return None if blocks is None else [blocks[n] for n in names]

        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv_bias = None
        if any(p.bias is not None for p in projections):
            qkv_bias = torch.cat([
                p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections
            ])
        return NativeLayer(
            input_norm=layer.input_layernorm.weight,
            qkv=_projection([p.weight for p in projections], of("q_proj", "k_proj", "v_proj"), qkv_bias, unpacked,
                            int8_activations),
            o=_projection([attn.o_proj.weight], of("o_proj"), attn.o_proj.bias, unpacked, int8_activations),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=_projection([mlp.gate_proj.weight, mlp.up_proj.weight], of("gate_proj", "up_proj"), None,
                                unpacked, int8_activations),
            down=_projection([mlp.down_proj.weight], of("down_proj"), None, unpacked, int8_activations),
        )

    def _fused_layers(self) -> list[cpu_layer.FusedLayer] | None:
        """Two-call layers (kernels/cpu_layer.py) when every weight is packed and the library
        runs here; None keeps the op-by-op path."""
        packed = all(
            isinstance(lin, PanelLinear)
            for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        if not packed or not cpu_layer.available():
            return None
        return [
            cpu_layer.FusedLayer(layer.qkv, layer.o, layer.gate_up, layer.down, layer.post_norm,
                                 self.num_heads, self.num_kv_heads, self.head_dim, self.eps)
            for layer in self.layers
        ]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """With `lora` (rows of adapters in the step) each projection adds its rows' adapter
        deltas: inside the fused C++ layers where they run, else after each op."""
        h = F.embedding(input_ids, self.embed)  # [T, hidden], the residual stream
        cos, sin = self._rope_tables(h, positions)
        x = add_rms_norm(h, None, self.layers[0].input_norm, self.eps)
        # An fp8 cache's scales: the fused layers take them once set (the first step sets them, op by op).
        scales = plan.meta.kv_scales
        fused = self.fused is not None and (scales is None or scales.ready)
        native_lora = lora.native_view() if lora is not None and fused else None
        if fused and self.stack is not None and plan.decode_kernel is not None:  # every layer in one call
            self.stack.run(h, x, cos, sin, plan.meta.slot_mapping, plan.meta.kv_caches, plan.decode_kernel, self.scale,
                           native_lora, None if scales is None else scales.table)
            return x
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            if fused:
                x = self._fused_forward(i, self.fused[i], h, x, cos, sin, plan, next_norm, native_lora)
            else:
                x = self._layer_forward(i, layer, h, x, cos, sin, plan, next_norm, lora)
        return x

    def _fused_forward(self, i: int, layer: cpu_layer.FusedLayer, h, x, cos, sin, plan: AttentionPlan,
                       next_norm, lora: cpu_layer.LoRAView | None) -> torch.Tensor:
        t = h.shape[0]
        key_cache, value_cache = plan.meta.kv_caches[i]
        scales = None if plan.meta.kv_scales is None else plan.meta.kv_scales.table[i]
        qkv = layer.layer_in(x, cos, sin, plan.meta.slot_mapping, key_cache, value_cache, lora, i, scales)  # K/V stored
        attn = plan.attend(i, *self._split_qkv(qkv), self.scale)  # [T, heads, D]
        return layer.layer_out(attn.view(t, self.num_heads * self.head_dim), h, next_norm, lora, i)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of q [T, heads, D], k and v [T, kv_heads, D] in a [T, >= (heads + 2 kv) * D] row."""
        t, nh, nkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, : nh * d].view(t, nh, d)
        k = qkv[:, nh * d:(nh + nkv) * d].view(t, nkv, d)
        v = qkv[:, (nh + nkv) * d:(nh + 2 * nkv) * d].view(t, nkv, d)
        return q, k, v

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [rows, vocab]

    def _rope_tables(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the model's own rotary module (any rope type), first half only: the two
        halves of transformers' tables are equal by construction."""
        cos, sin = self.rotary(h[None], positions[None])  # [1, T, head_dim]
        half = self.head_dim // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()  # [T, head_dim / 2]

    def _layer_forward(self, i: int, layer: NativeLayer, h, x, cos, sin, plan: AttentionPlan,
                       next_norm, lora: LoRAStep | None = None) -> torch.Tensor:
        """One decoder layer on the normed input x; adds both branches into the residual h in
        place and returns h normed for the next layer (the fused add + RMSNorm). With `lora`,
        each projection's output gets its rows' adapter deltas."""
        t = h.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(x)  # [T, (heads + 2 kv_heads) * D]
        if lora is not None:
            lora.apply_split(i, ("q_proj", "k_proj", "v_proj"), x, qkv, (nh * d, nkv * d, nkv * d))
        rope_(qkv, nh + nkv, d, cos, sin)  # q and k heads are adjacent: one pass
        attn = store_and_attend(plan, i, *self._split_qkv(qkv), self.scale).reshape(t, nh * d)  # [T, heads * D]
        o = layer.o(attn)
        if lora is not None:
            lora.apply_split(i, ("o_proj",), attn, o, (o.shape[1],))
        x = add_rms_norm(h, o, layer.post_norm, self.eps)
        gate_up = layer.gate_up(x)
        if lora is not None:
            lora.apply_split(i, ("gate_proj", "up_proj"), x, gate_up, (self.intermediate_size,) * 2)
        act = silu_mul(gate_up)
        down = layer.down(act)
        if lora is not None:
            lora.apply_split(i, ("down_proj",), act, down, (down.shape[1],))
        return add_rms_norm(h, down, next_norm, self.eps)


def _projection(weights: list[torch.Tensor], blocks: list[BlockTensor] | None,
                bias: torch.Tensor | None = None, unpacked: str = "float32", int8_activations: bool = False) -> Linear:
    """One linear over the row-wise concatenation of `weights`: from their GGUF blocks when
    given, all of one type and that type runs packed here; else from the float weights, kept
    as `unpacked` says (where the kernels run and in_features is whole 32-weight blocks):
    "int8" quantized to Q8_0, "bfloat16" as bfloat16 when every value is one (exact), else as
    float32 panels. With `int8_activations` Q4 blocks multiply int8-quantized inputs."""
    lib = cpu_quant_linear.load_library()
    if blocks is not None and len({b.quant_type for b in blocks}) == 1 and cpu_quant_linear.supported(blocks[0].quant_type):
        quant_type = blocks[0].quant_type
        shape = (sum(b.shape[0] for b in blocks), blocks[0].shape[1])
        int8 = int8_activations and cpu_quant_linear.takes_int8_activations(quant_type)
        return QuantLinear(np.concatenate([b.blocks for b in blocks]), quant_type, shape, bias, lib, int8)
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]  # not built when the blocks serve
    if blocks is not None:
        return make_linear(weight, bias)
    if unpacked != "float32" and lib is not None and weight.shape[1] % cpu_quant_linear.QK == 0:
        if unpacked == "int8":
            return QuantLinear(cpu_quant_linear.quantize_q8_0(weight), cpu_quant_linear.Q8_0_TYPE,
                               tuple(weight.shape), bias, lib)
        rows = cpu_quant_linear.bfloat16_rows(weight)
        if rows is not None:
            return QuantLinear(rows, cpu_quant_linear.BF16_TYPE, tuple(weight.shape), bias, lib)
    return make_linear(weight, bias)
