"""A GGUF file's linear weights as the file stores them (block-quantized rows), for the native
decoder's packed path (kernels/cpu_quant_linear.py).

transformers loads the same file dequantized; this module reads the blocks themselves and
lines them up with transformers' modules: the tensor names mapped to the layer's projections,
and Llama's q/k rows put back in transformers' order (GGUF files store them permuted for
llama.cpp's rotary layout; the permutation moves whole rows, so blocks move with them).
`check_against` proves the mapping on the loaded model before anything runs.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from streamengine.kernels.cpu_quant_linear import FORMATS, dequantize

# HF projection -> GGUF tensor name inside blk.N
LAYER_TENSORS = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
}
PERMUTED_ARCHITECTURES = ("llama",)  # architectures whose q/k rows GGUF stores permuted
CHECK_ROWS = 8  # rows per tensor compared with the loaded model, besides the first and last


@dataclass(frozen=True, slots=True)
class BlockTensor:
    """A 2-D weight as GGUF blocks: `blocks[n]` holds output row n's bytes."""

    quant_type: int  # GGUF (ggml) type id
    blocks: np.ndarray  # [out_features, bytes per row] uint8
    shape: tuple[int, int]  # (out_features, in_features)

    def rows(self, index: np.ndarray) -> BlockTensor:
        return BlockTensor(self.quant_type, self.blocks[index], (len(index), self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.blocks, self.quant_type, self.shape)


@dataclass(slots=True)
class GgufWeights:
    architecture: str
    layers: list[dict[str, BlockTensor]]  # per layer, keyed by HF projection name
    embedding: BlockTensor  # token_embd: [vocab, hidden]
    output: BlockTensor  # the LM head (token_embd again when the file ties them)

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each GGUF type this holds (for logs and stats)."""
        from gguf import GGMLQuantizationType

        tensors = [t for layer in self.layers for t in layer.values()] + [self.embedding]
        if self.output is not self.embedding:
            tensors.append(self.output)
        return dict(Counter(GGMLQuantizationType(t.quant_type).name for t in tensors))


def read_gguf(path: Path, num_heads: int, num_kv_heads: int) -> GgufWeights:
    """The file's embedding, LM head and per-layer projections as block tensors (read once per
    process and file version: the tensors are memory-mapped, so engines share them)."""
    st = path.stat()
    return _read_gguf(path.resolve(), st.st_size, st.st_mtime_ns, num_heads, num_kv_heads)


@functools.lru_cache(maxsize=4)
def _read_gguf(path: Path, size: int, mtime_ns: int, num_heads: int, num_kv_heads: int) -> GgufWeights:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))  # most of its time goes to the tokenizer's fields
    tensors = {t.name: t for t in reader.tensors}
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    count = 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("blk."))
    missing = [f"blk.{i}.{gg}.weight" for i in range(count) for gg in LAYER_TENSORS.values()
               if f"blk.{i}.{gg}.weight" not in tensors] + [n for n in ("token_embd.weight",) if n not in tensors]
    if missing:
        raise ValueError(f"{path.name} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    layers = [{hf: _tensor(tensors[f"blk.{i}.{gg}.weight"]) for hf, gg in LAYER_TENSORS.items()} for i in range(count)]
    if arch in PERMUTED_ARCHITECTURES:
        for layer in layers:
            layer["q_proj"] = layer["q_proj"].rows(_unpermute(layer["q_proj"].shape[0], num_heads))
            layer["k_proj"] = layer["k_proj"].rows(_unpermute(layer["k_proj"].shape[0], num_kv_heads))
    embedding = _tensor(tensors["token_embd.weight"])
    output = _tensor(tensors["output.weight"]) if "output.weight" in tensors else embedding
    return GgufWeights(arch, layers, embedding, output)


def _tensor(t) -> BlockTensor:
    """A reader tensor as a block tensor (GGUF lists shapes innermost first)."""
    in_features, out_features = (int(d) for d in t.shape[:2])
    blocks = np.asarray(t.data).reshape(out_features, -1)
    if blocks.dtype != np.uint8:  # float tensors: their bytes, so every tensor is alike
        blocks = blocks.view(np.uint8)
    return BlockTensor(int(t.tensor_type), blocks, (out_features, in_features))


def _unpermute(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes the GGUF q/k permutation: within each head, the file interleaves
    the two rotary halves ([h, half, 2] order) where transformers keeps them apart ([h, 2, half])."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def check_against(weights: GgufWeights, model) -> None:
    """A few rows of every tensor dequantized and compared with the loaded model's weights:
    a file that is not the model's (or a wrong mapping) fails here, with the tensor named."""
    decoder = model.get_decoder()
    if len(weights.layers) != len(decoder.layers):
        raise ValueError(f"GGUF has {len(weights.layers)} layers, the model {len(decoder.layers)}")
    pairs = [("embed_tokens", weights.embedding, decoder.embed_tokens.weight),
             ("lm_head", weights.output, model.get_output_embeddings().weight)]
    for i, (layer, module) in enumerate(zip(weights.layers, decoder.layers, strict=True)):
        for name, tensor in layer.items():
            owner = module.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else module.mlp
            pairs.append((f"layers.{i}.{name}", tensor, getattr(owner, name).weight))
    for name, tensor, expected in pairs:
        if tensor.shape != tuple(expected.shape):
            raise ValueError(f"GGUF tensor for {name} has shape {tensor.shape}, the model {tuple(expected.shape)}")
        if tensor.quant_type not in FORMATS:
            continue
        # Rows 1.. sit inside the first head, where the q/k permutation moves every row but its first.
        index = np.unique(np.r_[0, np.arange(1, min(CHECK_ROWS + 1, tensor.shape[0])), tensor.shape[0] - 1])
        got = tensor.rows(index).dequantize()
        if not torch.equal(got, expected.detach()[torch.from_numpy(index)].float()):
            raise ValueError(f"GGUF tensor for {name} does not match the loaded model's weights")

