"""GPU: the Triton LoRA shrink/expand kernels against the torch reference (bf16, ranks
8/16/64 in rank-64 slots and rank 48 in rank-48 slots, one to three merged parts, random
slots with base rows, sorted and unsorted token orders), replayed inside a CUDA graph while
slots and inputs change; a LoRA layer with its slots' A rows in its weight, both paths; and
a model with a mixed batch of adapters: graph logits equal eager, greedy tokens equal too."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raygraph.config import CacheConfig, GraphConfig, LoRAConfig, SchedulerConfig, ServeConfig
from raygraph.engine.sequence import Sequence
from raygraph.graph.inputs import sort_by_slot
from raygraph.model.context import ForwardContext, LoRAInputs, forward_context
from raygraph.model.lora_ops import LoRAWeights, lora_delta, lora_linear
from raygraph.protocol import SamplingParams, SeqChunk, StepPlan
from raygraph.worker.worker import Worker
from tests.conftest import loaded_worker, randomise_caches, serve_in_process
from tests.test_lora import (
    ARRIVALS,
    ATTN,
    MLP,
    PROMPTS,
    SLOTS,
    make_adapter,
    serve_with_promotions,
)

pytestmark = pytest.mark.gpu

NUM_SLOTS, PADDED = 5, 64


def stacks(rank: int, k: int, slices: tuple[int, ...], dtype=torch.bfloat16,
           padded: int = PADDED) -> tuple[torch.Tensor, torch.Tensor]:
    """Random slots of adapter rank `rank`, zero-padded to `padded`, as the model holds them."""
    a = torch.zeros(NUM_SLOTS, len(slices) * padded, k)
    b = torch.zeros(NUM_SLOTS, sum(slices), padded)
    for p in range(len(slices)):
        a[:, p * padded: p * padded + rank] = torch.randn(NUM_SLOTS, rank, k) / k**0.5
    b[:, :, :rank] = torch.randn(NUM_SLOTS, sum(slices), rank) / rank**0.5
    return a.to("cuda", dtype), b.to("cuda", dtype)


def lora_inputs(slots: torch.Tensor, sort: bool = True) -> LoRAInputs:
    order, ordered = (sort_by_slot(slots.numpy()) if sort
                      else (np.arange(len(slots)), slots.numpy()))
    return LoRAInputs(*(torch.as_tensor(t, dtype=torch.int32).cuda()
                        for t in (slots, order, ordered)))


def reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              slots: torch.Tensor, slices: tuple[int, ...]) -> torch.Tensor:
    """y + delta in fp32 from the same bf16 inputs."""
    return y.float() + lora_delta(x.float(), a.float(), b.float(), slots.cuda(), slices)


@pytest.mark.parametrize("rank, padded", [(8, 64), (16, 64), (64, 64), (48, 48)])
def test_triton_lora_matches_reference(rank, padded):
    from raygraph.model.triton_lora import add_lora_, lora_expand_

    torch.manual_seed(rank)
    # o/down-like (one part), q|k|v-like (uneven parts), gate|up-like; 1 to 300 tokens
    for slices, k, t in [((256,), 512, 1), ((512, 128, 128), 256, 37), ((384, 384), 256, 300),
                         ((200,), 768, 5), ((64, 32, 32), 2048, 16)]:
        a, b = stacks(rank, k, slices, padded=padded)  # 48: slots of a rank not a power of 2
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(t, sum(slices), device="cuda", dtype=torch.bfloat16)
        slots = torch.randint(-1, NUM_SLOTS, (t,), dtype=torch.int32)
        want = reference(y, x, a, b, slots, slices)
        for sort in (True, False):  # unsorted: a tile loops over many slots
            got = y.clone()
            lora = lora_inputs(slots, sort)
            add_lora_(got, x, a, b, lora.order, lora.sorted_slot, slices)
            torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2,
                                       msg=lambda m, s=slices, t=t: f"{s} x {t}: {m}")
            base = (slots < 0).cuda()
            assert torch.equal(got[base], y[base])  # base rows untouched, bitwise
        # every slot's u at once (a decode GEMM over W's appended A rows): expand at a stride
        got, lora = y.clone(), lora_inputs(slots)
        lora_expand_(got, x @ a.reshape(-1, k).T, b, lora.order, lora.sorted_slot, slices,
                     tuple(range(len(slices))), slot_stride=a.shape[1])
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("parts", [(0, 2), (1,), (0, 1)])
def test_triton_lora_skips_untargeted_parts(parts):
    """A q|k|v layer whose adapters target only some parts (q and v: parts 0 and 2): the
    kernels read only those parts' A and B (the others hold garbage here, as a test: they
    must not be read) and leave the other parts' columns bitwise as they were."""
    from raygraph.model.triton_lora import add_lora_

    torch.manual_seed(len(parts))
    slices, k = (512, 128, 128), 2048
    for t in (5, 64, 300):
        a, b = stacks(16, k, slices)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(t, sum(slices), device="cuda", dtype=torch.bfloat16)
        slots = torch.randint(-1, NUM_SLOTS, (t,), dtype=torch.int32)
        skipped = [p for p in range(3) if p not in parts]
        a_only, b_only = a.clone(), b.clone()
        for p in skipped:
            a_only[:, p * PADDED: (p + 1) * PADDED] = 0
            b_only[:, sum(slices[:p]): sum(slices[: p + 1])] = 0
        want = reference(y, x, a_only, b_only, slots, slices)
        lora = lora_inputs(slots)
        got = y.clone()
        add_lora_(got, x, a, b, lora.order, lora.sorted_slot, slices, parts)
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)
        for p in skipped:
            cols = slice(sum(slices[:p]), sum(slices[: p + 1]))
            assert torch.equal(got[:, cols], y[:, cols])


def test_triton_lora_replays_inside_a_cuda_graph():
    """Slots, inputs and one adapter's weights rewritten in place between replays: the graph
    (captured once, on a first batch) computes each new mix."""
    from raygraph.model.triton_lora import add_lora_

    torch.manual_seed(0)
    t, k, slices = 48, 256, (256, 64, 64)
    a, b = stacks(16, k, slices)
    x = torch.zeros(t, k, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(t, sum(slices), device="cuda", dtype=torch.bfloat16)
    lora = lora_inputs(torch.full((t,), -1, dtype=torch.int32))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile before capture
        add_lora_(y.clone(), x, a, b, lora.order, lora.sorted_slot, slices)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = y.clone()
        add_lora_(out, x, a, b, lora.order, lora.sorted_slot, slices)
    for trial in range(4):
        slots = torch.randint(-1, NUM_SLOTS, (t,), dtype=torch.int32)
        new = lora_inputs(slots)
        for buf, src in zip((lora.token_slot, lora.order, lora.sorted_slot),
                            (new.token_slot, new.order, new.sorted_slot)):
            buf.copy_(src)
        x.copy_(torch.randn_like(x))
        y.copy_(torch.randn_like(y))
        a[trial % NUM_SLOTS].normal_(0, k**-0.5)  # an adapter loaded into a slot
        graph.replay()
        torch.testing.assert_close(out.float(), reference(y, x, a, b, slots, slices),
                                   atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("t", [64, 300])
def test_lora_linear_with_the_slots_a_rows_in_the_weight(t):
    """A LoRA layer's weight holds every slot's A after W's rows. Up to EXT_MAX_TOKENS one
    GEMM over all of it gives y and every slot's u (the expand reads each token's own at a
    slot stride); above, the GEMM over W and the shrink kernel. Both equal the reference;
    replayed in a captured graph with new inputs and slots, each equals its eager self."""
    torch.manual_seed(t)
    k, slices = 2048, (512, 128, 128)
    a, b = stacks(16, k, slices)
    weight = torch.randn(sum(slices), k, device="cuda", dtype=torch.bfloat16) / k**0.5
    ext = torch.cat([weight, a.reshape(-1, k)])
    w = LoRAWeights(ext[sum(slices):].view(a.shape), b, slices)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    slots = torch.randint(-1, NUM_SLOTS, (t,), dtype=torch.int32)
    lora = lora_inputs(slots)
    with forward_context(ForwardContext(attn=None, lora=lora)):
        got = lora_linear(x, ext, None, w)
        want = reference(F.linear(x, weight), x, a, b, slots, slices)
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile before capture
            lora_linear(x, ext, None, w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = lora_linear(x, ext, None, w)
        for trial in range(3):
            new = lora_inputs(torch.randint(-1, NUM_SLOTS, (t,), dtype=torch.int32))
            for buf, src in zip((lora.token_slot, lora.order, lora.sorted_slot),
                                (new.token_slot, new.order, new.sorted_slot)):
                buf.copy_(src)
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert torch.equal(out, lora_linear(x, ext, None, w)), trial


@pytest.fixture(scope="module")
def gpu_adapters(gpu_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-adapters")
    specs = [(ATTN, 8), (MLP, 16), (ATTN + MLP, 64), (ATTN + MLP, 16)]
    return [make_adapter(root / f"a{i}", targets, rank, i, gpu_llama)
            for i, (targets, rank) in enumerate(specs)]


def lora_worker(ckpt, adapters, mode: str, dtype: str) -> Worker:
    cfg = ServeConfig(
        model=str(ckpt), device="cuda", dtype=dtype,
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=128),
        graph=GraphConfig(mode=mode, prefill_graph="full"),
        lora=LoRAConfig(max_loras=len(adapters), max_lora_rank=64),
    )
    w = loaded_worker(cfg, 256, capture=True)
    for slot, path in enumerate(adapters):
        w.load_lora(slot, str(path))
    return w


@pytest.mark.parametrize("decode", [True, False])
def test_graph_logits_equal_eager_with_mixed_adapters(gpu_llama, gpu_adapters, decode):
    g = lora_worker(gpu_llama, gpu_adapters, "graph", "bfloat16")
    e = lora_worker(gpu_llama, gpu_adapters, "eager", "bfloat16")
    rng = random.Random(int(decode))
    for trial in range(6):
        seqs, block = [], 0
        for i in range(rng.randrange(1, 12)):
            ctx, n = rng.randrange(0, 200), 1 if decode else rng.randrange(2, 10)
            nb = -(-(ctx + n) // 16)
            seqs.append(SeqChunk(i, [rng.randrange(3, 512) for _ in range(n)], ctx,
                                 list(range(block, block + nb)), True,
                                 lora_slot=rng.randrange(-1, len(gpu_adapters))))
            block += nb
        randomise_caches((g, e), trial)
        plan = StepPlan(0, seqs)
        torch.testing.assert_close(g.executor.logits(plan), e.executor.logits(plan),
                                   atol=3e-2, rtol=3e-2)
    for w in (g, e):
        w.shutdown()


def test_greedy_tokens_graph_equal_eager_with_mixed_adapters(gpu_llama, gpu_adapters):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 150))] for _ in range(16)]
    outs = []
    for mode in ("graph", "eager"):
        w = lora_worker(gpu_llama, gpu_adapters, mode, "float32")
        seqs = serve_in_process(w.cfg, w, [
            Sequence(i, p, SamplingParams(max_tokens=16, ignore_eos=True),
                     adapter_id=i % 5, lora_slot=i % 5 - 1) for i, p in enumerate(prompts)],
            256)
        outs.append([s.output_token_ids for s in seqs])
        w.shutdown()
    assert outs[0] == outs[1]


def test_promotions_on_the_step_path_equal_preloaded_slots(gpu_llama, gpu_adapters):
    """2 slots for 4 adapters, promoted by the steps' messages (pinned slot images copied
    on the stream while a step is in flight, no flush): the greedy tokens of the same
    requests with every adapter preloaded in its own slot."""
    prompts = [[t % 509 + 3 for t in p] for p in PROMPTS]

    def seqs(preloaded: bool) -> list[Sequence]:
        return [Sequence(i, p, SamplingParams(max_tokens=8, ignore_eos=True),
                         adapter_id=s + 1 if preloaded else 0,
                         lora_slot=s if preloaded else -1)
                for i, (p, s) in enumerate(zip(prompts, SLOTS))]

    ref = lora_worker(gpu_llama, gpu_adapters, "graph", "float32")
    want = [s.output_token_ids for s in serve_in_process(ref.cfg, ref, seqs(True), 256)]
    ref.shutdown()
    w = loaded_worker(msgspec.structs.replace(
        ref.cfg, lora=LoRAConfig(max_loras=2, max_lora_rank=64)), 256, capture=True)
    got = seqs(False)
    paths = [str(gpu_adapters[s]) if s >= 0 else None for s in SLOTS]
    loads_in_flight, moves = serve_with_promotions(w, got, paths, ARRIVALS, 256)
    w.shutdown()
    assert [s.output_token_ids for s in got] == want
    assert sum(loads_in_flight) >= 2 and moves["warm", "hot"] >= 1
