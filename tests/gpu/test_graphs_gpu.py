"""GPU: Triton decode attention vs the torch reference, graph replay vs eager, greedy
tokens through graphs vs eager for mixed workloads. Fresh random data for every check."""

from __future__ import annotations

import random

import pytest
import torch

from raygraph.config import (
    CacheConfig,
    GraphConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
)
from raygraph.engine.sequence import Sequence
from raygraph.graph.inputs import prepare_batch
from raygraph.model.ops import paged_attention_ref
from raygraph.protocol import SamplingParams, SeqChunk, StepPlan
from raygraph.worker.worker import Worker
from tests.conftest import (
    cascade_lengths,
    loaded_worker,
    make_checkpoint,
    randomise_caches,
    serve_in_process,
)

pytestmark = pytest.mark.gpu


def decode_seqs(lens: list[int], blocks: int, bs: int) -> list[SeqChunk]:
    """One decode token per sequence of the given kv lengths, on shuffled disjoint blocks."""
    perm = torch.randperm(blocks).tolist()
    seqs, used = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        seqs.append(SeqChunk(i, [1], n - 1, perm[used: used + nb], True))
        used += nb
    return seqs


def test_triton_decode_matches_reference():
    from raygraph.model.triton_attention import paged_decode_attention

    for trial in range(3):
        torch.manual_seed(trial)
        bs, blocks, hkv, group, d = 16, 64, 2, 4, 64
        kc = torch.randn(blocks + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = [1, 17, 100, 250][: trial + 2]
        seqs = decode_seqs(lens, blocks, bs)
        batch = prepare_batch(StepPlan(0, seqs), bs, torch.device("cuda"))
        q = torch.randn(len(lens), hkv * group, d, device="cuda", dtype=torch.bfloat16)
        md = batch.ctx.attn
        ref = paged_attention_ref(q, kc, vc, md, d**-0.5)
        got = paged_decode_attention(q, kc, vc, md.block_tables, md.seq_lens, d**-0.5)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_triton_decode_stores_new_kv_and_skips_padding_rows():
    """With k_new/v_new the kernel stores the step's K/V (padding rows, kv length 0, store
    nothing) and attends over it: the same cache and output as store_kv + the reference."""
    from raygraph.model.ops import store_kv
    from raygraph.model.triton_attention import paged_decode_attention

    for trial in range(3):
        torch.manual_seed(10 + trial)
        bs, blocks, hkv, group, d = 16, 128, 2, 4, 64
        kc = torch.randn(blocks + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = random.Random(trial).sample(range(1, 600), 3)
        seqs = decode_seqs(lens, blocks, bs)
        md = prepare_batch(StepPlan(0, seqs), bs, torch.device("cuda")).ctx.attn
        pad = 2  # two padding rows: kv length 0, an all-zero table row, slot -1
        tables = md.block_tables
        tables = torch.cat([tables, tables.new_zeros(pad, tables.shape[1])])
        seq_lens = torch.cat([md.seq_lens, md.seq_lens.new_zeros(pad)])
        b = len(lens) + pad
        q = torch.randn(b, hkv * group, d, device="cuda", dtype=torch.bfloat16)
        k_new, v_new = torch.randn(2, b, hkv, d, device="cuda", dtype=torch.bfloat16)
        ref_k, ref_v = kc.clone(), vc.clone()
        store_kv(k_new[: len(lens)], v_new[: len(lens)], ref_k, ref_v, md.slot_mapping)
        ref = paged_attention_ref(q[: len(lens)], ref_k, ref_v, md, d**-0.5)
        got = paged_decode_attention(q, kc, vc, tables, seq_lens, d**-0.5, k_new, v_new)
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
        torch.testing.assert_close(got[: len(lens)].float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert (got[len(lens):] == 0).all()


def shared_prefix_batch(head_dim: int, b: int, shared_blocks: int, seed: int):
    """b decode rows behind the same `shared_blocks` blocks (0: none), each with 1-200 keys
    of its own: metadata (cascade on), bf16 caches, q and the step's K/V."""
    torch.manual_seed(seed)
    bs, hkv, group = 16, 8, 4
    lens = [shared_blocks * bs + 1 + random.Random(i).randrange(0, 200) for i in range(b)]
    own = [-(-n // bs) - shared_blocks for n in lens]
    blocks = shared_blocks + sum(own)
    perm = torch.randperm(blocks).tolist()
    prefix, used, seqs = perm[:shared_blocks], shared_blocks, []
    for i, n in enumerate(lens):
        seqs.append(SeqChunk(i, [1], n - 1, prefix + perm[used: used + own[i]], True))
        used += own[i]
    md = prepare_batch(StepPlan(0, seqs), bs, torch.device("cuda"), cascade=True).ctx.attn
    kc = torch.randn(blocks + 1, bs, hkv, head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, hkv * group, head_dim, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = torch.randn(2, b, hkv, head_dim, device="cuda", dtype=torch.bfloat16)
    return md, kc, vc, q, k_new, v_new


@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_decode_cascade_in_one_graph(head_dim):
    """A shared 1024-key prefix under 64 sequences: the cascade (graph captured once with
    the shared-length buffer) matches the reference at that length and at 0, replayed in
    the same graph; the step's K/V is stored the same way."""
    from raygraph.model.ops import store_kv
    from raygraph.model.triton_attention import paged_decode_attention

    shared_blocks, bs = 64, 16
    md, kc, vc, q, k_new, v_new = shared_prefix_batch(head_dim, 64, shared_blocks, head_dim)
    assert md.shared_len.item() == shared_blocks * bs
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k_new, v_new, ref_k, ref_v, md.slot_mapping)
    ref = paged_attention_ref(q, ref_k, ref_v, md, head_dim**-0.5)
    shared = md.shared_len.clone()
    call = lambda: paged_decode_attention(q, kc, vc, md.block_tables, md.seq_lens,  # noqa: E731
                                          head_dim**-0.5, k_new, v_new, shared_len=shared)
    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for length in (shared_blocks * bs, 0, 512):
        shared.fill_(length)
        graph.replay()
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits,shared_blocks,b", [(1, 0, 64), (1, 64, 64), (2, 64, 48),
                                                    (None, 0, 8), (1, 20, 200), (None, 0, 64),
                                                    (None, 20, 200)])
def test_triton_decode_rotates_q_and_k_in_the_kernel(splits, shared_blocks, b):
    """With the rotary tables, q and the step's K come unrotated and the kernels rotate them
    at each row's position, in a graph: the output and the stored K equal the rotary op's
    followed by the reference (one split: the sequences' programs write the output, merging
    the cascade's partials themselves). No shared prefix: the plain kernel, as a served
    plain decode graph runs it (64 x 8 KV heads: its default of one split)."""
    from raygraph.model.ops import rotary, store_kv
    from raygraph.model.triton_attention import paged_decode_attention

    d = 64
    md, kc, vc, q, k_new, v_new = shared_prefix_batch(d, b, shared_blocks, b + shared_blocks)
    cos, sin = (t.cuda() for t in torch.randn(2, 8192, d // 2))
    rq, rk = rotary(q.clone(), k_new.clone(), cos, sin, md.seq_lens.long() - 1)
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(rk, v_new, ref_k, ref_v, md.slot_mapping)
    ref = paged_attention_ref(rq, ref_k, ref_v, md, d**-0.5)
    call = lambda: paged_decode_attention(q, kc, vc, md.block_tables, md.seq_lens,  # noqa: E731
                                          d**-0.5, k_new, v_new, splits=splits,
                                          shared_len=md.shared_len if shared_blocks else None,
                                          rope=(cos, sin))
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.testing.assert_close(kc.float(), ref_k.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("vocab", [1000, 32000, 151936])
def test_greedy_argmax_kernel_matches_torch(vocab):
    """First index on ties (planted across lanes and across loop tiles), all -inf rows."""
    from raygraph.model import ops

    torch.manual_seed(vocab)
    x = torch.randn(37, vocab, device="cuda")
    x[1, [5, vocab - 1]] = 100.0  # a tie far apart: the first wins
    x[2, [vocab // 2, 7, vocab // 3]] = 50.0
    x[3] = float("-inf")
    x[4] = 0.0  # all equal: index 0
    assert torch.equal(ops.argmax(x), x.argmax(-1))
    bf = x.to(torch.bfloat16)  # many exact ties after rounding
    assert torch.equal(ops.argmax(bf), bf.argmax(-1))


@pytest.mark.parametrize("m, k", [(1, 2048), (3, 2048), (8, 2048), (1, 3584), (1, 18944)])
def test_skinny_gemv_kernels_match_torch_reference(m, k):
    """The decode GEMMs (plain with bias, gate|up with silu*mul, q|k|v with rotary) against
    F.linear followed by the torch reference of the fused op; one token over rows that runs
    of 1024 do not divide (Qwen2.5-7B's: runs of 4096, the last masked) too."""
    import torch.nn.functional as F

    from raygraph.model import ops
    from raygraph.model.triton_gemv import gemv, gemv_rotary, gemv_silu_mul

    torch.manual_seed(m)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(1000, k, device=dev, dtype=dt) * 0.02  # N not a multiple of the tile
    bias = torch.randn(1000, device=dev, dtype=dt)
    torch.testing.assert_close(gemv(x, w, bias), F.linear(x, w, bias), atol=2e-2, rtol=2e-2)
    gu = torch.randn(2 * 512, k, device=dev, dtype=dt) * 0.02
    torch.testing.assert_close(gemv_silu_mul(x, gu), ops.silu_and_mul(F.linear(x, gu).cpu()
                                                                      ).to(dev),
                               atol=2e-2, rtol=2e-2)
    hq, hk, d = 8, 2, 64
    wqkv = torch.randn((hq + 2 * hk) * d, k, device=dev, dtype=dt) * 0.02
    bqkv = torch.randn((hq + 2 * hk) * d, device=dev, dtype=dt)
    pos = torch.randint(0, 500, (m,), device=dev)
    freqs = torch.outer(torch.arange(512.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = freqs.cos().to(dev), freqs.sin().to(dev)
    ref = F.linear(x, wqkv, bqkv).cpu()
    rq, rk = ops.rotary(ref[:, : hq * d].view(m, hq, d), ref[:, hq * d: (hq + hk) * d].view(
        m, hk, d), cos.cpu(), sin.cpu(), pos.cpu())
    got = gemv_rotary(x, wqkv, bqkv, pos, cos, sin, d, hq + hk).cpu()
    torch.testing.assert_close(got[:, : hq * d], rq.reshape(m, -1), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[:, hq * d: (hq + hk) * d], rk.reshape(m, -1), atol=2e-2,
                               rtol=2e-2)
    torch.testing.assert_close(got[:, (hq + hk) * d:], ref[:, (hq + hk) * d:], atol=2e-2,
                               rtol=2e-2)


@pytest.fixture(scope="module")
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The GPU Llama, or (param "qwen3") its Qwen3 twin: q/k norms between the qkv GEMM and
    rotary (no fused GEMM+rotary), head_dim 64 != hidden / heads."""
    if getattr(request, "param", "llama") == "llama":
        return request.getfixturevalue("gpu_llama")
    return make_checkpoint(tmp_path_factory.mktemp("gpu-qwen3"), "Qwen3ForCausalLM",
                           random_norms=True, vocab_size=512, hidden_size=256,
                           intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=64)


def worker(ckpt, mode: str, dtype: str, prefill_graph: str = "piecewise",
           cascade: bool = True, speculative: bool = False) -> Worker:
    """`speculative`: n-gram speculation configured, so decode graphs verify drafts as rows."""
    cfg = ServeConfig(
        model=str(ckpt), device="cuda", dtype=dtype, cache=CacheConfig(block_size=16,
                                                                        num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=128),
        graph=GraphConfig(mode=mode, prefill_graph=prefill_graph, decode_cascade=cascade),
        speculative=SpeculativeConfig(method="ngram" if speculative else ""),
    )
    return loaded_worker(cfg, 256, capture=True)


def random_plan(rng: random.Random, shape: str) -> StepPlan:
    """Random sequences on disjoint blocks: one token each ("decode"), 2-9 ("prefill"), or a
    token and 0-4 drafts to verify ("verify": decode rows, a row per token)."""
    seqs, block = [], 0
    for i in range(rng.randrange(1, 7 if shape == "verify" else 12)):  # rows <= max_num_seqs
        ctx = rng.randrange(int(shape == "verify"), 200)
        n = {"decode": 1, "prefill": rng.randrange(2, 10), "verify": rng.randrange(1, 6)}[shape]
        nb = -(-(ctx + n) // 16)
        seqs.append(SeqChunk(i, [rng.randrange(3, 512) for _ in range(n)], ctx,
                             list(range(block, block + nb)), True,
                             verify=n - 1 if shape == "verify" else 0))
        block += nb
    return StepPlan(0, seqs)


@pytest.mark.parametrize("ckpt,shape,prefill_graph", [
    ("llama", "decode", "piecewise"), ("llama", "prefill", "piecewise"),
    ("llama", "prefill", "full"), ("llama", "verify", "full"), ("qwen3", "decode", "piecewise"),
    ("qwen3", "prefill", "full")], indirect=["ckpt"])
def test_graph_replay_equals_eager(ckpt, shape, prefill_graph):
    g = worker(ckpt, "graph", "bfloat16", prefill_graph, speculative=shape == "verify")
    e = worker(ckpt, "eager", "bfloat16")
    rng = random.Random(len(shape))
    for trial in range(6):
        plan = random_plan(rng, shape)
        randomise_caches((g, e), trial)
        got, ref = g.executor.logits(plan), e.executor.logits(plan)
        assert g.executor.last_key is not None and g.executor.last_key.phase == (
            "prefill" if shape == "prefill" else "decode")
        torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("quantization", ["auto", "fp8"])
def test_graphs_launched_with_pdl_equal_plain_stream_order(gpu_llama, monkeypatch,
                                                          quantization):
    """Programmatic dependent launch only moves when kernels start: the decode graph's logits
    with it equal, bit for bit, those of the same kernels launched in plain stream order
    (a kernel reading its input before the one before finished would differ). One-token
    steps (launched with PDL) between steps of 5 and 8 rows (launched in order), bf16 and
    FP8 weights."""
    from raygraph.model import triton_pdl

    one_row = torch.empty(1, device="cuda")
    assert triton_pdl.pdl(one_row, 1)["PDL"] == (torch.cuda.get_device_capability() >= (9, 0))
    triton_pdl.set_enabled(False)  # as a worker with weight offload sets it
    assert not triton_pdl.pdl(one_row, 1)["PDL"]
    triton_pdl.set_enabled(True)

    def build(pdl_on: bool) -> Worker:
        monkeypatch.setenv("RAYGRAPH_PDL", "1" if pdl_on else "0")
        triton_pdl._supported.cache_clear()
        cfg = ServeConfig(
            model=str(gpu_llama), device="cuda", dtype="bfloat16", quantization=quantization,
            cache=CacheConfig(block_size=16, num_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=128),
            graph=GraphConfig(mode="graph"))
        return loaded_worker(cfg, 256, capture=True)

    plain, overlapped = build(False), build(True)
    triton_pdl._supported.cache_clear()
    rng = random.Random(7)
    for rows in (1, 5, 8, 1, 1, 1):  # a race would show only now and then
        seqs, block = [], 0
        for i in range(rows):
            ctx = rng.randrange(0, 200)
            nb = -(-(ctx + 1) // 16)
            seqs.append(SeqChunk(i, [rng.randrange(3, 512)], ctx,
                                 list(range(block, block + nb)), True))
            block += nb
        plan = StepPlan(0, seqs)
        randomise_caches((plain, overlapped), rows)
        ref = plain.executor.logits(plan)
        got = overlapped.executor.logits(plan)
        assert plain.executor.last_key is not None  # both replayed a graph
        assert overlapped.executor.last_key is not None
        assert torch.equal(got, ref), (rows, (got - ref).abs().max())


def test_triton_decode_verifies_drafts_as_rows_in_a_graph():
    """Verify chunks as decode rows (tests/conftest.verify_rows_case), the kernel captured
    and replayed: a row's chunk-mates store their keys in the same launch, so it must take
    them from their K/V, not the cache; output and cache equal the reference. Split over
    the keys (a program a row), and at one split (a program a chunk's rows: 8 query heads a
    KV head take 4 rows a program, so the 5-row chunk two)."""
    from raygraph.model.triton_attention import paged_decode_attention
    from tests.conftest import verify_rows_case

    for rope, splits, group in [(False, None, 4), (True, None, 4), (False, 1, 4), (True, 1, 8)]:
        case = verify_rows_case(torch.bfloat16, torch.device("cuda"), rope, group=group)
        a, rows = case["args"], case["rows"]
        paged_decode_attention(**a, scale=64**-0.5, splits=splits)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = paged_decode_attention(**a, scale=64**-0.5, splits=splits)
        graph.replay()
        torch.testing.assert_close(a["k_cache"].float(), case["ref_k"].float(), atol=2e-2,
                                   rtol=2e-2)
        torch.testing.assert_close(out[:rows].float(), case["ref"].float(), atol=2e-2,
                                   rtol=2e-2)
        assert (out[rows:] == 0).all()


@pytest.mark.parametrize("ckpt,prefill_graph,longest", [
    ("llama", "piecewise", 150), ("llama", "full", 150), ("llama", "full", 480),
    ("llama", "piecewise", 480), ("qwen3", "full", 150), ("qwen3", "piecewise", 480)],
    indirect=["ckpt"])
def test_greedy_tokens_graph_equals_eager_mixed_workload(ckpt, prefill_graph, longest):
    """Prompts up to `longest` tokens (the model's context is 512) in 128-token chunks:
    prefill, chunked prefill, mixed and decode steps through the served loop's logic."""
    rng = random.Random(7 + longest)
    count = 20 if longest <= 150 else 8
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, longest))]
               for _ in range(count)]
    graph, eager = greedy_graph_and_eager(ckpt, prompts, 24, prefill_graph)
    assert graph == eager


@pytest.mark.parametrize("ckpt", ["llama"], indirect=True)
def test_greedy_tokens_with_the_decode_cascade_equal_eager(ckpt):
    """12 prompts behind one 300-token head (18 cached blocks shared under prefix caching):
    decode graphs with the cascade give the eager path's greedy tokens, and steps ran it
    (the shared length the buffers carried)."""
    rng = random.Random(3)
    head = [rng.randrange(3, 512) for _ in range(300)]
    prompts = [head + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))]
               for _ in range(12)]

    def greedy(w: Worker) -> list[list[int]]:
        seqs = serve_in_process(w.cfg, w, [
            Sequence(i, p, SamplingParams(max_tokens=24, ignore_eos=True))
            for i, p in enumerate(prompts)], 256)
        w.shutdown()
        return [s.output_token_ids for s in seqs]

    g = worker(ckpt, "graph", "float32", "full", cascade=True)
    shared = cascade_lengths(g.executor)
    assert greedy(g) == greedy(worker(ckpt, "eager", "float32", "full"))
    assert max(shared) == 288  # the cascade graph ran over 18 whole blocks of the head


def greedy_graph_and_eager(ckpt, prompts: list[list[int]], max_tokens: int,
                           prefill_graph: str) -> list[list[list[int]]]:
    """Greedy outputs through graphs, then eagerly (float32), each through the served loop's
    logic: deltas, tokens fed on the device, replies a step late."""
    outs = []
    for mode in ("graph", "eager"):
        w = worker(ckpt, mode, "float32", prefill_graph)
        seqs = serve_in_process(w.cfg, w, [
            Sequence(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)], 256)
        outs.append([s.output_token_ids for s in seqs])
        w.shutdown()
    return outs


def test_fused_rms_norm_and_rotary_match_torch_reference():
    from raygraph.model import ops

    torch.manual_seed(3)
    x = torch.randn(37, 2048, dtype=torch.bfloat16)
    w = torch.randn(2048, dtype=torch.bfloat16)
    torch.testing.assert_close(ops.rms_norm(x.cuda(), w.cuda(), 1e-5).cpu(),
                               ops.rms_norm(x, w, 1e-5), atol=2e-2, rtol=2e-2)
    r = torch.randn_like(x)
    got_norm, got_sum = ops.add_rms_norm(x.cuda(), r.cuda(), w.cuda(), 1e-5)
    ref_norm, ref_sum = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(got_sum.cpu(), ref_sum)
    torch.testing.assert_close(got_norm.cpu(), ref_norm, atol=2e-2, rtol=2e-2)
    # per-head norms (Qwen3's q/k norms): 3D input and a strided view normalise each row
    heads = torch.randn(37, 8, 64, dtype=torch.bfloat16)
    wh = torch.randn(64, dtype=torch.bfloat16)
    for t in (heads, heads[:, ::2]):
        torch.testing.assert_close(ops.rms_norm(t.cuda(), wh.cuda(), 1e-6).cpu(),
                                   ops.rms_norm(t, wh, 1e-6), atol=2e-2, rtol=2e-2)
    qkv = torch.randn(37, (8 + 2 + 2) * 64, dtype=torch.bfloat16)
    pos = torch.randint(0, 500, (37,))
    freqs = torch.outer(torch.arange(512.0), 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64))
    cos, sin = freqs.cos(), freqs.sin()

    def split(t):
        q, k, _ = t.split([512, 128, 128], dim=-1)  # strided views, as the model passes them
        return q.view(37, 8, 64), k.view(37, 2, 64)

    ref_q, ref_k = ops.rotary(*split(qkv.clone()), cos, sin, pos)
    gq, gk = ops.rotary(*split(qkv.cuda()), cos.cuda(), sin.cuda(), pos.cuda())
    torch.testing.assert_close(gq.cpu(), ref_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gk.cpu(), ref_k, atol=2e-2, rtol=2e-2)


def test_fused_silu_mul_and_store_kv_match_torch_reference():
    from raygraph.model import ops

    torch.manual_seed(5)
    x = torch.randn(19, 2 * 1000, dtype=torch.bfloat16)
    torch.testing.assert_close(ops.silu_and_mul(x.cuda()).cpu(), ops.silu_and_mul(x),
                               atol=2e-2, rtol=2e-2)
    kv = torch.randn(6, 3 * 2 * 64, dtype=torch.bfloat16)
    k, v = (t.reshape(6, 2, 64) for t in kv.split([128, 128, 128], dim=-1)[:2])
    slots = torch.tensor([5, -1, 0, 17, -1, 30])
    caches = [torch.full((9, 4, 2, 64), 7.0, dtype=torch.bfloat16) for _ in range(2)]
    gpu = [c.cuda() for c in caches]
    ops.store_kv(k, v, *caches, slots)
    ops.store_kv(k.cuda(), v.cuda(), *gpu, slots.cuda())
    for c, g in zip(caches, gpu):
        # the torch path parks padding rows in the scratch (last) slot; the kernel skips them
        c.view(-1, 2, 64)[-1] = 7.0
        assert torch.equal(c, g.cpu())


def compiled_variants() -> dict[str, int]:
    """Compiled specialisations of every Triton kernel raygraph launches, by name."""
    import triton

    from raygraph.model import triton_attention, triton_gemv, triton_ops

    out = {}
    for mod in (triton_attention, triton_gemv, triton_ops):
        for name, fn in vars(mod).items():
            if not isinstance(fn, triton.runtime.JITFunction):
                continue
            if hasattr(fn, "device_caches"):  # triton 3.x: device -> (kernel cache, ...)
                out[name] = sum(len(c[0]) for c in fn.device_caches.values())
            elif hasattr(fn, "cache"):
                out[name] = sum(len(c) for c in fn.cache.values())
            else:
                pytest.skip("this triton keeps its kernel cache elsewhere")
    return out


@pytest.mark.parametrize("prefill_graph", ["full", "piecewise"])
def test_no_kernel_compiles_after_capture(gpu_llama, prefill_graph):
    """Capture compiles everything a served step runs: prefill steps of new compositions
    (1-11 sequences, so 1-11 sampled rows: each skinny-GEMM regime of the eager logits)
    compile nothing. A compile in a step is the 150+ ms first-shape spike."""
    cfg = ServeConfig(
        model=str(gpu_llama), device="cuda", dtype="bfloat16",
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=128),
        graph=GraphConfig(decode_sizes=[1], prefill_graph=prefill_graph),  # as bench.prefill
    )
    w = loaded_worker(cfg, 256, capture=True)
    before = compiled_variants()
    rng = random.Random(21)
    for _ in range(12):
        w.executor.logits(random_plan(rng, "prefill"))
    torch.cuda.synchronize()
    assert compiled_variants() == before
    w.shutdown()


def test_input_upload_moves_the_columns_each_step_changed() -> None:
    """On the GPU the tables go up in a 2-D driver copy of the columns a step changed: over
    steps whose tables grow, shrink and lose rows, the device rows equal the tables padded
    with zeros, and the fields before the tables arrive as written."""
    from raygraph.graph.inputs import InputBuffers, host_inputs

    bs, rng = 16, random.Random(7)
    bufs = InputBuffers(64, 32, 512, torch.device("cuda"))
    for step in range(12):
        rows = rng.randrange(1, 33)
        lens = [rng.randrange(1, 512 * bs) if rng.random() < 0.2 else rng.randrange(1, 200)
                for _ in range(rng.randrange(1, rows + 1))]
        chunks = [SeqChunk(i, [1], n - 1, [rng.randrange(1, 1000) for _ in range(-(-n // bs))],
                           True) for i, n in enumerate(lens)]
        h = host_inputs(StepPlan(step, chunks), bs)
        bufs.fill(h, rows, rows)
        torch.cuda.synchronize()
        want = torch.zeros(rows, 512, dtype=torch.int32)
        for i, c in enumerate(chunks):
            want[i, : len(c.block_table)] = torch.tensor(c.block_table)
        assert torch.equal(bufs.block_tables[:rows].cpu(), want)
        assert bufs.seq_lens[:rows].tolist() == lens + [0] * (rows - len(lens))
        assert torch.equal(bufs.device_bytes.cpu(), bufs.host)
