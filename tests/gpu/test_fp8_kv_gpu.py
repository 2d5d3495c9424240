"""GPU: an FP8 KV cache in the compiled kernels (the hardware's FP8 conversion, rounding to
nearest and saturating, as torch's) and through captured graphs: graph tokens equal eager."""

from __future__ import annotations

import random

import pytest
import torch

from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.engine.sequence import Sequence
from raygraph.graph.inputs import prepare_batch
from raygraph.model.ops import FP8_KV, paged_attention_ref, store_kv
from raygraph.protocol import SamplingParams, SeqChunk, StepPlan
from tests.conftest import loaded_worker, serve_in_process

pytestmark = pytest.mark.gpu

BS, HKV, GROUP, D = 16, 2, 4, 128


def decode_batch(lens: list[int], spare: int = 0):
    """FP8 caches of random entries (4x a normal's spread), one decode token per sequence of
    `lens` keys on shuffled blocks of its own (`spare` blocks unused), and its metadata."""
    dev = torch.device("cuda")
    blocks = sum(-(-n // BS) for n in lens) + spare
    kc = (4 * torch.randn(blocks + 1, BS, HKV, D, device=dev)).to(FP8_KV)
    vc = (4 * torch.randn_like(kc, dtype=torch.float32)).to(FP8_KV)
    perm, used, seqs = torch.randperm(blocks).tolist(), 0, []
    for i, n in enumerate(lens):
        nb = -(-n // BS)
        seqs.append(SeqChunk(i, [1], n - 1, perm[used: used + nb], True))
        used += nb
    return kc, vc, seqs, prepare_batch(StepPlan(0, seqs), BS, dev).ctx.attn


def test_kernels_store_and_read_fp8_as_the_reference_does():
    """Decode (the step's K/V stored by the kernel) and prefill over FP8 caches: the stored
    bytes equal torch's conversion, the outputs the reference's over the same caches."""
    from raygraph.model.triton_attention import paged_decode_attention, paged_prefill_attention
    from raygraph.model.triton_ops import store_kv as fused_store

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    lens = [1, 17, 100, 300]
    kc, vc, seqs, md = decode_batch(lens, spare=4)
    q = torch.randn(len(lens), HKV * GROUP, D, device=dev, dtype=dt)
    k_new, v_new = 300 * torch.randn(2, len(lens), HKV, D, device=dev, dtype=dt)  # saturates
    ref_k, ref_v = kc.cpu(), vc.cpu()  # the torch path's store, on the host
    store_kv(k_new.cpu(), v_new.cpu(), ref_k, ref_v, md.slot_mapping.cpu())
    got = paged_decode_attention(q, kc, vc, md.block_tables, md.seq_lens, D**-0.5, k_new, v_new)
    assert torch.equal(kc.cpu().view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), ref_v.view(torch.uint8))
    ref = paged_attention_ref(q.float(), kc, vc, md, D**-0.5)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    kc2, vc2 = kc.clone(), vc.clone()
    fused_store(k_new, v_new, kc2, vc2, md.slot_mapping)
    assert torch.equal(kc2.view(torch.uint8), kc.view(torch.uint8))
    pre = [SeqChunk(0, [1] * 40, 60, seqs[2].block_table, True)]
    pmd = prepare_batch(StepPlan(0, pre), BS, dev).ctx.attn
    pq = torch.randn(40, HKV * GROUP, D, device=dev, dtype=dt)
    got = paged_prefill_attention(pq, kc, vc, pmd.block_tables, pmd.seq_lens, pmd.query_start,
                                  D**-0.5)
    ref = paged_attention_ref(pq.float(), kc, vc, pmd, D**-0.5)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_graph_tokens_equal_eager_with_an_fp8_cache(gpu_llama):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 90, 130, 7, 60)]
    out = {}
    for mode in ("graph", "eager"):
        cfg = ServeConfig(model=str(gpu_llama), device="cuda", dtype="bfloat16",
                          cache=CacheConfig(block_size=16, num_blocks=128, cache_dtype="fp8"),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                          graph=GraphConfig(mode=mode))
        seqs = [Sequence(i, p, SamplingParams(max_tokens=32, temperature=0.0,
                                              ignore_eos=True).resolved())
                for i, p in enumerate(prompts)]
        worker = loaded_worker(cfg, 128, capture=True)
        assert worker.model.attention_layers()[0].k_cache.dtype == FP8_KV
        out[mode] = [s.output_token_ids for s in serve_in_process(cfg, worker, seqs, 128)]
    assert out["graph"] == out["eager"]
