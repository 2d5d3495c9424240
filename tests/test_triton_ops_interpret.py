"""The GPU's elementwise, skinny-GEMM and LoRA kernels run by Triton's interpreter on CPU
tensors (float16 and float32: the interpreter has no bfloat16), against the torch paths
the CPU runs (`ops`, `lora_ops`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raygraph.graph.inputs import sort_by_slot
from raygraph.model import ops
from raygraph.model.lora_ops import lora_delta


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_pos, head_dim / 2] fp32, as model/rope.py makes them."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), inv)
    return freqs.cos(), freqs.sin()


def tolerance(dtype: torch.dtype, ulps: int = 8) -> dict:
    # kernel vs torch: other reduction orders, so a few (over long sums, a few hundred)
    # epsilons; a wrong row, slot or mask is off by O(1)
    eps = torch.finfo(dtype).eps
    return dict(atol=ulps * eps, rtol=ulps * eps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_norms_silu_argmax_and_kv_store(interpreted, dtype):
    k_ops = interpreted("triton_ops")
    torch.manual_seed(0)
    x, r = torch.randn(2, 5, 96, dtype=dtype)  # a width that is not a power of two
    w = torch.rand(96, dtype=dtype) + 0.5
    torch.testing.assert_close(k_ops.rms_norm(x, w, 1e-6)[0], ops.rms_norm(x, w, 1e-6),
                               **tolerance(dtype))
    got, total, _ = k_ops.add_rms_norm(x, r, w, 1e-6)
    want, want_total = ops.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    assert torch.equal(total, want_total)
    gu = torch.randn(7, 2 * 1100, dtype=dtype)  # more columns than one tile
    torch.testing.assert_close(k_ops.silu_and_mul(gu)[0], ops.silu_and_mul(gu),
                               **tolerance(dtype))
    logits = torch.randn(4, 3000, dtype=dtype)
    logits[1, [17, 2999]] = 50.0  # a tie: the first index wins
    logits[2] = float("-inf")
    assert torch.equal(k_ops.argmax(logits), logits.argmax(-1))
    k, v = torch.randn(2, 6, 2, 8, dtype=dtype)
    caches = [torch.zeros(5, 4, 2, 8, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([3, -1, 0, 18, 7, -1])  # -1: padding, writes nothing
    k_ops.store_kv(k, v, caches[0], caches[1], slots)
    ops.store_kv(k, v, caches[2], caches[3], slots)
    caches[2].view(-1, 2, 8)[-1] = 0  # the torch path parks padding rows in the scratch slot
    caches[3].view(-1, 2, 8)[-1] = 0
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_qk_norm_in_one_launch_equals_two_norms(interpreted, dtype, t):
    """Qwen3's q/k norms: q's and k's heads, views of one q|k|v projection's rows, each
    normalised with its own weight in one launch: equal to the two rms_norm launches, and
    to the torch path within rounding."""
    k_ops = interpreted("triton_ops")
    torch.manual_seed(t)
    hq, hk, d = 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype) * 3
    q, k = (p.view(t, -1, d) for p in qkv.split([hq * d, hk * d, hk * d], dim=-1)[:2])
    wq, wk = torch.rand(d, dtype=dtype) + 0.5, torch.rand(d, dtype=dtype) + 0.5
    got_q, got_k = k_ops.qk_rms_norm(q, k, wq, wk, 1e-6)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, k_ops.rms_norm(q.reshape(-1, d), wq, 1e-6)[0].view(t, hq, d))
    assert torch.equal(got_k, k_ops.rms_norm(k.reshape(-1, d), wk, 1e-6)[0].view(t, hk, d))
    want_q, want_k = ops.qk_norm(q, k, wq, wk, 1e-6)  # the CPU path
    torch.testing.assert_close(got_q, want_q, **tolerance(dtype))
    torch.testing.assert_close(got_k, want_k, **tolerance(dtype))
    assert not torch.allclose(got_k, ops.rms_norm(k.reshape(-1, d), wq, 1e-6).view(t, hk, d))


@pytest.mark.parametrize("dtype,d", [(torch.float16, 32), (torch.float32, 32),
                                     (torch.float32, 80), (torch.float32, 100)])
def test_rotary_in_place(interpreted, dtype, d):
    """Any even head size: half of 80 or 100 is no power of two."""
    k_ops = interpreted("triton_ops")
    torch.manual_seed(1)
    cos, sin = rope_tables(d, 512, 10000.0)
    q, k = torch.randn(5, 6, d, dtype=dtype), torch.randn(5, 2, d, dtype=dtype)
    pos = torch.tensor([0, 3, 100, 511, 7])
    want_q, want_k = ops.rotary(q, k, cos, sin, pos)
    k_ops.rotary_(q, k, cos, sin, pos)
    torch.testing.assert_close(q, want_q, **tolerance(dtype))
    torch.testing.assert_close(k, want_k, **tolerance(dtype))


@pytest.mark.parametrize("m", [1, 3])
def test_skinny_gemms_with_their_epilogues(interpreted, m):
    """Plain with a bias (N not a multiple of the tile), gate|up with silu*mul, q|k|v with
    rotary: the row kernel (m = 1) and the tensor-core kernel (m > 1)."""
    gemv = interpreted("triton_gemv")
    torch.manual_seed(m)
    dt, k = torch.float16, 256
    tol = dict(atol=2e-3, rtol=2e-3)  # fp16 rounding of sums over 256 products
    x = torch.randn(m, k, dtype=dt)
    w, bias = torch.randn(100, k, dtype=dt) * 0.05, torch.randn(100, dtype=dt)
    want = F.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(gemv.gemv(x, w, bias).float(), want, **tol)
    gu = torch.randn(2 * 64, k, dtype=dt) * 0.05
    want = ops.silu_and_mul(F.linear(x.float(), gu.float()))
    torch.testing.assert_close(gemv.gemv_silu_mul(x, gu).float(), want, **tol)
    hq, hk, d = 4, 2, 32
    wqkv = torch.randn((hq + 2 * hk) * d, k, dtype=dt) * 0.05
    cos, sin = rope_tables(d, 64, 10000.0)
    pos = torch.arange(m) * 5 + 1
    got = gemv.gemv_rotary(x, wqkv, None, pos, cos, sin, d, hq + hk)
    q, kk, v = F.linear(x.float(), wqkv.float()).split([hq * d, hk * d, hk * d], dim=-1)
    q, kk = ops.rotary(q.view(m, hq, d), kk.view(m, hk, d), cos, sin, pos)
    torch.testing.assert_close(got.float(), torch.cat([q.flatten(1), kk.flatten(1), v], 1),
                               **tol)


@pytest.mark.parametrize("cfg", [(2, 1024, 2, 1), (4, 1024, 4, 1, True), (2, 4096, 4, 1, True)])
def test_the_row_kernel_masks_a_last_run_past_k(interpreted, cfg):
    """K 3584 in runs of 1024 (the last one half past K) or in one run of 4096: rows and
    columns past the weight read nothing. x and the weights are views of rows padded with
    NaN, so a tile that read past K would turn the sums NaN."""
    gemv = interpreted("triton_gemv")
    torch.manual_seed(3)
    dt, k = torch.float16, 3584

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.full((t.shape[0], 1024), float("nan"), dtype=dt)], 1)[:, :k]

    x, w = padded(torch.randn(1, k, dtype=dt)), padded(torch.randn(66, k, dtype=dt) * 0.02)
    got = gemv.gemv(x, w, None, gemv.GemvConfig(*cfg))
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()),
                               **tolerance(dt))
    gu = padded(torch.randn(2 * 64, k, dtype=dt) * 0.02)
    got = gemv.gemv_silu_mul(x, gu, gemv.GemvConfig(*cfg))
    torch.testing.assert_close(got.float(), ops.silu_and_mul(F.linear(x.float(), gu.float())),
                               **tolerance(dt))
    hq, hk, d = 2, 1, 32  # q|k|v heads: each program's partner rows take their own runs
    wqkv = padded(torch.randn((hq + 2 * hk) * d, k, dtype=dt) * 0.02)
    cos, sin = rope_tables(d, 64, 10000.0)
    pos = torch.tensor([5])
    got = gemv.gemv_rotary(x, wqkv, None, pos, cos, sin, d, hq + hk, gemv.GemvConfig(*cfg))
    q, kk, v = F.linear(x.float(), wqkv.float()).split([hq * d, hk * d, hk * d], dim=-1)
    q, kk = ops.rotary(q.view(1, hq, d), kk.view(1, hk, d), cos, sin, pos)
    torch.testing.assert_close(got.float(), torch.cat([q.flatten(1), kk.flatten(1), v], 1),
                               **tolerance(dt))


def test_row_configs_of_narrow_shards():
    """The 8B's narrow shards (fewer than 4096 rows over K 4096, or 4096 over K 2048) take 2
    rows a program; llama-1b's o its own tiles."""
    from raygraph.model import triton_gemv as gemv

    assert gemv.row_config(1536, 4096) == gemv.GemvConfig(2, 1024, 2, 1)
    assert gemv.row_config(4096, 2048) == gemv.GemvConfig(2, 1024, 2, 1)
    assert gemv.row_config(2048, 2048).block_n == 4  # llama-1b's o: its own tiles
    assert gemv.row_config(4096, 4096) == gemv.GemvConfig(4, 1024, 4, 1, True)
    # bf16 rows that runs of 1024 do not divide (Qwen2.5-7B's): runs of 4096, the last masked
    for n, k in ((4608, 3584), (3584, 3584), (3584, 18944)):
        assert gemv.row_config(n, k) == gemv.GemvConfig(2, 4096, 4, 1, True)
    # shorter rows keep runs that divide them (Qwen2.5-0.5B's 896, 1.5B's 1536)
    assert gemv.row_config(1152, 896) == gemv.GemvConfig(4, 128, 4, 1)
    assert gemv.row_config(2048, 1536) == gemv.GemvConfig(4, 512, 4, 1)
    # FP8 rows of 2049 to ONE_RUN_FP8 columns: one run of the next power of two, from 8192
    # on 256 bytes a thread; longer, 8 rows over runs of 1024; shorter, 4 over the row
    one_run = gemv.GemvConfig(2, 16384, 4, 1, True)
    assert gemv.row_config(4096, 4096, True) == gemv.GemvConfig(8, 4096, 8, 1, True)  # o
    assert gemv.row_config(6144, 4096, True) == gemv.GemvConfig(4, 4096, 4, 1, True)
    assert gemv.row_config(14336, 4096, True, 2) == gemv.GemvConfig(4, 4096, 4, 1, True)
    assert gemv.row_config(4096, 14336, True) == one_run  # the 8B's down
    assert gemv.row_config(4096, 12288, True) == one_run  # Qwen3-8B's
    assert gemv.row_config(4096, 16384, True) == one_run
    # Qwen2.5-7B's 3584-wide rows
    for n in (4608, 3584):
        assert gemv.row_config(n, 3584, True) == gemv.GemvConfig(4, 4096, 4, 1, True)
    # the 70B's q|k|v and o; its gate|up (two row sets: 2 rows of each); its and Qwen2.5's
    # down
    for n in (10240, 8192):
        assert gemv.row_config(n, 8192, True) == gemv.GemvConfig(4, 8192, 4, 1, True)
    assert gemv.row_config(28672, 8192, True, 2) == gemv.GemvConfig(2, 8192, 4, 1, True)
    for n, k in ((8192, 28672), (3584, 18944)):
        assert gemv.row_config(n, k, True) == gemv.GemvConfig(2, 32768, 8, 1, True)
    assert gemv.row_config(8192, 65536, True) == gemv.GemvConfig(8, 1024, 4, 1, True)
    assert gemv.row_config(2048, 2048, True) == gemv.GemvConfig(4, 2048, 4, 1, True)


def test_lora_shrink_and_expand(interpreted):
    """Each token's slot (-1: none) through the shrink + expand kernels, and the expand at
    a slot stride over every slot's u; base rows untouched bitwise."""
    lora = interpreted("triton_lora")
    torch.manual_seed(2)
    dt, slots_n, rank, k, slices, t = torch.float32, 3, 16, 64, (48, 16, 16), 11
    a = torch.randn(slots_n, len(slices) * rank, k, dtype=dt) / k**0.5
    b = torch.randn(slots_n, sum(slices), rank, dtype=dt) / rank**0.5
    x, y = torch.randn(t, k, dtype=dt), torch.randn(t, sum(slices), dtype=dt)
    slots = torch.tensor([0, -1, 2, 2, 1, -1, 0, 1, 2, -1, 0], dtype=torch.int32)
    order, ordered = (torch.as_tensor(v.astype(np.int32)) for v in sort_by_slot(slots.numpy()))
    want = y + lora_delta(x, a, b, slots, slices)
    got = y.clone()
    lora.add_lora_(got, x, a, b, order, ordered, slices)
    torch.testing.assert_close(got, want, **tolerance(dt, 256))
    base = slots < 0
    assert torch.equal(got[base], y[base])
    got = y.clone()
    lora.lora_expand_(got, x @ a.reshape(-1, k).T, b, order, ordered, slices, (0, 1, 2),
                      slot_stride=a.shape[1])
    torch.testing.assert_close(got, want, **tolerance(dt, 256))
