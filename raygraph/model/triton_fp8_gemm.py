"""W8A8 FP8 GEMMs of tens to a few hundred token rows, for the weights cuBLASLt tiles badly
(GPU only; imported lazily by model/ops.py).

x arrives quantized per token (e4m3 and a float32 scale a row), the weight per output row;
y = (xq @ Wq^T) * x_scale * w_scale (+ bias), in x's dtype, as torch._scaled_mm computes
it. Block-quantized weights (a scale a row and 128 columns: the 128 x 128 blocks of
DeepSeek-style checkpoints) meet x quantized per token and group of 128: each K tile is one
group, its product scaled by the two sides' scales as it is added, which _scaled_mm's
row-wise scales cannot express.

cuBLASLt's FP8 kernels tile the output 128 x 128: a projection to 4096 columns at 64
rows is 32 tiles for 132 SMs, and streams its weight at a fraction of the bandwidth. Here a
program owns 64 rows by a narrow run of columns (32 to 128), so such a GEMM has ~100 to
220 programs, each streaming its weight rows through a deep shared-memory pipeline into the
FP8 tensor cores (float32 accumulation). Where cuBLASLt's tiles are full (more rows, or
wide weights past 64 rows), `preferred` sends the GEMM back to it.

Past 128 rows a weight with a scale a row streams 64 x 128 tiles through the tensor memory
accelerator (TMA descriptors: one bulk copy a tile, no per-thread address math): level with
pointer loads of the same tiles or up to 10% faster on the 8B shapes, and 10-25% faster
than the 64 x 64 tiles served there before (bench/RESULTS.md, "FP8 GEMMs of 129 to 256
rows"). An eager launch costs ~15 us more host time (the descriptors); a graph, nothing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:  # Triton 3.3 on: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


class Fp8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False  # tiles through TMA descriptors (a scale a row only)


@triton.jit
def _scale_and_store(acc, as_ptr, bs_ptr, bias_ptr, c_ptr, rm, rn, M, stride_cm,
                     HAS_BIAS: tl.constexpr, SCALE: tl.constexpr):
    """acc [BM, BN] (SCALE: times the row scales of both sides) (+ bias) into c's rows rm
    below M, columns rn, in c's dtype."""
    mmask = rm < M
    if SCALE:
        acc *= tl.load(as_ptr + rm, mask=mmask, other=0.0)[:, None]
        acc *= tl.load(bs_ptr + rn)[None, :]
    if HAS_BIAS:  # added to the output as it is stored, as _scaled_mm's caller adds it
        y = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        y += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    else:
        y = acc
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :],
             y.to(c_ptr.dtype.element_ty), mask=mmask[:, None])


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, c_ptr, M, stride_am, stride_bn,
                     stride_cm, N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUPS: tl.constexpr):
    """GROUPS: scale columns a row on both sides, [M, GROUPS] and [N, GROUPS] (1: one a
    row, applied at the end; else one a row and K tile)."""
    # the row tiles of one column run are neighbours: its weight rows are read from HBM once
    m_tiles = tl.cdiv(M, BM)
    pid = tl.program_id(0)
    pid_m, pid_n = pid % m_tiles, pid // m_tiles
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mmask = rm < M
    a = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b = b_ptr + rn.to(tl.int64)[:, None] * stride_bn + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(a + k0, mask=mmask[:, None], other=0.0)
        w = tl.load(b + k0)
        if GROUPS == 1:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            xs = tl.load(as_ptr + rm * GROUPS + k0 // BK, mask=mmask, other=0.0)
            ws = tl.load(bs_ptr + rn * GROUPS + k0 // BK)
            acc += tl.dot(x, tl.trans(w)) * xs[:, None] * ws[None, :]
    _scale_and_store(acc, as_ptr, bs_ptr, bias_ptr, c_ptr, rm, rn, M, stride_cm, HAS_BIAS,
                     GROUPS == 1)


@triton.jit
def _fp8_gemm_tma_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, stride_cm,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr):
    """The same GEMM, a scale a row: x's and W's tiles arrive through TMA descriptors
    ([BM, BK] and [BN, BK] blocks; rows past M read as zeros)."""
    m_tiles = tl.cdiv(M, BM)
    pid = tl.program_id(0)
    pid_m, pid_n = pid % m_tiles, pid // m_tiles
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        x = a_desc.load([pid_m * BM, k0])
        w = b_desc.load([pid_n * BN, k0])
        acc = tl.dot(x, w.T, acc)
    _scale_and_store(acc, as_ptr, bs_ptr, bias_ptr, c_ptr, pid_m * BM + tl.arange(0, BM),
                     pid_n * BN + tl.arange(0, BN), M, stride_cm, HAS_BIAS, True)


def config(m: int, n: int, k: int, grouped: bool = False, sms: int = 132,
           tma: bool = True) -> Fp8GemmConfig:
    """Tiles for m rows of an [n, k] weight on a GPU of `sms` SMs, from sweeps on the 8B
    shapes (bench/RESULTS.md, "FP8 GEMMs of 16 to 512 rows" and "of 129 to 256 rows"): 64
    rows a program; up to 64 rows, columns so the programs number ~100-220 (32 up to 4096
    columns, 64 up to 8192, else 128); more rows, 64 columns. Six pipeline stages, four at
    128 columns. Scales per group (`grouped`: each K tile's product scaled as it is added)
    take 128 columns past 128 rows, and past 64 on wide weights (a sweep of their own:
    "Block-scaled weights"). A scale a row past 128 rows, on a GPU with TMA (`tma`): 128
    columns through it, six stages where the programs fit one an SM, else four (two an SM
    fit in Hopper's shared memory)."""
    if m > 128 and not grouped and tma:
        programs = triton.cdiv(m, 64) * triton.cdiv(n, 128)
        return Fp8GemmConfig(64, 128, 128, 4, 6 if programs <= sms else 4, tma=True)
    block_n = 64
    if m <= 64:
        block_n = 32 if n <= 4096 else 64 if n <= 8192 else 128
    elif grouped and (m > 128 or n > 8192):
        block_n = 128
    return Fp8GemmConfig(64, block_n, 128, 4, 4 if block_n == 128 else 6)


def supports(m: int, n: int, k: int, group: int | None = None) -> bool:
    """Shapes the kernel takes: whole column runs and K tiles (any number of rows); scale
    groups (`group` columns, None: one scale a row) that are its K tiles: a power of two
    from 32 (the FP8 tensor cores' K step) to 256."""
    if group is not None and not (group in (32, 64, 128, 256) and k % group == 0):
        return False
    return n % 128 == 0 and k % 128 == 0


def preferred(m: int, n: int, k: int, tma: bool = True) -> bool:
    """Whether m rows of an [n, k] weight go here rather than to cuBLASLt (_scaled_mm):
    where the sweeps found it faster or level: up to 64 rows every 8B GEMM. On a GPU with
    TMA (`has_tma`), up to 256 rows those of 8192 columns or fewer (q|k|v, o, down) and
    129 to 192 rows the wide ones too (gate|up: cuBLASLt took 72-82 us there against 57-63
    through TMA, and 63 at 256 rows); without it the pointer-load tiles' measured range: up
    to 128 rows of 8192 columns or fewer, up to 256 of 4096. Elsewhere cuBLASLt's 128 x 128
    tiles are full and at least level."""
    if not supports(m, n, k):
        return False
    if not tma:
        return m <= 64 or (m <= 128 and n <= 8192) or (m <= 256 and n <= 4096)
    return m <= 64 or (m <= 256 and n <= 8192) or 128 < m <= 192


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def has_tma(device: torch.device) -> bool:
    """Hopper and later have the tensor memory accelerator (Ada's FP8 tensor cores do not);
    the interpreter reads descriptors on the CPU."""
    if TensorDescriptor is None:
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _tma_takes(t: torch.Tensor) -> bool:
    """TMA reads rows whose start and stride are 16-byte aligned."""
    return (has_tma(t.device) and t.data_ptr() % 16 == 0
            and t.stride(0) * t.element_size() % 16 == 0)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None,
             cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
    """(xq @ w^T) * x_scale * w_scale (+ bias): xq [M, K] and w [N, K] e4m3, x_scale [M, G]
    and w_scale [N, G] float32 (G = 1: a scale a row; else a row and K / G columns, which
    are the K tiles); [M, N] in out_dtype."""
    m, k = xq.shape
    n, groups = w.shape[0], w_scale.shape[1]
    cfg = cfg or config(m, n, k, groups > 1, _sms(xq.device) if xq.is_cuda else 132,
                        has_tma(xq.device))
    if groups > 1:
        cfg = cfg._replace(block_k=k // groups, tma=False)
        if x_scale.shape != (m, groups) or not supports(m, n, k, cfg.block_k):
            raise ValueError(f"scales of {groups} groups over K {k} (x: "
                             f"{tuple(x_scale.shape)}) are not the kernel's K tiles")
    if n % cfg.block_n or k % cfg.block_k or w.shape[1] != k:
        raise ValueError(f"an [{n}, {w.shape[1]}] weight at {m} x {k} does not tile by {cfg}")
    if xq.stride(1) != 1 or w.stride(1) != 1 or not (x_scale.is_contiguous()
                                                      and w_scale.is_contiguous()):
        raise ValueError("the FP8 GEMM takes rows of unit stride and contiguous scales")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(m, cfg.block_m) * (n // cfg.block_n),)
    bias_arg = bias if bias is not None else w_scale  # (not read without a bias)
    if cfg.tma and _tma_takes(xq) and _tma_takes(w):
        _fp8_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]), x_scale, w_scale,
            bias_arg, out, m, out.stride(0), K=k, HAS_BIAS=bias is not None,
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        return out
    _fp8_gemm_kernel[grid](
        xq, w, x_scale, w_scale, bias_arg, out, m, xq.stride(0),
        w.stride(0), out.stride(0), N=n, K=k, HAS_BIAS=bias is not None, BM=cfg.block_m,
        BN=cfg.block_n, BK=cfg.block_k, GROUPS=groups, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
