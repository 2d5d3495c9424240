"""Programmatic dependent launch (PDL) for the Triton kernels, where GPU and Triton have it.

A decode graph is ~130 small kernels back to back; without PDL each one is launched only
after its predecessor has drained. With PDL (Hopper and later) the next kernel is launched
as soon as every program of the current one has started, and its programs wait in
`gdc_wait` until the predecessor has finished and its writes are visible. Every kernel here
calls `gdc_wait()` before its first load of anything a predecessor wrote, and writes
nothing before it, so results are exactly those of plain stream order; then it calls
`gdc_launch_dependents()`, so at most one kernel runs ahead.

RAYGRAPH_PDL=0 turns it off (read once at import; for A/B timing and debugging).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl  # noqa: F401  (jit functions need it in scope)

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

__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_options"]


@functools.cache
def _enabled(device_index: int) -> bool:
    return _WANTED and _TRITON_HAS_PDL and torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(t: torch.Tensor) -> dict[str, bool]:
    """Extra launch options for a kernel whose tensors live where `t` does."""
    return {"launch_pdl": True} if t.is_cuda and _enabled(t.device.index or 0) else {}
