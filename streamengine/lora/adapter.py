"""A PEFT LoRA adapter read from its folder and checked against the base model at load.

A folder holds `adapter_config.json` and `adapter_model.safetensors` (what
`PeftModel.save_pretrained` writes). Each adapted projection W of a decoder layer gets
`y = W x + scaling * B (A x)`, with A [r, in], B [out, r] and scaling `lora_alpha / r`
(`lora_alpha / sqrt(r)` under rsLoRA). Everything that could fail at step time is checked
here instead: the projections must be ones the engine adapts, every shape must match the
base model's, the rank must be within the engine's limit, and PEFT options the engine does not
apply (DoRA, biases, extra trained modules, fan-in-fan-out weights) are refused by name.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the file, field or tensor."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, projection) -> (A [rank, in], B [out, rank]), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # of the files' bytes: what blocks computed under this adapter are hashed with
    # What the prefix cache keys this adapter's blocks by (its name and content), and a number
    # for KV events (vLLM's `lora_id`) from the content, the same on every replica. Made once:
    # a step reads them for each of its rows and blocks.
    identity: str = field(init=False)
    lora_id: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "identity", identity(self.name, self.digest))
        object.__setattr__(self, "lora_id", int(self.digest[:15], 16))

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.weights)


def projection_shapes(model_config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable projection of a Llama-family layer."""
    hidden = model_config.hidden_size
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    kv = (getattr(model_config, "num_key_value_heads", None) or heads) * head_dim
    inter = model_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def load_adapter(name: str, path: str | Path, model_config, max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter in folder `path`; LoRAError (a ValueError) says what is wrong."""
    folder = Path(path)
    config = _read_config(folder)
    rank, scaling = _rank_and_scaling(config, folder, max_rank)
    tensors = _read_tensors(folder)
    weights = _pair_tensors(tensors, folder)
    _check_shapes(weights, rank, model_config, folder)
    return LoRAAdapter(name, str(folder), rank, scaling, weights, files_digest(folder))


def files_digest(folder: str | Path) -> str:
    """The adapter's content identity: a hash of its two files' bytes (the Ray ingress hashes
    prompts with it too, without loading the adapter)."""
    folder = Path(folder)
    digest = hashlib.sha256((folder / CONFIG_FILE).read_bytes() + (folder / WEIGHTS_FILE).read_bytes())
    return digest.hexdigest()[:16]


def identity(name: str, digest: str) -> str:
    return f"lora:{name}:{digest}"


def with_adapter(segments: tuple[tuple[int, str | None], ...], adapter_identity: str) -> tuple[tuple[int, str | None], ...]:
    """Salt segments that also name an adapter: blocks computed under it are hit by requests
    of that adapter only (its K/V differs from the base model's)."""
    return tuple((start, adapter_identity if salt is None else f"{salt}|{adapter_identity}") for start, salt in segments)


def _read_config(folder: Path) -> dict:
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / file).is_file():
            raise LoRAError(f"LoRA adapter {folder}: missing {file}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"LoRA adapter {folder}: {CONFIG_FILE} is not readable JSON ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {folder}: peft_type {config.get('peft_type')!r} is not LORA")
    refused = {"use_dora": True, "fan_in_fan_out": True}
    for key, bad in refused.items():
        if config.get(key) == bad:
            raise LoRAError(f"LoRA adapter {folder}: {key}={bad} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {folder}: bias={config['bias']!r} is not supported (only 'none')")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAError(f"LoRA adapter {folder}: {key} is not supported ({config[key]!r})")
    return config


def _rank_and_scaling(config: dict, folder: Path, max_rank: int) -> tuple[int, float]:
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"LoRA adapter {folder}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {folder}: rank {rank} is over the engine's max_lora_rank ({max_rank})")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise LoRAError(f"LoRA adapter {folder}: {WEIGHTS_FILE} is not readable ({exc})") from None


def _pair_tensors(tensors: dict[str, torch.Tensor], folder: Path) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, projection): (A, B)} from PEFT's tensor names; any other tensor is refused."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or match.group(2) not in TARGET_MODULES:
            raise LoRAError(f"LoRA adapter {folder}: tensor {key!r} is not a LoRA A/B weight of one of {TARGET_MODULES}")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        halves.setdefault((layer, module), {})[half] = tensor.to(torch.float32).contiguous()
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {folder}: layer {layer} {module} has lora_{''.join(pair)} without its pair")
        weights[(layer, module)] = (pair["A"], pair["B"])
    if not weights:
        raise LoRAError(f"LoRA adapter {folder}: no LoRA weights in {WEIGHTS_FILE}")
    return weights


def _check_shapes(weights: dict, rank: int, model_config, folder: Path) -> None:
    shapes = projection_shapes(model_config)
    num_layers = model_config.num_hidden_layers
    for (layer, module), (a, b) in weights.items():
        if layer >= num_layers:
            raise LoRAError(f"LoRA adapter {folder}: layer {layer} is past the base model's {num_layers} layers "
                            "(an adapter of another base model?)")
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAError(f"LoRA adapter {folder}: layer {layer} {module} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}, the base model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank}) "
                            "(an adapter of another base model?)")
