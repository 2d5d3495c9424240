"""Programmatic dependent launch (PDL) for the decode chain's Triton kernels (Hopper and
later; GPU only).

A decode step is a chain of ~8 kernels a layer, each streaming a weight it already knows
while its input comes from the kernel before. Launched in order, every boundary costs a
launch, a ramp-up of fresh loads and the previous kernel's tail. Launched with PDL, a
kernel may start while the one before still runs: each kernel lets the next one launch at
its own start (`launch_next`), issues its first weight loads, then waits for the previous
kernel's completion and its writes (`await_inputs`). So the next weight stream begins while
a latency-bound kernel (a norm, the attention of one sequence) waits and works.

Weights are not written inside a step (a worker with weight offload, which copies them in
during the step, turns PDL off: `set_enabled`), so only weight loads, and reads of step
inputs that no kernel of the chain writes (a token's position: copied in before the graph,
or made by a kernel launched without PDL, which completes before anything after it
starts), and of cached keys before the one-token row's own (decode attention's first tile),
may run before the wait; every write and every read of an activation comes after it. Those
keys were stored by an earlier forward, and every forward begins with the token embedding,
a torch op launched in plain stream order: it starts only once every kernel before it has
completed, so no kernel of a forward starts before the one before it is done. A caller at
one row must pass weights no kernel of the same stream has just written.

Only one-token steps launch this way (`pdl`). Each kernel launched with PDL calls
`launch_next` first and `await_inputs` in every program before it writes or reads an
activation, so completion stays transitive along the chain: a kernel completes only after
the one before it did. Kernels launched without it (cuBLAS, torch ops, the cascade's
two-stream attention) keep the plain stream order, and a kernel after one of them starts
once it completed.

`RAYGRAPH_PDL=0` launches everything in plain stream order (for comparison).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Under PDL: let the next kernel launch now, at this one's start. It launches once every
    program of this one has started, so it never takes room this one still needs; its
    programs then stream their first weight tiles while this one works. A no-op otherwise."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel completed (its writes visible). A no-op
    otherwise."""
    if PDL:
        gdc_wait()


_enabled = True  # this process's switch (set_enabled)


def set_enabled(on: bool) -> None:
    """PDL on or off for this process's launches from now on (the worker's choice: off when
    weights are copied into device slots inside a step, weight offload, since a kernel's
    first weight loads may run before the copy is done)."""
    global _enabled
    _enabled = on


@functools.cache
def _supported(device: int) -> bool:
    return (gdc_wait is not None and os.environ.get("RAYGRAPH_PDL", "1") != "0"
            and torch.cuda.get_device_capability(device) >= (9, 0))


def pdl(x: torch.Tensor, rows: int, allowed: bool = True) -> dict:
    """Launch options of a kernel taking `PDL: tl.constexpr`. PDL on for one-token steps
    (`rows` == 1) where the GPU and Triton support it (and `allowed`): their kernels have
    many light programs, so one launched early finds room beside the running one. At more
    rows the tensor-core GEMVs run one or two programs an SM, heavy on shared memory, and an
    early dependent takes room they need: such steps measured slower with PDL
    (bench/RESULTS.md, "One-token steps with programmatic dependent launch").
    Off on the CPU (Triton's interpreter has no grid dependency control)."""
    if allowed and _enabled and rows == 1 and x.is_cuda and _supported(x.device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
