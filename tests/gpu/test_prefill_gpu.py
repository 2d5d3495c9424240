"""GPU: the Triton prefill kernel against the torch reference (random lengths, cached
prefixes, chunk boundaries, padding rows, GQA ratios, head sizes, bf16/fp16, a sliding
window), and inside a captured graph across compositions of one bucket."""

from __future__ import annotations

import random

import pytest
import torch

from raygraph.graph.inputs import prepare_batch
from raygraph.model.ops import paged_attention_ref
from raygraph.protocol import SeqChunk, StepPlan
from tests.test_triton_interpret import packed_chunks

pytestmark = pytest.mark.gpu
BS = 16


def chunks(rng: random.Random, num_seqs: int, max_q: int, max_prefix: int, blocks: int
           ) -> list[SeqChunk]:
    """Sequences with a cached prefix and a chunk of new queries, on shuffled blocks."""
    perm = list(range(blocks))
    rng.shuffle(perm)
    seqs, used = [], 0
    for i in range(num_seqs):
        n, ctx = rng.randrange(1, max_q + 1), rng.randrange(0, max_prefix + 1)
        nb = -(-(ctx + n) // BS)
        seqs.append(SeqChunk(i, [1] * n, ctx, perm[used: used + nb], True))
        used += nb
    return seqs


def tolerance(dtype: torch.dtype) -> dict:
    # a handful of the dtype's epsilons on O(1) outputs: a few roundings of p and of the sums
    eps = torch.finfo(dtype).eps
    return dict(atol=8 * eps, rtol=8 * eps)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_kernel_matches_reference(head_dim, group, dtype):
    from raygraph.model.triton_attention import paged_prefill_attention

    rng = random.Random(head_dim * 100 + group)
    torch.manual_seed(head_dim + group)
    hkv, blocks = 2, 1024
    for trial in range(3):
        seqs = chunks(rng, rng.randrange(1, 9), [1, 40, 300][trial], [0, 70, 900][trial],
                      blocks)
        real = sum(len(s.token_ids) for s in seqs)
        padded = real + rng.randrange(0, 300)  # a bucket's padding rows
        kc = torch.randn(blocks + 1, BS, hkv, head_dim, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        md = prepare_batch(StepPlan(0, seqs), BS, torch.device("cuda")).ctx.attn
        q = torch.randn(padded, hkv * group, head_dim, device="cuda", dtype=dtype)
        scale = head_dim**-0.5
        ref = paged_attention_ref(q[:real], kc, vc, md, scale)
        out = torch.full_like(q, float("nan"))  # every row must be written
        got = paged_prefill_attention(q, kc, vc, md.block_tables, md.seq_lens, md.query_start,
                                      scale, out=out)
        torch.testing.assert_close(got[:real].float(), ref.float(), **tolerance(dtype))
        assert (got[real:] == 0).all()  # padding rows


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [0, 200])
@pytest.mark.parametrize("d", [128, 80])
def test_a_mixed_step_splits_its_decode_rows_off(cache_dtype, window, d):
    """ops.paged_attention on a step that is not all decode: the leading one-token
    sequences through the decode kernel (long key runs split over programs), the rest
    through the prefill kernel, which leaves those rows; equal to the reference over the
    same cache (an FP8 cache read as the kernels widen it). 80-wide heads, which the
    decode kernel does not take: all through the prefill kernel."""
    from raygraph.model import ops

    rng = random.Random(5)
    torch.manual_seed(5)
    hkv, group = 8, 4
    lens = [(1, 1499)] * 40 + [(300, 600), (1, 33), (700, 0)]
    blocks = sum(-(-(n + ctx) // BS) for n, ctx in lens)
    seqs = packed_chunks(lens, blocks, rng)
    md = prepare_batch(StepPlan(0, seqs), BS, torch.device("cuda")).ctx.attn
    real = md.num_tokens
    assert (ops.decode_rows(md) > 0).sum().item() == 40
    kc = torch.randn(blocks + 1, BS, hkv, d, device="cuda").to(cache_dtype)
    vc = torch.randn(blocks + 1, BS, hkv, d, device="cuda").to(cache_dtype)
    q, k, v = torch.randn(3, real, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    k, v = k[:, :hkv].contiguous(), v[:, :hkv].contiguous()
    ref_k, ref_v = kc.clone(), vc.clone()
    ops.store_kv(k, v, ref_k, ref_v, md.slot_mapping)
    wide = (torch.float16 if cache_dtype == torch.float8_e4m3fn else torch.bfloat16)
    ref = paged_attention_ref(q.to(wide) if wide != q.dtype else q, ref_k.to(wide),
                              ref_v.to(wide), md, d**-0.5, window)
    got = ops.paged_attention(q, k, v, kc, vc, d**-0.5, md, window=window)
    torch.testing.assert_close(got.float(), ref.float(), **tolerance(torch.bfloat16))


def test_prefill_kernel_sliding_window():
    """window w: query at position p sees keys p-w+1..p, as a dense masked softmax does."""
    from raygraph.model.triton_attention import paged_prefill_attention

    rng = random.Random(5)
    torch.manual_seed(5)
    d, hkv, group, blocks, window = 128, 2, 4, 256, 37
    seqs = chunks(rng, 5, 200, 300, blocks)
    kc = torch.randn(blocks + 1, BS, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    md = prepare_batch(StepPlan(0, seqs), BS, torch.device("cuda")).ctx.attn
    q = torch.randn(md.num_tokens, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    got = paged_prefill_attention(q, kc, vc, md.block_tables, md.seq_lens, md.query_start,
                                  d**-0.5, window=window)
    row = 0
    for s in seqs:
        n, length = len(s.token_ids), s.start_pos + len(s.token_ids)
        slots = [s.block_table[p // BS] * BS + p % BS for p in range(length)]
        k = kc.view(-1, hkv, d)[slots].float().repeat_interleave(group, 1)  # [L, Hq, D]
        v = vc.view(-1, hkv, d)[slots].float().repeat_interleave(group, 1)
        qs = q[row: row + n].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * d**-0.5
        qpos = torch.arange(s.start_pos, length, device="cuda").view(-1, 1)
        keys = torch.arange(length, device="cuda").view(1, -1)
        scores = scores.masked_fill(~((keys <= qpos) & (keys > qpos - window)), float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        torch.testing.assert_close(got[row: row + n].float(), want, atol=2e-2, rtol=2e-2)
        row += n


def test_prefill_kernel_in_a_graph_serves_every_composition():
    """Captured once for a bucket (T tokens, B sequence rows), replayed over compositions
    with other sequence counts and lengths: each equals the reference."""
    from raygraph.graph.inputs import InputBuffers, host_inputs
    from raygraph.model.triton_attention import paged_prefill_attention

    rng = random.Random(9)
    torch.manual_seed(9)
    d, hkv, group, blocks, tokens = 64, 2, 4, 512, 256
    kc = torch.randn(blocks + 1, BS, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bufs = InputBuffers(tokens, 64, 64, torch.device("cuda"))
    q = torch.randn(tokens, hkv * group, d, device="cuda", dtype=torch.bfloat16)

    def fill(seqs):
        h = host_inputs(StepPlan(0, seqs), BS)
        bufs.fill(h, tokens, 64)
        return h, bufs.metadata(tokens, 64, h.num_tokens, h.max_q_len, max(h.seq_lens), False)

    _, md = fill(chunks(rng, 3, 50, 100, blocks))  # the capture's composition
    run = lambda: paged_prefill_attention(q, kc, vc, md.block_tables, md.seq_lens,  # noqa
                                          md.query_start, d**-0.5)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for num_seqs in (1, 7, 30, 64):
        seqs = chunks(rng, num_seqs, tokens // num_seqs, 100, blocks)
        h, md_now = fill(seqs)
        graph.replay()
        ref = paged_attention_ref(q[: h.num_tokens], kc, vc,
                                  prepare_batch(StepPlan(0, seqs), BS,
                                                torch.device("cuda")).ctx.attn, d**-0.5)
        torch.testing.assert_close(out[: h.num_tokens].float(), ref.float(),
                                   **tolerance(torch.bfloat16))
        assert (out[h.num_tokens:] == 0).all()


def test_decode_kernel_sliding_window():
    """The decode kernel with a window sees each sequence's last `window` keys, as the
    reference does (sequences shorter and longer than the window, several splits)."""
    from raygraph.model.triton_attention import paged_decode_attention

    torch.manual_seed(11)
    d, hkv, group, blocks, window = 64, 2, 4, 256, 37
    seqs, used = [], 0
    for i, n in enumerate([1, 20, 37, 38, 100, 900]):
        nb = -(-n // BS)
        seqs.append(SeqChunk(i, [1], n - 1, list(range(used, used + nb)), True))
        used += nb
    kc = torch.randn(blocks + 1, BS, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    md = prepare_batch(StepPlan(0, seqs), BS, torch.device("cuda")).ctx.attn
    q = torch.randn(len(seqs), hkv * group, d, device="cuda", dtype=torch.bfloat16)
    ref = paged_attention_ref(q, kc, vc, md, d**-0.5, window=window)
    got = paged_decode_attention(q, kc, vc, md.block_tables, md.seq_lens, d**-0.5,
                                 window=window)
    torch.testing.assert_close(got.float(), ref.float(), **tolerance(torch.bfloat16))
    full = paged_attention_ref(q, kc, vc, md, d**-0.5)
    assert not torch.allclose(full[-1].float(), ref[-1].float(), atol=0.05)  # it matters


@pytest.mark.parametrize("d", [80, 96, 100, 128])
def test_rotary_kernel_at_heads_whose_half_is_no_power_of_two(d: int) -> None:
    """The rotary kernel pads half a head to a power of two and masks the rest."""
    from raygraph.model import ops, triton_ops

    torch.manual_seed(d)
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float, device="cuda") / d)
    freqs = torch.outer(torch.arange(4096, dtype=torch.float, device="cuda"), inv)
    cos, sin = freqs.cos(), freqs.sin()
    q = torch.randn(37, 32, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(37, 8, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (37,), device="cuda")
    # the torch path on CPU copies is the reference (on a GPU ops.rotary is the kernel)
    want_q, want_k = ops.rotary(q.float().cpu(), k.float().cpu(), cos.cpu(), sin.cpu(),
                                pos.cpu())
    triton_ops.rotary_(q, k, cos, sin, pos)
    tol = dict(atol=2e-2, rtol=2e-2)  # bf16 outputs of O(1): a few of its 2^-8 epsilons
    torch.testing.assert_close(q.float().cpu(), want_q, **tol)
    torch.testing.assert_close(k.float().cpu(), want_k, **tol)
