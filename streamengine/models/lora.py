"""LoRA adapters in the forward: the resident adapters stacked per projection, and each
step's rows mapped to them.

Rows of different adapters (and of none) share one step. Each adapted projection of each
layer keeps a stack of its resident adapters' A [S, R, in] and B [S, out, R] (R the engine's
max_lora_rank, a slot's rank past its own zero-padded and skipped), their ranks and scalings;
after the base projection, every row of slot s gets `scaling[s] * B[s] (A[s] x)` added
(kernels/cpu_lora.py on CPU, kernels/lora_triton.py on CUDA: rows grouped by slot, shrink
then expand). An adapter not targeting a
projection has rank 0 there. Slots are reused least recently used first, never one a row of
the step needs: the scheduler runs at most `max_loras` adapters at once, so a step's adapters
always have slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from streamengine.kernels import cpu_lora
from streamengine.lora.adapter import LoRAAdapter, projection_shapes

NO_SLOT = -1  # a row of the base model


@dataclass(slots=True)
class Stack:
    """One projection's resident adapters."""

    a: torch.Tensor  # [S, R, in]
    b: torch.Tensor  # [S, out, R]
    rank: torch.Tensor  # [S] int32; 0: the slot's adapter does not adapt this projection
    scale: torch.Tensor  # [S] float32


@dataclass(slots=True)
class LoRAStep:
    """One step's rows and the stacks they use."""

    stacks: LoRAStacks
    slots: torch.Tensor  # [T] int32, NO_SLOT for base rows

    def apply_split(self, layer: int, modules: tuple[str, ...], x: torch.Tensor, y: torch.Tensor,
                    widths: tuple[int, ...]) -> None:
        """Adds the deltas of `modules`, whose outputs lie side by side in `y`'s columns."""
        start = 0
        for module, width in zip(modules, widths, strict=True):
            self.stacks.apply(layer, module, x, y[:, start:start + width], self.slots)
            start += width


class LoRAStacks:
    def __init__(self, model_config, max_loras: int, max_rank: int, device: torch.device) -> None:
        self.shapes = projection_shapes(model_config)
        self.max_loras, self.max_rank, self.device = max_loras, max_rank, device
        self.stacks: dict[tuple[int, str], Stack] = {}  # made when a resident adapter first adapts one
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter identity -> slot, least recent first
        self.num_loads = 0
        self.kernel = cpu_lora.lora_shrink_expand if device.type == "cpu" else _triton_kernel()

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
            s, r, dev = self.max_loras, self.max_rank, self.device
            stack = self.stacks[(layer, module)] = Stack(
                torch.zeros(s, r, fan_in, device=dev), torch.zeros(s, fan_out, r, device=dev),
                torch.zeros(s, dtype=torch.int32, device=dev), torch.zeros(s, dtype=torch.float32, device=dev),
            )
        return stack


def _triton_kernel():
    from streamengine.kernels import lora_shrink_expand  # imports Triton: on CUDA only

    return lora_shrink_expand
