"""Kernels of the engine, imported as `streamengine.kernels`.

CUDA: Triton kernels for paged attention, the KV cache and batched multi-LoRA
(`lora_shrink_expand`), with their PyTorch references. The Triton wrappers launch compiled
kernels on CUDA tensors, or interpreted ones on CPU tensors when TRITON_INTERPRET=1 was set
before triton was first imported (slow: tests only). The `ref_*` functions are plain PyTorch.

CPU: C++ kernels (csrc/), built on first use into one library by `cpu_build` and called
through ctypes: `cpu_linear` (packed small-batch GEMM), `cpu_attention` (paged decode
attention; `cpu_prefill_attention` for prefill rows), `cpu_ops` (fused element-wise steps), `cpu_layer` (a decoder layer in two calls),
`cpu_lora` (batched multi-LoRA, the CPU twin of the Triton `lora_shrink_expand`).
Import those submodules directly; each falls back to PyTorch where the library cannot run.

This package imports nothing from the engine: the engine calls into it.
"""

from __future__ import annotations

__all__ = [
    "copy_blocks",
    "lora_shrink_expand",
    "paged_attention",
    "ref_copy_blocks",
    "ref_lora_shrink_expand",
    "ref_paged_attention",
    "ref_reshape_and_cache",
    "reshape_and_cache",
    "swap_blocks",
    "triton_available",
    "triton_interpreted",
]

if __name__ != "streamengine.kernels":
    # Imported as a bare top-level `kernels`: with the repository root on sys.path (python -m
    # from the checkout), transformers' probe for the Hugging Face `kernels` package imports
    # this folder. Stay an empty module then (transformers sees no version and ignores it)
    # instead of importing torch and triton, and a second copy of every kernel, as a side effect.
    __all__ = []
else:
    import torch

    from ._launch import runs_interpreted
    from .copy_blocks import copy_blocks, swap_blocks
    from .lora_triton import lora_shrink_expand
    from .paged_attention import _paged_attention_kernel, paged_attention
    from .reference import (
        ref_copy_blocks,
        ref_lora_shrink_expand,
        ref_paged_attention,
        ref_reshape_and_cache,
    )
    from .reshape_and_cache import reshape_and_cache

    def triton_interpreted() -> bool:
        """Whether the kernels run in the Triton interpreter (so also on CPU tensors, slowly)."""
        return runs_interpreted(_paged_attention_kernel)

    def triton_available() -> bool:
        """Whether the Triton kernels can run here: a CUDA device, or the Triton interpreter.

        The interpreter is for tests: an engine on CPU should still choose the torch path
        (select the Triton backend by tensor device, not by this function alone).
        """
        return torch.cuda.is_available() or triton_interpreted()
