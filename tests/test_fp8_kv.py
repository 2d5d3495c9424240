"""An FP8 KV cache (`--kv-cache-dtype fp8`): keys and values stored as e4m3 (saturating at
+-448, scale 1.0) and read back in the queries' dtype by the torch reference and the Triton
kernels; a block takes half the bytes of bf16 (a quarter of float32); served greedy tokens
equal HF transformers' with its keys and values rounded the same way; the built-in model's
next tokens under teacher forcing mostly agree with a float32 cache's."""

from __future__ import annotations

import random

import pytest
import torch

from raygraph.config import DEFAULT_MODEL, CacheConfig, SchedulerConfig, ServeConfig
from raygraph.engine.sequence import Sequence
from raygraph.graph.inputs import prepare_batch
from raygraph.model.ops import FP8_KV, paged_attention_ref, store_kv
from raygraph.protocol import SamplingParams, SeqChunk, StepPlan
from raygraph.worker.sizing import kv_bytes_per_block
from raygraph.worker.worker import Worker
from tests.conftest import loaded_worker, serve_in_process
from tests.hf_ref import hf_greedy
from tests.test_fp8_online import load_script
from tests.test_triton_interpret import BS, GROUP, HKV, decode_case, tolerance

CPU = torch.device("cpu")


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as an FP8 cache holds it, back in x's dtype."""
    return x.float().clamp(-448, 448).to(FP8_KV).to(x.dtype)


def test_a_block_takes_half_the_bytes_and_the_worker_fits_more():
    cfg = ServeConfig(cache=CacheConfig(cache_dtype="fp8"))
    m = cfg.model_cfg()
    assert 2 * kv_bytes_per_block(cfg, m, FP8_KV) == kv_bytes_per_block(cfg, m, torch.bfloat16)
    blocks = {}
    for kind in ("auto", "fp8"):  # CPU: a fixed KV budget, float32 weights
        w = Worker(ServeConfig(device="cpu", cache=CacheConfig(cache_dtype=kind)), 0)
        blocks[kind] = w.load(("127.0.0.1", 0)).num_kv_blocks
        w.allocate_kv_cache(8)
        assert w.model.attention_layers()[0].k_cache.dtype == (
            FP8_KV if kind == "fp8" else torch.float32)
        w.shutdown()
    assert blocks["fp8"] == 4 * blocks["auto"]


def test_store_saturates_and_the_reference_reads_back_what_was_stored():
    torch.manual_seed(0)
    kc = torch.zeros(5, BS, HKV, 8, dtype=FP8_KV)
    vc = torch.zeros_like(kc)
    seqs = [SeqChunk(0, [1] * 20, 0, [3, 1], True), SeqChunk(1, [1] * 5, 0, [0], True)]
    md = prepare_batch(StepPlan(0, seqs), BS, CPU).ctx.attn
    k, v = 3 * torch.randn(2, 25, HKV, 8)
    k[0, 0, 0], v[3, 1, 2] = 1000.0, -600.0  # past e4m3's range: saturate, never NaN
    store_kv(k, v, kc, vc, md.slot_mapping)
    kf, vf = kc.float(), vc.float()
    assert kf[3, 0, 0, 0] == 448.0 and vf[3, 3, 1, 2] == -448.0
    assert torch.equal(kf[3, :16], rounded(k[:16])) and torch.equal(vf[0, :5], rounded(v[20:]))
    q = torch.randn(25, HKV * GROUP, 8)
    want = paged_attention_ref(q, kf, vf, md, 8**-0.5)  # float32 caches, the same values
    assert torch.equal(paged_attention_ref(q, kc, vc, md, 8**-0.5), want)


def on_the_grid(x: torch.Tensor) -> torch.Tensor:
    """x rounded to FP8 values, two entries then pushed past its range. Triton's interpreter
    rounds some values near a power of two the wrong way when it converts to FP8 (the GPU
    converts in hardware), so the kernels here store values that need no rounding, and
    saturate the rest."""
    x = rounded(x)
    x.view(-1)[:2] = torch.tensor([1000.0, -700.0])
    return x


def fp8_case(seed: int):
    """decode_case's float16 batch with its caches in FP8 (the reference recomputed)."""
    kc, vc, tables, seq_lens, q, k_new, v_new, *_ = decode_case(torch.float16,
                                                               [1, 17, 64, 150], 0, 2, seed)
    kc, vc = rounded(kc).to(FP8_KV), rounded(vc).to(FP8_KV)
    k_new, v_new = on_the_grid(k_new), on_the_grid(v_new)
    md = prepare_batch(StepPlan(0, [SeqChunk(i, [1], n - 1, tables[i].tolist()[: -(-n // BS)],
                                             True) for i, n in enumerate([1, 17, 64, 150])]),
                       BS, CPU).ctx.attn
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k_new[:4], v_new[:4], ref_k, ref_v, md.slot_mapping)
    return kc, vc, tables, seq_lens, q, k_new, v_new, ref_k, ref_v, md


@pytest.mark.parametrize("splits", [1, 4])
def test_the_decode_kernel_stores_fp8_and_attends_as_stored(interpreted, splits):
    """The kernel stores the step's K/V rounded as the torch path does and folds the newest
    key in as stored: the reference's output over the same FP8 caches."""
    attn = interpreted("triton_attention")
    kc, vc, tables, seq_lens, q, k_new, v_new, ref_k, ref_v, md = fp8_case(3)
    got = attn.paged_decode_attention(q, kc, vc, tables, seq_lens, 64**-0.5, k_new, v_new,
                                      splits=splits)
    assert torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_v.view(torch.uint8))
    ref = paged_attention_ref(q[:4], ref_k, ref_v, md, 64**-0.5)
    torch.testing.assert_close(got[:4], ref, **tolerance(torch.float16))
    assert (got[4:] == 0).all()


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_the_prefill_kernel_and_the_store_read_fp8(interpreted, q_dtype):
    """The kernel over an FP8 cache meets it in float16 whatever the queries' dtype: the
    reference's output over the same cache, to float16's tolerance."""
    attn, ops = interpreted("triton_attention"), interpreted("triton_ops")
    rng = random.Random(5)
    torch.manual_seed(5)
    perm = list(range(32))
    rng.shuffle(perm)
    seqs, used = [], 0
    for i, (n, ctx) in enumerate([(5, 0), (40, 70), (1, 33)]):
        nb = -(-(ctx + n) // BS)
        seqs.append(SeqChunk(i, [1] * n, ctx, perm[used: used + nb], True))
        used += nb
    kc = rounded(torch.randn(33, BS, HKV, 64, dtype=torch.float16)).to(FP8_KV)
    vc = rounded(torch.randn_like(kc, dtype=torch.float16)).to(FP8_KV)
    md = prepare_batch(StepPlan(0, seqs), BS, CPU).ctx.attn
    k, v = (on_the_grid(x) for x in 10 * torch.randn(2, md.num_tokens, HKV, 64,
                                                     dtype=torch.float16))
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k, v, ref_k, ref_v, md.slot_mapping)
    ops.store_kv(k, v, kc, vc, md.slot_mapping)
    assert torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_v.view(torch.uint8))
    q = torch.randn(md.num_tokens, HKV * GROUP, 64, dtype=q_dtype)
    got = attn.paged_prefill_attention(q, kc, vc, md.block_tables, md.seq_lens, md.query_start,
                                       64**-0.5)
    # q as the kernel meets the cache: in float16 (the scores are sharp, 10x keys: q's
    # float16 rounding alone moves some rows past the tolerance)
    ref = paged_attention_ref(q.half().to(q_dtype), kc, vc, md, 64**-0.5)
    torch.testing.assert_close(got, ref, **tolerance(torch.float16))


def fp8_kv_attention(module, query, key, value, *args, **kwargs):
    """HF attention with its keys and values rounded as an FP8 cache holds them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, rounded(key), rounded(value), *args, **kwargs)


def test_served_greedy_tokens_equal_hf_with_keys_and_values_rounded():
    """The served loop's logic (chunked prefill, fed decodes) over an FP8 cache: the tokens
    HF gives when its attention sees every key and value rounded to FP8; on at least one
    prompt they differ from the float32 cache's, so the rounding is not a no-op here."""
    from transformers import AttentionInterface

    AttentionInterface.register("fp8_kv", fp8_kv_attention)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 4096) for _ in range(n)] for n in (7, 30, 61, 90)]
    tokens = {}
    for kind in ("auto", "fp8"):
        cfg = ServeConfig(device="cpu", cache=CacheConfig(block_size=16, num_blocks=64,
                                                         cache_dtype=kind),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48))
        seqs = [Sequence(i, p, SamplingParams(max_tokens=24, temperature=0.0,
                                              ignore_eos=True).resolved())
                for i, p in enumerate(prompts)]
        served = serve_in_process(cfg, loaded_worker(cfg, 64, capture=True), seqs, 64)
        tokens[kind] = [s.output_token_ids for s in served]
    assert tokens["fp8"] == hf_greedy(DEFAULT_MODEL, prompts, 24, attention="fp8_kv")
    assert tokens["fp8"] != tokens["auto"]


def test_next_token_agreement_and_perplexity_with_an_fp8_cache():
    """The built-in model on windows of its training text against float32 everything.
    Measured: an FP8 cache alone 97.93% of next tokens agree, perplexity +0.19%; with FP8
    weights and activations too 96.82%, +1.06% (short of 97% and 1%: asserted as measured,
    with a margin)."""
    measure = load_script("fp8_agreement")
    corpus = load_script("train_default_model").load_corpus()
    seqs = [measure.windows(d)[0] for d in random.Random(0).sample(corpus, 12)]
    ref = measure.cpu_model(DEFAULT_MODEL, "auto")
    for quantization, top1, ppl in (("auto", 0.97, 0.01), ("fp8", 0.96, 0.015)):
        r = measure.agreement(ref, measure.cpu_model(DEFAULT_MODEL, quantization), seqs, FP8_KV)
        assert r.top1 >= top1, (quantization, r)
        assert abs(r.ppl_fp8 / r.ppl_ref - 1) <= ppl, (quantization, r)


def test_per_tensor_scales_divide_what_is_stored_and_scale_what_is_read():
    """kv_scale (k_scale, v_scale): the cache holds k / k_scale and v / v_scale; attention
    equals the reference over float32 caches holding what those entries stand for."""
    from raygraph.model.context import ForwardContext, forward_context
    from raygraph.model.ops import attention

    torch.manual_seed(4)
    seqs = [SeqChunk(0, [1] * 20, 0, [3, 1], True), SeqChunk(1, [1] * 5, 0, [0], True)]
    md = prepare_batch(StepPlan(0, seqs), BS, CPU).ctx.attn
    q = torch.randn(25, HKV * GROUP, 8)
    k, v = 3 * torch.randn(2, 25, HKV, 8)
    kc = torch.zeros(5, BS, HKV, 8, dtype=FP8_KV)
    vc = torch.zeros_like(kc)
    with forward_context(ForwardContext(attn=md)):
        got = attention(q, k, v, kc, vc, 8**-0.5, kv_scale=(0.5, 4.0))
    kf, vf = torch.zeros(2, 5, BS, HKV, 8)
    store_kv(rounded(k / 0.5) * 0.5, rounded(v / 4.0) * 4.0, kf, vf, md.slot_mapping)
    assert torch.equal(kc.float()[3, :16], rounded(k[:16] / 0.5))
    ref = paged_attention_ref(q, kf, vf, md, 8**-0.5)
    torch.testing.assert_close(got, ref.reshape(25, -1), atol=1e-5, rtol=1e-5)
