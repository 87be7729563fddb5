"""LoRA adapters in the forward: the resident adapters stacked per projection, and each
step's rows mapped to them.

Rows of different adapters (and of none) share one step. Each adapted projection of each
layer keeps a stack of its resident adapters' A [S, R, in] and B [S, out, R] (R the engine's
max_lora_rank, a slot's rank past its own zero-padded and skipped), their ranks and scalings;
after the base projection, every row of slot s gets `scaling[s] * B[s] (A[s] x)` added
(kernels/cpu_lora.py on CPU, kernels/lora_triton.py on CUDA: rows grouped by slot, shrink
then expand). An adapter not targeting a projection has rank 0 there. Slots are reused least
recently used first, never one a row of the step needs: the scheduler runs at most
`max_loras` adapters at once, so a step's adapters always have slots.

On CPU, B is stored rank-major ([S, R, out], `Stack.b` a transposed view of it), the layout
the C++ kernel expands from, and the fused C++ layers find every stack through `table`: the
addresses of each layer's projections' tensors (kernels/csrc/cpu_lora.h), so a step with
adapters runs the same one-call decode as one without.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from streamengine.kernels import cpu_lora
from streamengine.lora.adapter import TARGET_MODULES, LoRAAdapter, projection_shapes

NO_SLOT = -1  # a row of the base model


@dataclass(slots=True)
class Stack:
    """One projection's resident adapters."""

    a: torch.Tensor  # [S, R, in]
    b: torch.Tensor  # [S, out, R]; on CPU a view of a contiguous [S, R, out]
    rank: torch.Tensor  # [S] int32; 0: the slot's adapter does not adapt this projection
    scale: torch.Tensor  # [S] float32


@dataclass(slots=True)
class LoRAStep:
    """One step's rows and the stacks they use."""

    stacks: LoRAStacks
    slots: torch.Tensor  # [T] int32, NO_SLOT for base rows

    def native_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(step fields, layer table) for the fused C++ layers (kernels/csrc/cpu_lora.h); the
        step's fields hold `slots`' address, so keep this LoRAStep alive while they are used."""
        stacks = self.stacks
        step = torch.tensor([self.slots.data_ptr(), stacks.max_loras, stacks.max_rank,
                             cpu_lora.weight_type(stacks.dtype)], dtype=torch.int64)
        return step, stacks.table

    def apply_split(self, layer: int, modules: tuple[str, ...], x: torch.Tensor, y: torch.Tensor,
                    widths: tuple[int, ...]) -> None:
        """Adds the deltas of `modules`, whose outputs lie side by side in `y`'s columns."""
        start = 0
        for module, width in zip(modules, widths, strict=True):
            self.stacks.apply(layer, module, x, y[:, start:start + width], self.slots)
            start += width


class LoRAStacks:
    def __init__(self, model_config, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.shapes = projection_shapes(model_config)
        self.max_loras, self.max_rank, self.device, self.dtype = max_loras, max_rank, device, dtype
        self.stacks: dict[tuple[int, str], Stack] = {}  # made when a resident adapter first adapts one
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter identity -> slot, least recent first
        self.num_loads = 0
        self.kernel = cpu_lora.lora_shrink_expand if device.type == "cpu" else _triton_kernel()
        # [layers, projections (TARGET_MODULES order), (A, Bt, rank, scale)] addresses, 0 where no
        # stack is made yet: what the fused C++ layers read.
        self.table = torch.zeros(model_config.num_hidden_layers, len(TARGET_MODULES), 4, dtype=torch.int64)

    def slot_rows(self, row_adapters: list[LoRAAdapter | None]) -> torch.Tensor | None:
        """Each row's slot (int32 [T], NO_SLOT for base rows), loading adapters not resident;
        None when no row has an adapter."""
        if not any(row_adapters):
            return None
        wanted = {a.identity: a for a in row_adapters if a is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters, over max_loras={self.max_loras}")
        slot_of = {identity: self._resident(adapter, wanted) for identity, adapter in wanted.items()}
        slots = [slot_of[a.identity] if a is not None else NO_SLOT for a in row_adapters]
        return torch.tensor(slots, dtype=torch.int32, device=self.device)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> None:
        """y += each row's adapter delta of projection `module` in `layer` (no-op if none adapts it)."""
        stack = self.stacks.get((layer, module))
        if stack is not None:
            self.kernel(x, y, slots, stack.a, stack.b, stack.rank, stack.scale)

    def _resident(self, adapter: LoRAAdapter, wanted: Mapping[str, LoRAAdapter]) -> int:
        slot = self.slots.get(adapter.identity)
        if slot is not None:
            self.slots.move_to_end(adapter.identity)
            return slot
        if len(self.slots) < self.max_loras:
            slot = len(self.slots)
        else:  # the least recently used adapter that this step does not need
            victim = next(identity for identity in self.slots if identity not in wanted)
            slot = self.slots.pop(victim)
        self._load(adapter, slot)
        self.slots[adapter.identity] = slot
        return slot

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        """Copies `adapter` into `slot` of every stack (rank 0 where it adapts nothing)."""
        for stack in self.stacks.values():
            stack.rank[slot] = 0
        r = adapter.rank
        for key, (a, b) in adapter.weights.items():
            stack = self._stack(*key)
            stack.a[slot, :r].copy_(a)
            stack.a[slot, r:].zero_()
            stack.b[slot, :, :r].copy_(b)
            stack.b[slot, :, r:].zero_()
            stack.rank[slot] = r
            stack.scale[slot] = adapter.scaling
        self.num_loads += 1

    def _stack(self, layer: int, module: str) -> Stack:
        stack = self.stacks.get((layer, module))
        if stack is None:
            fan_in, fan_out = self.shapes[module]
            s, r, dev, dtype = self.max_loras, self.max_rank, self.device, self.dtype
            if dev.type == "cpu":  # rank-major B, as the C++ kernel reads it
                b = torch.zeros(s, r, fan_out, dtype=dtype).transpose(1, 2)
            else:
                b = torch.zeros(s, fan_out, r, dtype=dtype, device=dev)
            stack = self.stacks[(layer, module)] = Stack(
                torch.zeros(s, r, fan_in, dtype=dtype, device=dev), b,
                torch.zeros(s, dtype=torch.int32, device=dev), torch.zeros(s, dtype=torch.float32, device=dev),
            )
            self.table[layer, TARGET_MODULES.index(module)] = torch.tensor(
                [stack.a.data_ptr(), stack.b.data_ptr(), stack.rank.data_ptr(), stack.scale.data_ptr()])
        return stack


def lora_dtype(name: str, packed: bool) -> torch.dtype:
    """EngineConfig.lora_dtype resolved: "auto" is bfloat16 over packed base weights, else float32."""
    if name == "auto":
        return torch.bfloat16 if packed else torch.float32
    return getattr(torch, name)


def _triton_kernel():
    from streamengine.kernels import lora_shrink_expand  # imports Triton: on CUDA only

    return lora_shrink_expand
