"""GPU: FP8 linear layers. The W8A8 GEMMs past the decode rows (Triton's or
torch._scaled_mm, per-channel) against the float32 reference path; decode rows (the FP8
weight streamed by the skinny kernels, never dequantized); both inside a captured graph;
and a whole FP8 checkpoint's logits on the GPU against the CPU's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from raygraph.config import ModelConfig
from raygraph.graph.inputs import prepare_batch
from raygraph.model import fp8_rows, ops
from raygraph.model.context import forward_context
from raygraph.model.loader import build_model
from raygraph.model.parallel import Comm
from raygraph.model.quant import (
    DECODE_ROWS,
    Fp8Layout,
    Fp8Weight,
    activations_as_quantized,
    quantize,
)
from raygraph.protocol import SeqChunk, StepPlan
from tests.fp8_checkpoints import FORMATS, write_fp8

pytestmark = pytest.mark.gpu
E4M3_U = 2.0**-4  # e4m3's unit roundoff
BF16_EPS = torch.finfo(torch.bfloat16).eps


def weight(n: int, k: int, activations: str, x_amax: float = 4.0, group: int = 0
           ) -> Fp8Weight:
    """Random rows quantized per row (group 0) or per row and `group` columns."""
    w = torch.randn(n, k, device="cuda")
    group = group or k
    data, scale = quantize(w, group)
    s = torch.tensor([x_amax / 448], device="cuda")
    return Fp8Weight(data, scale, group, activations, s if activations == "static" else None)


def reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path's math in float32: x quantized as the GEMM sees it, times dequantized W."""
    x32 = x.float()
    return F.linear(activations_as_quantized(x32, w), w.dequantize(torch.float32),
                    None if bias is None else bias.float())


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("rows", [DECODE_ROWS + 1, 64, 200, 300])
@pytest.mark.parametrize("n, k", [(256, 512), (768, 256), (4096, 1024)])
def test_w8a8_gemms_match_the_reference_path(activations, rows, n, k) -> None:
    """Past the decode rows: the Triton FP8 GEMM (up to 256 rows of these widths) or
    _scaled_mm (300 rows), both against the float32 math."""
    from raygraph.model.triton_fp8_gemm import preferred

    torch.manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w, bias = weight(n, k, activations), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert preferred(rows, n, k) == (rows <= 256)
    got = ops.fp8_gemm(x, w, bias)
    assert got is not None and got.dtype == torch.bfloat16  # a W8A8 GEMM took it
    want = reference(x, w, bias)
    # float32 accumulation in both; the output rounded to bf16 once (+ the bias add)
    torch.testing.assert_close(got.float(), want, rtol=2 * BF16_EPS,
                               atol=2 * BF16_EPS * want.abs().max().item())


@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows_equals_torchs(static) -> None:
    """The one-launch activation quantization: the e4m3 bytes and scales torch's ops give."""
    from raygraph.model.quant import quantize_with
    from raygraph.model.triton_ops import quantize_rows

    torch.manual_seed(3)
    x = torch.randn(300, 14336, device="cuda", dtype=torch.bfloat16)
    x[7] = 0
    scale = torch.tensor([2.0 / 448], device="cuda") if static else None
    q, s = quantize_rows(x, scale)
    want_q, want_s = ((quantize_with(x, scale, 1), scale.expand(300, 1)) if static
                      else quantize(x, x.shape[1]))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


def pieces(monkeypatch: pytest.MonkeyPatch, gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU of gu feeding an FP8 GEMM, each row taken in pieces (WHOLE_ROW below it)."""
    from raygraph.model import triton_ops

    with monkeypatch.context() as m:
        m.setattr(triton_ops, "WHOLE_ROW", 1024)
        return ops.silu_and_mul(gu, Fp8Layout(gu.shape[1] // 2, "dynamic"))


def test_norms_and_swiglu_feeding_an_fp8_gemm_quantize_their_rows(monkeypatch) -> None:
    """An add_rms_norm or SwiGLU whose result feeds a dynamic FP8 GEMM stores it in e4m3
    only (the result is a stand-in: the GEMM reads nothing else), and the GEMM takes those
    rows (it launches no quantization of its own): its output equals the one from the
    kernel's rows kept in bf16 and quantized by the GEMM itself, bit for bit; fewer rows
    than the W8A8 GEMMs take, the rows are kept and nothing is attached. SwiGLU at 64 rows
    and at 1,100 (a whole row a program, then, with WHOLE_ROW below its width, each row in
    pieces)."""
    from raygraph.model import triton_ops
    from raygraph.model.triton_ops import SILU_PIECES_FROM, quantize_rows

    torch.manual_seed(11)
    x, r = torch.randn(2, 64, 1024, device="cuda", dtype=torch.bfloat16)
    nw = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5
    w1, w3 = weight(512, 1024, "dynamic"), weight(512, 3072, "dynamic")
    gu, gu3 = (torch.randn(t, 2 * k, device="cuda", dtype=torch.bfloat16)
               for t, k in ((64, 1024), (SILU_PIECES_FROM + 76, 3072)))
    layout = Fp8Layout(1024, "dynamic")  # w's: one scale a row, per-token activations
    for made, kept, w in (
            (ops.add_rms_norm(x, r, nw, 1e-6, feeds=layout)[0],
             triton_ops.add_rms_norm(x, r, nw, 1e-6)[0], w1),
            (ops.silu_and_mul(gu, layout), triton_ops.silu_and_mul(gu)[0], w1),
            (ops.silu_and_mul(gu3, Fp8Layout(3072, "dynamic")),
             triton_ops.silu_and_mul(gu3)[0], w3),
            (pieces(monkeypatch, gu3), triton_ops.silu_and_mul(gu3)[0], w3)):
        assert made.shape == kept.shape and set(made.stride()) == {0}
        q, s = getattr(made, fp8_rows.QUANTIZED)
        want_q, want_s = quantize_rows(kept)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s, want_s)
        want = ops.fp8_gemm(kept, w)  # quantized by the GEMM
        with monkeypatch.context() as m:
            m.setattr(ops, "quantize_activations", None)  # called: a TypeError
            got = ops.fp8_gemm(made, w)
        assert torch.equal(got, want)
    small = ops.add_rms_norm(x[:DECODE_ROWS], r[:DECODE_ROWS], nw, 1e-6, feeds=layout)[0]
    assert not hasattr(small, fp8_rows.QUANTIZED)
    assert torch.equal(small, triton_ops.add_rms_norm(x[:DECODE_ROWS], r[:DECODE_ROWS], nw,
                                                      1e-6)[0])


@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize("rows", [1, 4, DECODE_ROWS])
@pytest.mark.parametrize("activations", ["none", "dynamic", "static"])
def test_decode_rows_read_the_fp8_weight(monkeypatch, activations, rows, group) -> None:
    """DECODE_ROWS rows or fewer: the skinny kernels stream the e4m3 weight and its scales (no bf16
    copy is made), for plain, gate|up and q|k|v (rotary) layers."""
    from raygraph.model import triton_gemv

    torch.manual_seed(rows + group)
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    w = weight(512, 256, activations, group=group)
    assert ops.fp8_gemm(x, w) is None and triton_gemv.supports(x, w)
    want = reference(x, w)
    cos, sin = torch.randn(2, 64, 32)
    pos = torch.arange(rows) + 3
    ref = want.cpu()  # the torch rotary on CPU
    q_ref, k_ref = ops.rotary(ref[:, :384].reshape(rows, 6, 64),
                              ref[:, 384:448].reshape(rows, 1, 64), cos, sin, pos)
    cos, sin, pos = cos.cuda(), sin.cuda(), pos.cuda()

    def no_copy(*args, **kwargs):
        raise AssertionError("the FP8 weight was dequantized")

    monkeypatch.setattr(Fp8Weight, "dequantize", no_copy)
    got = ops.linear(x, w)
    both = ops.linear_silu_and_mul(x, w)
    q, k, v, rope = ops.linear_rotary(x, w, None, pos, cos, sin, 64, 6, 1)
    assert rope is None
    # float32 sums in another order, the output rounded to bf16
    torch.testing.assert_close(got.float(), want, rtol=0,
                               atol=8 * BF16_EPS * want.abs().max().item())
    gate, up = want.chunk(2, dim=-1)
    product = F.silu(gate) * up  # its error scales with its own magnitude, not gate's
    torch.testing.assert_close(both.float(), product, rtol=0,
                               atol=8 * BF16_EPS * product.abs().max().item())
    qkv_ref = torch.cat([q_ref.flatten(1), k_ref.flatten(1), ref[:, 448:]], dim=1)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    torch.testing.assert_close(qkv.float().cpu(), qkv_ref, rtol=0,
                               atol=8 * BF16_EPS * qkv_ref.abs().max().item())


@pytest.mark.parametrize("k", [3584, 8192, 12288, 18944, 28672])
def test_one_token_reads_a_row_in_one_run(k) -> None:
    """One token: an FP8 row of 2049 to ONE_RUN_FP8 columns goes in one run of the next
    power of two, its loads past K masked off (Qwen2.5-7B's 3584 and 18944, the 70B's 8192
    and 28672, Qwen3-8B's 12288), plain and gate|up (two row sets a program): equal to the
    reference within bf16 rounding."""
    from raygraph.model import triton_gemv

    torch.manual_seed(k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = weight(512, k, "none")
    assert triton_gemv.row_config(512, k, True).block_k >= k  # the whole row in one run
    want = reference(x, w)
    got = triton_gemv.gemv(x, w)
    torch.testing.assert_close(got.float(), want, rtol=0,
                               atol=8 * BF16_EPS * want.abs().max().item())
    gate, up = want.chunk(2, dim=-1)
    product = F.silu(gate) * up
    both = triton_gemv.gemv_silu_mul(x, w)
    torch.testing.assert_close(both.float(), product, rtol=0,
                               atol=8 * BF16_EPS * product.abs().max().item())


@pytest.mark.parametrize("rows", [2, DECODE_ROWS])
def test_decode_rows_take_bfloat16_x_as_float16_clamped(rows) -> None:
    """The skinny kernel meets e4m3 tiles with bfloat16 x converted to float16 as loaded (an
    asm the interpreter cannot run): every bfloat16 value of float16's range kept exactly,
    a larger one clamped to 65504. So each row equals the float32 product of
    x.clamp().half() and the dequantized weight within the output's rounding, the clamped
    rows too (an unclamped x would give inf or a 15x larger row), plain and gate|up alike."""
    from raygraph.model import triton_gemv

    torch.manual_seed(rows)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    x[0, 5], x[-1, 9] = 1e6, -3e5  # past float16's range
    w = weight(512, 1024, "none")
    want = F.linear(x.float().clamp(-65504, 65504).half().float(), w.dequantize(torch.float32))
    gate, up = want.chunk(2, dim=-1)
    for got, ref in [(triton_gemv.gemv(x, w), want),
                     (triton_gemv.gemv_silu_mul(x, w), F.silu(gate) * up)]:
        for r in range(rows):  # each row's error scales with its own magnitude
            torch.testing.assert_close(got[r].float(), ref[r], rtol=0,
                                       atol=8 * BF16_EPS * ref[r].abs().max().item())


def record_x_dtypes(monkeypatch, *names: str) -> list[torch.dtype]:
    """The dtypes of x that the triton_gemv kernels `names` are called with, in order."""
    from raygraph.model import triton_gemv

    seen = []

    def recording(kernel):
        def run(x, *args, **kwargs):
            seen.append(x.dtype)
            return kernel(x, *args, **kwargs)
        return run

    for name in names:
        monkeypatch.setattr(triton_gemv, name, recording(getattr(triton_gemv, name)))
    return seen


@pytest.mark.parametrize("rows", [1, 3, DECODE_ROWS])
def test_gate_up_feeds_an_fp8_down_float16_rows_that_change_nothing(monkeypatch, rows) -> None:
    """At 2 to DECODE_ROWS rows gate|up stores its rows in float16 for an FP8 down
    projection (fp8_rows.STANDS_FOR), which takes them as they are: the bfloat16 rows it would
    have stored, converted (past float16's range clamped, NaN kept); the down projection's
    output, in bfloat16, the one from those bfloat16 rows (its own tile: float32 sums in
    another order). One row (the row kernel) and float32 x keep their dtype."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    if rows > 1:
        x[1] *= 300  # gate and up past float16's range
    gu, down = weight(2 * 2048, 1024, "dynamic"), weight(1024, 2048, "dynamic")
    layout = Fp8Layout(2048, "dynamic")
    h = ops.linear_silu_and_mul(x, gu, layout)
    plain = ops.linear_silu_and_mul(x, gu)
    assert plain.dtype == torch.bfloat16 and plain[0].isnan().all()
    assert ops.linear_silu_and_mul(x.float(), gu, layout).dtype == torch.float32
    if rows == 1:
        assert h.dtype == torch.bfloat16 and not hasattr(h, fp8_rows.STANDS_FOR)
        return
    assert h.dtype == torch.float16 and getattr(h, fp8_rows.STANDS_FOR) == torch.bfloat16
    assert plain[1].abs().max() > 65504
    # (clamped in float32: bfloat16 rounds 65504 to 65536, past float16's range)
    torch.testing.assert_close(h, plain.float().clamp(-65504, 65504).half(), rtol=0, atol=0,
                               equal_nan=True)
    seen = record_x_dtypes(monkeypatch, "gemv")
    y, want = ops.linear(h, down), ops.linear(plain, down)
    assert seen == [torch.float16, torch.bfloat16]  # the float16 rows taken as they are
    assert y.dtype == torch.bfloat16 and y[0].isnan().all() and want[0].isnan().all()
    for r in range(1, rows):  # each row's error scales with its own magnitude
        torch.testing.assert_close(y[r], want[r], rtol=0,
                                   atol=8 * BF16_EPS * want[r].abs().max().item())


@pytest.mark.parametrize("rows", [1, 3, DECODE_ROWS])
def test_norms_feed_fp8_gemms_float16_rows_that_change_nothing(monkeypatch, rows) -> None:
    """At 2 to DECODE_ROWS rows a norm feeding an FP8 GEMM stores its rows in float16
    (fp8_rows.STANDS_FOR): the bfloat16 rows it would have stored, converted (NaN kept, past
    float16's range clamped); the residual sum stays bfloat16. q|k|v + rotary, gate|up and
    a plain GEMM take them as they are (recorded): at the same tile, exactly what the
    bfloat16 rows give (the kernels converted those to the same float16 values); as served
    (their own tiles for float16 x) within a bf16-derived tolerance. One row (the row
    kernel) and no FP8 layout keep bfloat16."""
    from raygraph.model import triton_gemv
    from raygraph.model.triton_gemv import GemvConfig

    torch.manual_seed(rows)
    x, r = torch.randn(2, rows, 1024, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5
    norm_w[7] = 3e5  # column 7 past float16's range
    x[0, 3] = float("nan")
    layout = Fp8Layout(1024, "dynamic")
    h, total = ops.add_rms_norm(x, r, norm_w, 1e-6, layout)
    plain, plain_total = ops.add_rms_norm(x, r, norm_w, 1e-6)
    alone = ops.rms_norm(total, norm_w, 1e-6, layout)
    assert plain.dtype == total.dtype == torch.bfloat16
    torch.testing.assert_close(total, plain_total, rtol=0, atol=0, equal_nan=True)
    if rows == 1:
        assert h.dtype == alone.dtype == torch.bfloat16 and not hasattr(h, fp8_rows.STANDS_FOR)
        return
    for got in (h, alone):
        assert got.dtype == torch.float16 and getattr(got, fp8_rows.STANDS_FOR) == torch.bfloat16
        # (clamped in float32: bfloat16 rounds 65504 to 65536, past float16's range)
        torch.testing.assert_close(got, plain.float().clamp(-65504, 65504).half(), rtol=0,
                                   atol=0, equal_nan=True)
    h = h.nan_to_num()  # past the NaN row: the products compared below
    setattr(h, fp8_rows.STANDS_FOR, torch.bfloat16)
    plain = plain.nan_to_num()
    qkv_w, gu = weight(6 * 128, 1024, "dynamic"), weight(2 * 2048, 1024, "dynamic")
    cos, sin = torch.randn(2, 64, 64, device="cuda")
    pos = torch.arange(rows, device="cuda") + 3
    tile, bf16 = GemvConfig(64, 256, 4, 3), torch.bfloat16
    tg = triton_gemv
    for same in [(tg.gemv(h, qkv_w, None, tile, bf16), tg.gemv(plain, qkv_w, None, tile)),
                 (tg.gemv_rotary(h, qkv_w, None, pos, cos, sin, 128, 5, tile, bf16),
                  tg.gemv_rotary(plain, qkv_w, None, pos, cos, sin, 128, 5, tile)),
                 (tg.gemv_silu_mul(h, gu, tile, True, bf16),
                  tg.gemv_silu_mul(plain, gu, tile, True))]:
        assert same[0].dtype == same[1].dtype and torch.equal(*same)
    seen = record_x_dtypes(monkeypatch, "gemv_rotary", "gemv_silu_mul")
    got = ops.linear_rotary(h, qkv_w, None, pos, cos, sin, 128, 4, 1)
    want = ops.linear_rotary(plain, qkv_w, None, pos, cos, sin, 128, 4, 1)
    down = Fp8Layout(2048, "dynamic")
    mlp, mlp_want = ops.linear_silu_and_mul(h, gu, down), ops.linear_silu_and_mul(plain, gu, down)
    assert seen == [torch.float16, torch.bfloat16] * 2  # the float16 rows taken as they are
    assert mlp.dtype == mlp_want.dtype == torch.float16 and hasattr(mlp, fp8_rows.STANDS_FOR)
    for a, b in [*zip(got[:3], want[:3]), (mlp, mlp_want)]:
        assert a.dtype == b.dtype and a.shape == b.shape
        for i in range(1, rows):  # each row's error scales with its own magnitude
            torch.testing.assert_close(a[i].float(), b[i].float(), rtol=0,
                                       atol=8 * BF16_EPS * b[i].float().abs().max().item())


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_stores_float16_rows_for_an_fp8_output_projection(splits) -> None:
    """half=True: the decode kernel's bfloat16 rows (verify chunks beside plain rows at one
    split, merged at four), stored as float16 through the asm: converted exactly, past
    float16's range clamped to 65504."""
    from raygraph.model.triton_attention import paged_decode_attention
    from tests.conftest import verify_rows_case

    a = verify_rows_case(torch.bfloat16, torch.device("cuda"), True)["args"]
    a["v_cache"][..., :3] *= 3e5  # dims 0-2 past float16's range
    a["v_new"][..., :3] *= 3e5
    caches = (a["k_cache"].clone(), a["v_cache"].clone())
    whole = paged_decode_attention(**a, scale=0.125, splits=splits)
    a["k_cache"], a["v_cache"] = caches
    half = paged_decode_attention(**a, scale=0.125, splits=splits, half=True)
    assert half.dtype == torch.float16 and whole.float().abs().max() > 65504
    # (clamped in float32: bfloat16 rounds 65504 to 65536, past float16's range)
    assert torch.equal(half, whole.float().clamp(-65504, 65504).half())


def test_attention_feeding_an_fp8_output_projection_stores_float16_rows() -> None:
    """ops.attention at decode rows, told the output projection's FP8 layout: the rows the
    projection takes, [T, Hq * D], in float16 marked as standing for bfloat16, equal to its
    rows without the layout converted (the same kernel); with a v_scale (a multiply after
    the kernel) bfloat16 as before."""
    from raygraph.model.context import ForwardContext

    torch.manual_seed(5)
    bf16, cuda = torch.bfloat16, torch.device("cuda")
    seqs = [SeqChunk(i, [1], n - 1, list(range(4 * i, 4 * i + 4)), True)
            for i, n in enumerate([9, 40, 17])]
    md = prepare_batch(StepPlan(0, seqs), 16, cuda).ctx.attn
    kc = torch.randn(13, 16, 2, 128, device=cuda, dtype=bf16)
    vc = torch.randn_like(kc)
    q = torch.randn(3, 8, 128, device=cuda, dtype=bf16)
    k, v = torch.randn(2, 3, 2, 128, device=cuda, dtype=bf16)

    def run(feeds, kv_scale=(1.0, 1.0)):
        with forward_context(ForwardContext(attn=md)):
            return ops.attention(q, k, v, kc.clone(), vc.clone(), 128**-0.5,
                                 kv_scale=kv_scale, feeds=feeds)

    layout = Fp8Layout(1024, "dynamic")
    half, plain, scaled = run(layout), run(None), run(layout, (1.0, 2.0))
    assert plain.shape == half.shape == (3, 1024) and plain.dtype == scaled.dtype == bf16
    assert not hasattr(plain, fp8_rows.STANDS_FOR) and not hasattr(scaled, fp8_rows.STANDS_FOR)
    assert half.dtype == torch.float16 and getattr(half, fp8_rows.STANDS_FOR) == bf16
    assert torch.equal(half, plain.float().clamp(-65504, 65504).half())


def test_an_fp8_models_decode_step_with_float16_rows(gpu_llama: Path, tmp_path: Path,
                                                     monkeypatch) -> None:
    """A whole FP8 model's decode step of 3 rows, with float16 rows between its ops (the
    norms', attention's, gate|up's, taken by the skinny kernels: recorded) and without
    (fp8_rows.halves_for off): logits within a bf16-derived tolerance (float16 x takes tiles
    of its own), so the same greedy tokens wherever that tolerance cannot swap them."""
    write_fp8(gpu_llama, tmp_path / "q", tmp_path / "ref", FORMATS["ct-channel-dynamic"])
    cfg = ModelConfig.from_pretrained(str(tmp_path / "q"))
    cuda = torch.device("cuda")
    model = build_model(cfg, Comm(), torch.bfloat16, cuda)
    prompts = [list(range(5, 25)), list(range(30, 63)), list(range(7, 14))]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(prompts))]

    def decode_logits() -> torch.Tensor:
        for layer in model.attention_layers():
            shape = (13, 16, cfg.num_kv_heads, cfg.head_dim)
            layer.k_cache = torch.zeros(shape, device=cuda, dtype=torch.bfloat16)
            layer.v_cache = torch.zeros(shape, device=cuda, dtype=torch.bfloat16)
        prefill = [SeqChunk(i, p, 0, t, True) for i, (p, t) in enumerate(zip(prompts, tables))]
        decode = [SeqChunk(i, [p[-1] + 1], len(p), t, True)
                  for i, (p, t) in enumerate(zip(prompts, tables))]
        for step, seqs in enumerate([prefill, decode]):
            batch = prepare_batch(StepPlan(step, seqs), 16, cuda)
            with torch.no_grad(), forward_context(batch.ctx):
                hidden = model(batch.input_ids, batch.positions)
        return model.compute_logits(hidden).float()

    seen = record_x_dtypes(monkeypatch, "gemv", "gemv_rotary", "gemv_silu_mul")
    halves = decode_logits()
    assert torch.float16 in seen
    monkeypatch.setattr(ops, "halves_for", lambda *args: False)
    seen.clear()
    plain = decode_logits()
    assert seen and torch.float16 not in seen
    atol = 8 * BF16_EPS * plain.abs().max().item()
    torch.testing.assert_close(halves, plain, rtol=0, atol=atol)
    # the same greedy token wherever the tolerance cannot swap the top two (other tiles)
    top2 = plain.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * atol
    assert torch.equal(halves.argmax(-1)[clear], plain.argmax(-1)[clear])


@pytest.mark.parametrize("rows", [1, 4, 32, 200, 300])
def test_fp8_linears_capture_and_replay(rows) -> None:
    """No host sync on either path: replay gives the eager result bitwise."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    w = weight(512, 256, "dynamic")
    eager = ops.linear(x, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.linear(x, w)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def prefill_logits(model: torch.nn.Module, prompt: list[int], device: torch.device
                   ) -> torch.Tensor:
    cfg, block = model.config, 16
    blocks = -(-len(prompt) // block)
    dtype = next(model.parameters()).dtype if device.type == "cpu" else torch.bfloat16
    for layer in model.attention_layers():
        shape = (blocks + 1, block, cfg.num_kv_heads, cfg.head_dim)
        layer.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        layer.v_cache = torch.zeros(shape, device=device, dtype=dtype)
    batch = prepare_batch(StepPlan(0, [SeqChunk(0, prompt, 0, list(range(blocks)), False)]),
                          block, device)
    with torch.no_grad(), forward_context(batch.ctx):
        return model.compute_logits(model(batch.input_ids, batch.positions)).float().cpu()


@pytest.mark.parametrize("name", ["ct-channel-dynamic", "ct-tensor-static", "fp8-block",
                                  "ct-channel-w8a16"])
def test_fp8_checkpoint_logits_on_gpu_match_the_cpu(gpu_llama: Path, tmp_path: Path,
                                                    name: str) -> None:
    """The same FP8 model in bf16 on the GPU (_scaled_mm where it applies) and in float32 on
    the CPU: its activations round to e4m3 from bf16 or from float32 values, so a few land
    a step apart: within e4m3's precision, as the CPU tests hold W8A8 to its reference."""
    write_fp8(gpu_llama, tmp_path / "q", tmp_path / "ref", FORMATS[name])
    cfg = ModelConfig.from_pretrained(str(tmp_path / "q"))
    prompt = list(range(5, 45))
    cpu = prefill_logits(build_model(cfg, Comm(), torch.float32, torch.device("cpu")), prompt,
                         torch.device("cpu"))
    gpu = prefill_logits(build_model(cfg, Comm(), torch.bfloat16, torch.device("cuda")),
                         prompt, torch.device("cuda"))
    err = gpu - cpu
    assert err.pow(2).mean().sqrt() <= E4M3_U * cpu.pow(2).mean().sqrt()
    assert err.abs().max() <= 2 * E4M3_U * cpu.abs().max()
