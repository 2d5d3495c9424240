"""The skinny GEMMs on FP8 weights, run by Triton's interpreter on CPU tensors, against the
reference path's math (`ops` on CPU: x as the FP8 GEMM sees it, which at decode rows is x as
it is, times the dequantized weight): one scale a row and one a row and 128 columns, 1, 3
and 8 tokens, the plain, silu*mul and rotary epilogues.

float16 activations: the interpreter has no bfloat16. Its float32 -> e4m3 conversion rounds
some values a binade low (7.9 -> 4, not 8) and subnormals wrong; `exact_e4m3` gives it
torch's round-to-nearest-even, what the GPU's cvt.rn computes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raygraph.model import fp8_rows, ops
from raygraph.model.quant import (
    Fp8Weight,
    activations_as_quantized,
    dequantize,
    quantize,
    rounds_activations,
)
from tests.test_triton_ops_interpret import rope_tables

K, HQ, HK, D = 512, 2, 1, 32
DT = torch.float16
# against the reference: the output rounded to float16 once (or gate and up each, before
# silu * up; or before the rotation), float32 sums in another order. A row read with a wrong
# scale is off by far more: hundreds of float16 epsilons of the output.
ULPS = 4


@pytest.fixture
def exact_e4m3(interpreted, monkeypatch):
    """The interpreter with torch's float32/float16 -> e4m3 rounding (see the docstring)."""
    interpreted("triton_gemv")
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    convert = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.float16):
            return convert(self, src, dst_type, rounding_mode)
        q = torch.from_numpy(src.data.astype(np.float32)).to(torch.float8_e4m3fn)
        return interpreter.TensorHandle(q.view(torch.uint8).numpy(), dst_type.scalar)

    monkeypatch.setattr(builder, "create_fp_to_fp", create_fp_to_fp)
    return interpreted("triton_gemv")


def fp8_weight(n: int, group: int, activations: str, seed: int) -> Fp8Weight:
    """Random rows, quantized per row (group = K) or per row and `group` columns; rows whose
    magnitudes differ by 100x, so a scale read from the wrong row or group shows."""
    torch.manual_seed(seed)
    w = torch.randn(n, K) / K**0.5 * torch.logspace(-1, 1, n).view(-1, 1)[torch.randperm(n)]
    data, scale = quantize(w, group)
    x_scale = torch.tensor([3.0 / 448]) if activations == "static" else None  # clips a few
    return Fp8Weight(data, scale, group, activations, x_scale)


def tokens(m: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return (torch.randn(m, K) * torch.logspace(-1, 0.5, m).view(-1, 1)).to(DT)


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    """got within ULPS float16 steps of want's magnitude."""
    eps = torch.finfo(DT).eps
    torch.testing.assert_close(got.float(), want, rtol=ULPS * eps,
                               atol=ULPS * eps * want.abs().max().item())


def reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The reference path's product in float32: decode rows are not rounded to e4m3."""
    assert not rounds_activations(x, w)
    w32, b32 = w.dequantize(torch.float32), None if bias is None else bias.float()
    return F.linear(activations_as_quantized(x, w).float(), w32, b32)


# the row kernel's tiles (M = 1): runs of 256 columns (two groups, two runs over K), whole
# or each summed as it is read; one run of 1024 of which K fills half
ROW_TILES = {"whole": (4, 256, 4, 1), "summed": (4, 256, 4, 1, True),
             "past K": (2, 1024, 4, 1, True)}


def nan_past_k(w: Fp8Weight) -> Fp8Weight:
    """w with its rows and scale rows as views of rows padded with NaN (e4m3's 0x7F, float32
    NaN): a run that read a scale past K would turn the sums NaN. (Triton's interpreter
    widens 0x7F to a finite value, so the weight bytes' own mask is checked on float16 rows,
    in test_triton_ops_interpret.)"""
    n, k = w.data.shape
    groups = w.scale.shape[1]
    data = torch.full((n, k + 1024), float("nan")).to(w.data.dtype)
    data[:, :k] = w.data
    scale = torch.full((n, groups + 8), float("nan"))
    scale[:, :groups] = w.scale
    return Fp8Weight(data[:, :k], scale[:, :groups], w.group, w.activations, w.input_scale)


@pytest.mark.parametrize("m, tile", [(1, "whole"), (1, "summed"), (1, "past K"), (3, None),
                                     (8, None)])
@pytest.mark.parametrize("activations", ["none", "dynamic"])
@pytest.mark.parametrize("group", [K, 128])
def test_fp8_skinny_gemms_match_the_reference(exact_e4m3, group, activations, m, tile):
    gemv = exact_e4m3
    cfg = gemv.GemvConfig(*ROW_TILES[tile]) if tile else None
    seed = m + group + len(activations)
    x = tokens(m, seed)
    pad = nan_past_k if tile == "past K" else (lambda w: w)
    w = pad(fp8_weight(96, group, activations, seed))  # 96: not a multiple of the tile
    bias = torch.randn(96).to(DT)
    assert gemv.supports(x, w)
    check(gemv.gemv(x, w, bias, cfg), reference(x, w, bias))

    gu = pad(fp8_weight(2 * 64, group, activations, seed + 1))
    check(gemv.gemv_silu_mul(x, gu, cfg), ops.silu_and_mul(reference(x, gu)))

    qkv = pad(fp8_weight((HQ + 2 * HK) * D, group, activations, seed + 2))
    cos, sin = rope_tables(D, 64, 10000.0)
    pos = torch.arange(m) * 5 + 1

    def rotated(y: torch.Tensor) -> torch.Tensor:
        q, k, v = y.split([HQ * D, HK * D, HK * D], dim=-1)
        q, k = ops.rotary(q.view(m, HQ, D), k.view(m, HK, D), cos, sin, pos)
        return torch.cat([q.flatten(1), k.flatten(1), v], 1)

    got = gemv.gemv_rotary(x, qkv, None, pos, cos, sin, D, HQ + HK, cfg)
    check(got, rotated(reference(x, qkv)))


@pytest.mark.parametrize("m", [1, 4])
def test_ops_route_decode_rows_to_the_fp8_kernels(exact_e4m3, monkeypatch, m):
    """ops.linear and its fused variants at decode rows on the kernels' device: the FP8
    kernels above, reading the weight itself (no dequantized copy is made)."""
    gemv = exact_e4m3
    x = tokens(m, 5)
    w = fp8_weight(256, 128, "dynamic", 6)
    cos, sin = rope_tables(D, 64, 10000.0)
    pos = torch.arange(m) + 3
    heads = 256 // D
    want = gemv.gemv(x, w), gemv.gemv_silu_mul(x, w)
    want_qkv = gemv.gemv_rotary(x, w, None, pos, cos, sin, D, heads - 1).split(
        [(heads - 2) * D, D, D], dim=-1)

    def no_copy(*args, **kwargs):
        raise AssertionError("the FP8 weight was dequantized")

    monkeypatch.setattr(Fp8Weight, "dequantize", no_copy)
    monkeypatch.setattr(ops, "kernels", lambda t: True)
    assert torch.equal(ops.linear(x, w), want[0])
    assert torch.equal(ops.linear_silu_and_mul(x, w), want[1])
    q, k, v, rope = ops.linear_rotary(x, w, None, pos, cos, sin, D, heads - 2, 1)
    assert rope is None  # rotated by the kernel
    for got, ref in zip((q, k, v), want_qkv):
        assert torch.equal(got.flatten(1), ref)


@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows_equals_the_reference(exact_e4m3, interpreted, static):
    """The one-launch activation quantization before _scaled_mm: the same e4m3 bytes and
    scales as quant.quantize (per token) or quant.quantize_with (the static scale, which
    clips), over a width that is not a power of two and an all-zero token."""
    from raygraph.model.quant import quantize_with

    ops_kernels = interpreted("triton_ops")
    torch.manual_seed(0)
    x = (torch.randn(5, 300) * torch.logspace(-2, 1, 5).view(-1, 1)).to(DT)
    x[2] = 0
    if static:
        scale = torch.tensor([2.0 / 448])
        want_q, want_s = quantize_with(x, scale, 1), scale.expand(5, 1)
    else:
        scale = None
        want_q, want_s = quantize(x, 300)
    q, s = ops_kernels.quantize_rows(x, scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


@pytest.mark.parametrize("pieces", [False, True])
def test_norms_and_swiglu_store_their_rows_quantized(exact_e4m3, interpreted, monkeypatch,
                                                     pieces):
    """rms_norm, add_rms_norm and silu_and_mul asked to quantize (their output feeds an FP8
    GEMM): the output is unchanged, and the e4m3 rows and scales equal quantize_rows of it,
    byte for byte (a width that is not a power of two, an all-zero row, a 1100-wide SwiGLU
    row whole or in pieces of 1024)."""
    k_ops = interpreted("triton_ops")
    monkeypatch.setattr(k_ops, "SILU_PIECES_FROM", 1 if pieces else 1 << 30)
    monkeypatch.setattr(k_ops, "WHOLE_ROW", 1024 if pieces else 1 << 30)
    torch.manual_seed(5)
    x, r = (torch.randn(2, 6, 300) * torch.logspace(-2, 1, 6).view(-1, 1)).to(DT)
    x[3], r[3] = 0, 0
    w = (torch.rand(300) + 0.5).to(DT)
    gu = torch.randn(4, 2 * 1100).to(DT)
    runs = [(k_ops.rms_norm(x, w, 1e-6, True), k_ops.rms_norm(x, w, 1e-6)[0]),
            (k_ops.add_rms_norm(x, r, w, 1e-6, True)[::2],
             k_ops.add_rms_norm(x, r, w, 1e-6)[0]),
            (k_ops.silu_and_mul(gu, True), k_ops.silu_and_mul(gu)[0])]
    # kept only in e4m3 (their GEMM reads nothing else): a stand-in for the rows
    only = [k_ops.rms_norm(x, w, 1e-6, True, keep=False),
            k_ops.add_rms_norm(x, r, w, 1e-6, True, keep=False)[::2],
            k_ops.silu_and_mul(gu, True, keep=False)]
    for ((out, (q, s)), plain), (stand_in, (q_only, s_only)) in zip(runs, only):
        assert torch.equal(out, plain)
        want_q, want_s = k_ops.quantize_rows(out.reshape(-1, out.shape[-1]))
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s, want_s)
        assert torch.equal(q_only.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s_only, want_s)
        assert stand_in.shape == out.shape and set(stand_in.stride()) == {0}
    assert torch.equal(k_ops.add_rms_norm(x, r, w, 1e-6, True, keep=False)[1],
                       k_ops.add_rms_norm(x, r, w, 1e-6)[1])  # the residual sum, kept
    with pytest.raises(ValueError, match="stores nothing"):
        k_ops.silu_and_mul(gu, False, keep=False)


def test_a_gemm_that_cannot_take_rows_kept_only_in_e4m3_refuses_them():
    """A fused op that stored its result only in e4m3 returns a stand-in for it: a GEMM
    that would read the stand-in (here on the CPU, where _scaled_mm does not apply) raises
    instead of multiplying garbage; a real tensor still goes through."""
    w = fp8_weight(64, K, "dynamic", seed=3)
    x = tokens(32, 3)
    q, s = quantize(x.float(), K)
    stand_in = torch.empty(1, dtype=x.dtype).expand(x.shape)
    setattr(stand_in, fp8_rows.QUANTIZED, (q, s))
    with pytest.raises(RuntimeError, match="stored only in e4m3"):
        ops.linear(stand_in, w)
    assert ops.linear(x, w).shape == (32, 64)


@pytest.mark.parametrize("m, n, bias, group", [(1, 128, False, K), (17, 128, True, K),
                                               (70, 256, False, K), (17, 128, True, 128),
                                               (70, 256, False, 64), (130, 256, True, 128),
                                               (150, 256, True, K)])
def test_w8a8_gemm_kernel_equals_its_math(interpreted, m, n, bias, group):
    """The Triton W8A8 GEMM (rows past the decode kernels): x already e4m3 with a scale a
    row, W e4m3 with a scale a row (group = K), or both with a scale a row and `group`
    columns (block weights; the K tiles are the groups). Row tiles of 64 (so 70 rows are
    two, the second masked): equal to (xq * x_scale) @ (Wq * w_scale)^T in float32 (every
    product of two e4m3 values is exact there; sums in another order), then rounded once to
    the output dtype, bias added after as _scaled_mm's caller adds it. Each case runs its
    own tiles (m <= 64: 32 columns; 130 rows with groups: 128; 150 rows a scale a row: 128
    through TMA), 64-column tiles and 128-column TMA tiles (pointer loads for groups)."""
    g = interpreted("triton_fp8_gemm")
    torch.manual_seed(m + n)
    w = fp8_weight(n, group, "dynamic", seed=n)
    xq, xs = quantize(tokens(m, m).float(), group)
    b = torch.randn(n).to(DT) if bias else None
    want = dequantize(xq, xs, group) @ w.dequantize(torch.float32).t()
    for dtype, cfg in [(torch.float32, None), (DT, None), (DT, g.Fp8GemmConfig(64, 64, 128, 4, 6)),
                       (DT, g.Fp8GemmConfig(64, 128, 128, 4, 4, tma=True))]:
        got = g.fp8_gemm(xq, xs, w.data, w.scale, dtype, b, cfg)
        assert got.shape == (m, n) and got.dtype == dtype
        expect = want.to(dtype)
        if b is not None:
            expect = (expect.float() + b.float()).to(dtype)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), expect.float(), rtol=ULPS * eps,
                                   atol=ULPS * eps * want.abs().max().item())


def test_w8a8_gemm_tiles_and_where_it_serves():
    """Up to 64 rows, columns a program so an 8B GEMM has ~100-220 programs; more rows, 64.
    cuBLASLt keeps what its full tiles do at least as fast (gate|up past 64 rows, anything
    past 256) and what the kernel cannot tile."""
    from raygraph.model.triton_fp8_gemm import config, preferred

    assert [config(64, n, 4096).block_n for n in (4096, 6144, 28672)] == [32, 64, 128]
    assert config(128, 4096, 14336) == (64, 64, 128, 4, 6, False)
    # past 128 rows through TMA: six stages while the programs fit one an SM, else four
    assert config(256, 4096, 14336) == (64, 128, 128, 4, 6, True)
    assert config(256, 6144, 4096) == (64, 128, 128, 4, 4, True)
    assert config(256, 4096, 14336, sms=100).num_stages == 4
    # scales per group: 128 columns past 128 rows, or past 64 on wide weights
    assert config(256, 4096, 14336, grouped=True) == (64, 128, 128, 4, 4, False)
    assert [config(128, n, 4096, grouped=True).block_n for n in (4096, 28672)] == [64, 128]
    assert config(64, 28672, 4096, grouped=True) == config(64, 28672, 4096)
    assert config(16, 28672, 4096).num_stages == 4
    assert preferred(17, 28672, 4096) and preferred(64, 28672, 4096)
    assert not preferred(65, 28672, 4096) and preferred(128, 6144, 4096)
    assert preferred(256, 4096, 14336) and preferred(256, 6144, 4096)
    assert not preferred(256, 28672, 4096) and not preferred(128, 28672, 4096)
    assert preferred(129, 28672, 4096) and preferred(192, 28672, 4096)
    assert not preferred(257, 4096, 4096) and not preferred(32, 4160, 4096)
    # without TMA, the pointer-load tiles' range
    assert not preferred(160, 28672, 4096, tma=False) and not preferred(256, 6144, 4096, tma=False)
    assert preferred(128, 6144, 4096, tma=False) and preferred(256, 4096, 14336, tma=False)


def test_ops_run_block_weights_past_the_decode_rows_through_the_block_gemm(
        exact_e4m3, interpreted, monkeypatch):
    """Past the decode rows on the kernels' device, a weight with a scale a row and 128
    columns meets x quantized per token and group in the Triton GEMM, without a dequantized
    copy of the weight: the reference path's math (x rounded to e4m3 per group, times the
    dequantized weight) within the output's rounding. x's groups are quantized as rows of
    the one-launch kernel."""
    interpreted("triton_fp8_gemm")
    x = tokens(20, 7)
    w = fp8_weight(256, 128, "dynamic", 8)
    bias = torch.randn(256).to(DT)
    xq, xs = quantize(x.float(), 128)
    want = dequantize(xq, xs, 128) @ w.dequantize(torch.float32).t()
    want_bias = (want.to(DT).float() + bias.float())

    def no_copy(*args, **kwargs):
        raise AssertionError("the FP8 weight was dequantized")

    monkeypatch.setattr(Fp8Weight, "dequantize", no_copy)
    monkeypatch.setattr(ops, "kernels", lambda t: True)
    check(ops.linear(x, w), want)
    check(ops.linear(x, w, bias), want_bias)
    static = Fp8Weight(w.data, w.scale, w.group, "static", torch.tensor([0.01]))
    with pytest.raises(AssertionError, match="dequantized"):  # not this kernel's scheme
        ops.linear(x, static)


def test_w8a8_gemm_reads_through_pointer_loads_where_tma_cannot(interpreted, monkeypatch):
    """TMA reads rows from 16-byte aligned addresses only, and only Hopper and later have it:
    x rows that start elsewhere go through the pointer-load kernel at the same tiles, with the
    same result within the output's rounding (two kernels); a GPU without it takes the
    pointer-load tiles (64 x 64: six stages of 64 x 128 would not fit Ada's shared memory)."""
    g = interpreted("triton_fp8_gemm")
    w = fp8_weight(128, K, "dynamic", seed=3)
    xq, xs = quantize(tokens(150, 5).float(), K)
    shifted = torch.empty(xq.numel() + 1, dtype=xq.dtype)[1:].view(xq.shape)
    shifted.copy_(xq)
    launched = []
    for name in ("_fp8_gemm_kernel", "_fp8_gemm_tma_kernel"):
        kernel = getattr(g, name)
        monkeypatch.setattr(g, name, _Recorded(kernel, name, launched))
    aligned = g.fp8_gemm(xq, xs, w.data, w.scale, DT)
    unaligned = g.fp8_gemm(shifted, xs, w.data, w.scale, DT)
    monkeypatch.setattr(g, "has_tma", lambda device: False)
    no_tma = g.fp8_gemm(xq, xs, w.data, w.scale, DT)
    assert launched == ["_fp8_gemm_tma_kernel", "_fp8_gemm_kernel", "_fp8_gemm_kernel"]
    check(unaligned, aligned.float())
    check(no_tma, aligned.float())
    assert g.config(150, 128, K, tma=False) == (64, 64, 128, 4, 6, False)


class _Recorded:
    """A Triton kernel whose launches are noted by name."""

    def __init__(self, kernel, name: str, launched: list) -> None:
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


def test_w8a8_gemm_refuses_what_it_cannot_tile(interpreted):
    """Tiles that do not divide the weight, or strided rows, are an error, not columns
    silently left unwritten."""
    g = interpreted("triton_fp8_gemm")
    w = fp8_weight(192, K, "dynamic", seed=1)
    xq, xs = quantize(tokens(3, 3).float(), K)
    with pytest.raises(ValueError, match="does not tile"):
        g.fp8_gemm(xq, xs, w.data, w.scale, DT, cfg=g.Fp8GemmConfig(64, 128, 128, 4, 4))
    with pytest.raises(ValueError, match="unit stride"):
        g.fp8_gemm(xq.t().contiguous().t(), xs, w.data, w.scale, DT)
    blocks = fp8_weight(192, 128, "dynamic", seed=2)
    with pytest.raises(ValueError, match="not the kernel's K tiles"):  # x scaled per token
        g.fp8_gemm(xq, xs, blocks.data, blocks.scale, DT)


@pytest.mark.parametrize("preset", ["llama3-8b", "llama3-70b", "qwen2.5-7b", "qwen3-8b",
                                    "llama-1b"])
def test_skinny_tiles_divide_every_shard_of_the_presets(preset):
    """Every tile the skinny kernels pick for a preset's decode GEMMs, at TP 1 to 8, in bf16
    and FP8: K runs that divide K (the tensor-core kernel loads K unmasked: a run past the
    end reads another row's bytes or faults; the row kernel masks a last run past K), whole
    rotation pairs, gate|up widths that split into whole column runs."""
    gemv = pytest.importorskip("raygraph.model.triton_gemv", reason="needs triton")
    from bench.checkpoints import PRESETS

    c = PRESETS[preset]
    h, heads, kv, inter = (c["hidden_size"], c["num_attention_heads"],
                           c["num_key_value_heads"], c["intermediate_size"])
    d = h // heads
    for tp in (1, 2, 4, 8):
        # a rank's q heads, and its KV heads (replicated past the model's count)
        shapes = {"qkv": ((heads // tp + 2 * max(kv // tp, 1)) * d, h),
                  "o": (h, heads * d // tp), "gate_up": (inter // tp, h),
                  "down": (h, inter // tp)}
        for (name, (n, k)), fp8, rows in itertools.product(shapes.items(), (False, True),
                                                            (1, 8)):
            if k % 128:
                continue  # not the skinny kernels' (ops sends it to cuBLAS)
            if rows == 1:
                cfg = gemv.row_config(n, k, fp8)
            elif name == "qkv":
                cfg = gemv.rotary_config(n, k, d, fp8)
            elif name == "gate_up":
                cfg = gemv.silu_mul_config(n, k, fp8)
            else:
                cfg = gemv.default_config(n, k, fp8)
            where = f"{preset} TP={tp} {name} [{n}, {k}] fp8={fp8} rows={rows}: {cfg}"
            if rows == 1:  # the row kernel masks a last run past K
                assert cfg.block_k >= 128 and cfg.block_k & (cfg.block_k - 1) == 0, where
            else:
                assert k % cfg.block_k == 0, where
            if name == "gate_up":
                assert n % cfg.block_n == 0, where
            if name == "qkv":
                assert (d // 2) % (cfg.block_n // 2) == 0, where


@pytest.mark.parametrize("group", [K, 128])
def test_the_float16_dot_meets_e4m3_with_x_clamped_to_float16(exact_e4m3, monkeypatch, group):
    """The tensor-core kernel's float16 dot (served for gate|up on bfloat16 x, which the
    interpreter lacks, so forced here on float32 x): x rounded to float16 and clamped to
    its range (a value past 65504 becomes 65504, not inf), e4m3 widened exactly; the
    output as the float32 product of those operands, within float16 rounding."""
    gemv = exact_e4m3
    monkeypatch.setattr(gemv, "_f16_dot", lambda *args: True)
    x = tokens(3, 5).float()
    x[1, 7] = 1e6  # past float16's range
    gu = fp8_weight(2 * 64, group, "none", 11)
    want = ops.silu_and_mul(F.linear(x.clamp(-65504, 65504).half().float(),
                                     gu.dequantize(torch.float32)))
    got = gemv.gemv_silu_mul(x, gu)
    for rows in ([0, 2], [1]):  # each its own scale: the clamped row's dwarfs the others
        check(got[rows], want[rows])
    monkeypatch.setattr(gemv, "_f16_dot", lambda *args: False)  # x kept whole: not equal
    assert not torch.allclose(gemv.gemv_silu_mul(x, gu)[1], want[1], rtol=1e-3)


def test_gate_up_stores_float16_rows_computed_in_xs_dtype(exact_e4m3) -> None:
    """half=True (gate|up feeding an FP8 down at decode rows): the rows computed as in x's
    dtype, then stored in float16 clamped to its range (65504, not inf); a GEMM given
    another activation dtype (`act`) rounds its result to that one."""
    gemv = exact_e4m3
    x = tokens(3, 5).float()
    x[1, 7] = 1e4  # gate and up past float16's range on row 1
    gu = fp8_weight(2 * 64, K, "none", 11)
    whole = gemv.gemv_silu_mul(x, gu)
    half = gemv.gemv_silu_mul(x, gu, half=True)
    assert half.dtype == torch.float16 and whole.abs().max() > 65504
    assert torch.equal(half, whole.clamp(-65504, 65504).half())
    x16 = tokens(3, 6)
    w = fp8_weight(64, K, "none", 12)
    wide = gemv.gemv(x16, w, act=torch.float32)
    assert wide.dtype == torch.float32 and not torch.equal(wide, wide.half().float())
    assert torch.equal(wide.half(), gemv.gemv(x16, w))


def test_norms_store_float16_rows_computed_in_the_activation_dtype(interpreted) -> None:
    """half=True (a norm feeding an FP8 GEMM at decode rows): the normed rows computed as
    in the activation dtype (here float32: the interpreter has no bfloat16), then stored in
    float16 clamped to its range (65504, not inf), NaN kept; the residual sum unchanged."""
    k_ops = interpreted("triton_ops")
    torch.manual_seed(3)
    x, r = torch.randn(2, 4, 96)
    w = torch.rand(96) + 0.5
    w[7] = 1e6  # column 7 past float16's range on every row
    x[2, 5] = float("nan")
    whole = k_ops.rms_norm(x, w, 1e-6)[0]
    half = k_ops.rms_norm(x, w, 1e-6, half=True)[0]
    assert half.dtype == torch.float16 and whole.abs().nan_to_num().max() > 65504
    assert not torch.equal(whole, whole.half().float())  # float32 rows: not float16's
    torch.testing.assert_close(half, whole.clamp(-65504, 65504).half(), rtol=0, atol=0,
                               equal_nan=True)
    got, total, _ = k_ops.add_rms_norm(x, r, w, 1e-6, half=True)
    want, want_total, _ = k_ops.add_rms_norm(x, r, w, 1e-6)
    assert got.dtype == torch.float16 and total.dtype == torch.float32
    torch.testing.assert_close(total, want_total, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, want.clamp(-65504, 65504).half(), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("group", [K, 128])
def test_gemms_compute_float16_rows_in_the_dtype_they_stand_for(exact_e4m3, group) -> None:
    """`act`: float16 x standing for another dtype's rows (here float32) gives that dtype,
    computed in it (the plain, rotary and silu*mul epilogues round to `act`, not to x's
    float16), the same as x widened to it; gate|up with half=True stores float16 rows from
    it. One row (the row kernel) takes no such rows."""
    gemv = exact_e4m3
    x16 = tokens(3, 8)
    x32 = x16.float()
    w, gu = fp8_weight(HQ * D + 2 * HK * D, group, "none", 14), fp8_weight(2 * 64, group,
                                                                           "none", 15)
    cos, sin = rope_tables(D, 64, 10000.0)
    pos = torch.tensor([3, 9, 60])
    for run in (lambda x, **a: gemv.gemv(x, w, **a),
                lambda x, **a: gemv.gemv_rotary(x, w, None, pos, cos, sin, D, HQ + HK, **a),
                lambda x, **a: gemv.gemv_silu_mul(x, gu, **a)):
        got, want = run(x16, act=torch.float32), run(x32)
        assert got.dtype == torch.float32 and not torch.equal(got, got.half().float())
        check(got, want)
    half = gemv.gemv_silu_mul(x16, gu, half=True, act=torch.float32)
    assert half.dtype == torch.float16
    assert torch.equal(half, gemv.gemv_silu_mul(x16, gu, act=torch.float32).half())
    with pytest.raises(ValueError, match="tensor-core"):
        gemv.gemv(x16[:1], w, act=torch.float32)


@pytest.mark.parametrize("group", [K, 128])
def test_float16_rows_standing_for_another_dtype_give_it(group) -> None:
    """Rows marked STANDS_FOR that a GEMM other than the skinny FP8 kernel takes (here: any,
    on the CPU) go back to the dtype they stand for, exactly, and so does the result."""
    x = tokens(4, 7).to(torch.bfloat16).half().to(torch.bfloat16)  # values both dtypes hold
    h = x.half()
    assert torch.equal(h.to(torch.bfloat16), x)
    setattr(h, fp8_rows.STANDS_FOR, torch.bfloat16)
    for w in (fp8_weight(64, group, "dynamic", 13), torch.randn(64, K, dtype=torch.bfloat16)):
        got, want = ops.linear(h, w), ops.linear(x, w)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        got, want = ops.linear_silu_and_mul(h, w), ops.linear_silu_and_mul(x, w)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    w = fp8_weight(HQ * D + 2 * HK * D, group, "dynamic", 16)
    cos, sin = rope_tables(D, 64, 10000.0)
    pos = torch.tensor([1, 5, 8, 40])
    got = ops.linear_rotary(h, w, None, pos, cos, sin, D, HQ, HK)
    want = ops.linear_rotary(x, w, None, pos, cos, sin, D, HQ, HK)
    for a, b in zip(got[:3], want[:3]):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_float16_rows_only_for_an_fp8_gemm_the_skinny_kernels_take() -> None:
    """fp8_rows.halves_for: 2 to DECODE_ROWS rows of bfloat16 activations (the rows' own
    dtype, or the one float16 rows stand for: act_dtype) feeding an FP8 GEMM whose K and
    scale groups the skinny kernels take; anything else keeps its dtype. No triton needed:
    the CPU path asks it too."""
    from raygraph.model.quant import DECODE_ROWS, Fp8Layout

    halves_for, bf16 = fp8_rows.halves_for, torch.bfloat16
    assert halves_for(4, bf16, Fp8Layout(2048, "dynamic"), 2048)  # one scale a row
    assert halves_for(4, bf16, Fp8Layout(128, "none"), 2048)  # a scale a row and 128 columns
    assert halves_for(2, bf16, Fp8Layout(2048, "dynamic"), 2048)
    assert halves_for(DECODE_ROWS, bf16, Fp8Layout(2048, "dynamic"), 2048)
    marked = torch.zeros(4, 64, dtype=torch.float16)
    assert fp8_rows.act_dtype(marked) == torch.float16
    setattr(marked, fp8_rows.STANDS_FOR, bf16)
    assert fp8_rows.act_dtype(marked) == bf16
    for rows, act, layout, k in [(1, bf16, Fp8Layout(2048, "dynamic"), 2048),  # the row kernel's
                                 (DECODE_ROWS + 1, bf16, Fp8Layout(2048, "dynamic"), 2048),
                                 (4, torch.float32, Fp8Layout(2048, "dynamic"), 2048),
                                 (4, torch.float16, Fp8Layout(2048, "dynamic"), 2048),
                                 (4, bf16, None, 2048),  # not an FP8 GEMM
                                 (4, bf16, Fp8Layout(2240, "dynamic"), 2240),  # K % 128
                                 (4, bf16, Fp8Layout(96, "dynamic"), 2016)]:  # groups not 2^n
        assert not halves_for(rows, act, layout, k), (rows, act, layout, k)
