"""Multi-LoRA shrink and expand kernels, GPU only; imported lazily by model/lora_ops.py.

A step's tokens each read their own adapter slot (-1: none). The host sorts the tokens by
slot (LoRAInputs.order / sorted_slot), and both kernels tile over that order: BM
consecutive sorted tokens, and for each distinct slot among them a tensor-core tile over
those rows only, reading that slot's A or B tile once: one program per distinct slot of a
tile (grid axis 2), so a decode batch of many adapters runs its slots side by side (one
program walking them in turn took ~150 us a shrink at 64 tokens over 32 slots on an H200).
Base rows (-1) are skipped. The grid depends only on the token count and the shapes,
and every index is read from device memory, so one captured graph serves any mix of slots.

- shrink: u[t, :] = x[t] @ A[s]^T, all of a merged layer's targeted parts at once
  ([T, parts * R]);
- expand: y[t, part p's columns] += u[t, p*R:(p+1)*R] @ B[s, those rows]^T, in place, for
  the targeted parts only (q and v of q|k|v for q/v adapters: k is never read or written).
Rounding follows the torch reference: u is stored in the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BM = 16  # tokens per tile: tl.dot needs 16 rows


@triton.jit
def _nth_slot(slot, n, BM: tl.constexpr):
    """The tile's n-th distinct slot, in order of first appearance (-1: fewer than n + 1).
    A row is its slot's first if no earlier row of the tile has it; rows of -1 count none."""
    i = tl.arange(0, BM)
    seen = (slot[None, :] == slot[:, None]) & (i[None, :] < i[:, None])
    first = (tl.sum(seen.to(tl.int32), axis=1) == 0) & (slot >= 0)
    nth = tl.cumsum(first.to(tl.int32), axis=0) - 1
    return tl.max(tl.where(first & (nth == n), slot, -1), axis=0)


@triton.jit
def _part_start(j, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, SIZE: tl.constexpr):
    """Where the j-th targeted part starts (parts P0 < P1 < P2, each SIZE long)."""
    return tl.where(j == 0, P0, tl.where(j == 1, P1, P2)) * SIZE


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, u_ptr, order_ptr, slot_ptr, T, stride_xm, stride_al, stride_an, stride_um,
    R: tl.constexpr, K: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    # axis 1: (targeted part, column tile of its R ranks)
    pid_n = tl.program_id(1)
    per_part: tl.constexpr = R // BN
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    valid = rm < T
    slot = tl.load(slot_ptr + rm, mask=valid, other=-1)
    tok = tl.load(order_ptr + rm, mask=valid, other=0).to(tl.int64)  # not behind the slot
    cur = _nth_slot(slot, tl.program_id(2), BM)
    if cur >= 0:
        cols = _part_start(pid_n // per_part, P0, P1, P2, R) + (pid_n % per_part) * BN \
            + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        rows = slot == cur
        x_rows = x_ptr + tok[:, None] * stride_xm + rk[None, :]
        a_rows = a_ptr + cur.to(tl.int64) * stride_al + cols[:, None] * stride_an + rk[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            kmask = (k0 + rk) < K
            x = tl.load(x_rows + k0, mask=rows[:, None] & kmask[None, :], other=0.0)
            a = tl.load(a_rows + k0, mask=kmask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
        out = u_ptr + tok[:, None] * stride_um + cols[None, :]
        tl.store(out, acc.to(u_ptr.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _expand_kernel(
    u_ptr, b_ptr, y_ptr, order_ptr, slot_ptr, T, stride_um, stride_us, stride_bl, stride_bn,
    stride_ym,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr,
    C2: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, R: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    # up to three targeted parts' column tiles along axis 1, part by part: part j has N_j
    # output columns from column C_j and reads the ranks of merged part P_j
    pid_n = tl.program_id(1)
    t0: tl.constexpr = (N0 + BN - 1) // BN
    t1: tl.constexpr = (N1 + BN - 1) // BN
    in1 = (pid_n >= t0).to(tl.int32)
    in2 = (pid_n >= t0 + t1).to(tl.int32)
    local = (pid_n - in1 * t0 - in2 * t1) * BN + tl.arange(0, BN)
    nmask = local < N0 + in1 * (N1 - N0) + in2 * (N2 - N1)
    cols = C0 + in1 * (C1 - C0) + in2 * (C2 - C1) + local
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    valid = rm < T
    slot = tl.load(slot_ptr + rm, mask=valid, other=-1)
    tok = tl.load(order_ptr + rm, mask=valid, other=0).to(tl.int64)
    cur = _nth_slot(slot, tl.program_id(2), BM)  # axis 2: one program per distinct slot
    if cur >= 0:
        rk = tl.arange(0, BK)
        u_rows = u_ptr + tok[:, None] * stride_um + cur.to(tl.int64) * stride_us \
            + _part_start(in1 + in2, P0, P1, P2, R) + rk[None, :]
        rows = slot == cur
        b_rows = b_ptr + cur.to(tl.int64) * stride_bl + cols[:, None] * stride_bn + rk[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, R, BK):
            u = tl.load(u_rows + k0, mask=rows[:, None], other=0.0)
            b = tl.load(b_rows + k0, mask=nmask[:, None], other=0.0)
            acc = tl.dot(u.to(b.dtype), tl.trans(b), acc, input_precision=PRECISION)
        out = y_ptr + tok[:, None] * stride_ym + cols[None, :]
        smask = rows[:, None] & nmask[None, :]
        y = tl.load(out, mask=smask, other=0.0)
        # as torch adds the reference's delta: rounded to the activation dtype first
        delta = acc.to(y_ptr.dtype.element_ty)
        tl.store(out, (y.to(tl.float32) + delta.to(tl.float32)).to(y.dtype), mask=smask)


def _precision(x: torch.Tensor) -> str:
    """fp32 models stay fp32: tl.dot would otherwise round its inputs to tf32."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _parts3(parts: tuple[int, ...]) -> tuple[int, int, int]:
    if not 1 <= len(parts) <= 3 or list(parts) != sorted(set(parts)):
        raise ValueError(f"targeted parts must be 1 to 3 increasing indices, got {parts}")
    return (*parts, *(parts[-1],) * (3 - len(parts)))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor,
                sorted_slot: torch.Tensor, rank: int, parts: tuple[int, ...]) -> torch.Tensor:
    """u [T, parts * R] in x's dtype: each token's row of x times its slot's A^T, for the
    targeted parts' ranks only. Rows of slot -1 and columns of untargeted parts are left
    unwritten (expand never reads them)."""
    # x: [T, K]; a: [L, N, K]
    t, k = x.shape
    u = torch.empty(t, a.shape[1], dtype=x.dtype, device=x.device)
    # few tokens: narrow column tiles, so enough programs stream A; many: wide ones, so
    # fewer programs read each row of x again
    bn = 16 if t <= 64 else next(n for n in (64, 32, 16) if rank % n == 0)
    p0, p1, p2 = _parts3(parts)
    grid = (triton.cdiv(t, BM), len(parts) * (rank // bn), min(BM, a.shape[0]))
    _shrink_kernel[grid](
        x, a, u, order, sorted_slot, t, x.stride(0), a.stride(0), a.stride(1), u.stride(0),
        R=rank, K=k, P0=p0, P1=p1, P2=p2, BM=BM, BN=bn,
        # long K tiles: a program streams its slot's whole A slice (H200: BK 512 took
        # 4.6-5.0 us a q|v shrink against 4.9-5.3 at 256); A's tile stays <= 32 KB a stage
        BK=min(512, 32768 // (bn * x.element_size()), max(16, triton.next_power_of_2(k))),
        PRECISION=_precision(x), num_warps=4,
    )
    return u


def lora_expand_(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, order: torch.Tensor,
                 sorted_slot: torch.Tensor, slices: tuple[int, ...],
                 parts: tuple[int, ...], slot_stride: int = 0) -> None:
    """y[:, part p] += u[:, part p's ranks] @ B[slot, part p's rows]^T for each token with a
    slot and each targeted part p, in place. `slot_stride`: 0 when u holds each token's own
    slot's ranks (lora_shrink); the columns between slots when it holds every slot's."""
    # y: [T, out]; u: [T, parts * R]; b: [L, out, R]
    if len(slices) > 3:
        raise ValueError(f"at most 3 merged parts, got {len(slices)}")
    t, r = y.shape[0], b.shape[2]
    starts = [sum(slices[:p]) for p in range(len(slices))]
    p0, p1, p2 = _parts3(parts)
    n0, n1, n2 = (*(slices[p] for p in parts), 0, 0)[:3]
    c0, c1, c2 = (starts[p0], starts[p1], starts[p2])
    bn = 128  # H200, decode at 64 tokens: (128, 2 warps) 0.8 us a layer under (64, 4)
    tiles = sum(triton.cdiv(slices[p], bn) for p in parts)
    _expand_kernel[(triton.cdiv(t, BM), tiles, min(BM, b.shape[0]))](
        u, b, y, order, sorted_slot, t, u.stride(0), slot_stride, b.stride(0), b.stride(1),
        y.stride(0), N0=n0, N1=n1, N2=n2, C0=c0, C1=c1, C2=c2, P0=p0, P1=p1, P2=p2, R=r,
        BM=BM, BN=bn,
        BK=next(bk for bk in (64, 32, 16) if r % bk == 0),
        PRECISION=_precision(y), num_warps=2,
    )


def add_lora_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              order: torch.Tensor, sorted_slot: torch.Tensor, slices: tuple[int, ...],
              parts: tuple[int, ...] | None = None) -> None:
    """y += each token's LoRA delta (lora_ops.lora_delta), in place: shrink, then expand.
    `parts`: the merged parts adapters may target (default all); the others' A and B are
    never read (they hold zeros) and their output columns are left as they are."""
    if x.shape[0] == 0:
        return
    if x.stride(1) != 1 or y.stride(1) != 1 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("LoRA kernels need unit-stride rows and contiguous A/B stacks")
    if b.shape[2] % 16:
        raise ValueError(f"the slots' rank {b.shape[2]} is not a multiple of 16")
    parts = tuple(range(len(slices))) if parts is None else parts
    u = lora_shrink(x, a, order, sorted_slot, b.shape[2], parts)
    lora_expand_(y, u, b, order, sorted_slot, slices, parts)
