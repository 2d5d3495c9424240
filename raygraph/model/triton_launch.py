"""Programmatic dependent launch (PDL) for the Triton kernels, where GPU and Triton have it.

A decode graph is ~130 small kernels back to back; without PDL each one is launched only
after its predecessor has drained, and a GEMM then starts its weight stream from cold. With
PDL (Hopper and later) a kernel is launched as soon as every program of its predecessor
has called `gdc_launch_dependents()`, and its programs wait in `gdc_wait()` until the
predecessor has finished and its writes are visible (which, transitively, means every
earlier kernel has too). Every kernel here calls `gdc_wait()` before its first load of
anything a predecessor wrote and writes nothing before it, so results are exactly those of
plain stream order. What runs before the wait reads constants only: the decode GEMMs
prefetch their weights into L2 there. The small kernels (norms, attention) let their
successor launch at once, the GEMMs only after their own wait, so the next GEMM's weights
stream in while the current GEMM and the small kernels between them run.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _TRITON_HAS_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # older Triton: the calls compile to nothing
    _TRITON_HAS_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


_WANTED = os.environ.get("RAYGRAPH_PDL", "1") != "0"

__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_options", "pdl", "prefetch_l2"]


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at `ptrs` to be brought into L2 (a hint: nothing waits)."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _enabled(device_index: int) -> bool:
    return _WANTED and _TRITON_HAS_PDL and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels on `t`'s device are launched with PDL."""
    return t.is_cuda and _enabled(t.device.index or 0)


def launch_options(t: torch.Tensor) -> dict[str, bool]:
    """Extra launch options for a kernel whose tensors live where `t` does."""
    return {"launch_pdl": True} if pdl(t) else {}
