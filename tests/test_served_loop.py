"""The served loop's logic with a real model, in one process: deltas, tokens fed on the
device, replies one step late, stop conditions applied late. Greedy tokens must equal HF
transformers whatever the batching, chunking and preemption; seeded sampling must equal the
same requests run one at a time."""

from __future__ import annotations

import pytest

from raygraph.cluster.engine import EngineCore, local_dispatch, run_to_completion
from raygraph.cluster.scheduler import Scheduler, Sequence
from raygraph.config import CacheConfig, SchedulerConfig, ServeConfig
from raygraph.memory.pages import BlockPool
from raygraph.protocol import SamplingParams
from raygraph.worker.worker import Worker
from tests.conftest import loaded_worker
from tests.hf_ref import hf_greedy


@pytest.fixture(scope="module")
def worker(tiny_llama):
    cfg = ServeConfig(model=str(tiny_llama), device="cpu",
                      cache=CacheConfig(block_size=4, num_blocks=64),
                      scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=12))
    return loaded_worker(cfg, 64)


def run(worker: Worker, prompts: list[list[int]], params: list[SamplingParams],
        num_blocks: int = 64) -> list[Sequence]:
    sched = Scheduler(BlockPool(num_blocks, 4), 8, 12, 512, (2,))
    seqs = [Sequence(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for s in seqs:
        sched.add(s)
    run_to_completion(EngineCore([sched], None, ep=False), local_dispatch(worker))
    assert sched.pool.num_free == num_blocks and not sched.running and not sched.waiting
    return seqs


PROMPTS = [[5 + i, 9, 11, 13 + i, 7] * (1 + i % 3) for i in range(6)]


@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: sequences are preempted
def test_greedy_tokens_equal_hf_with_chunking_and_preemption(worker, tiny_llama, num_blocks):
    params = [SamplingParams(max_tokens=6 + i, ignore_eos=True) for i in range(6)]
    seqs = run(worker, PROMPTS, params, num_blocks)
    ref = hf_greedy(tiny_llama, PROMPTS, 11)
    for s, r in zip(seqs, ref):
        assert s.output_token_ids == r[: s.params.max_tokens]  # max_tokens lands exactly
    if num_blocks == 14:
        assert sum(s.num_preemptions for s in seqs) > 0


def test_a_stop_token_ends_the_sequence_with_nothing_after_it(worker, tiny_llama):
    (ref,) = hf_greedy(tiny_llama, [PROMPTS[2]], 10)
    stop = ref[3]
    (s,) = run(worker, [PROMPTS[2]], [SamplingParams(max_tokens=10, ignore_eos=True,
                                                     stop_token_ids=[stop])])
    assert s.finish_reason == "stop" and s.output_token_ids == ref[: ref.index(stop) + 1]


def test_seeded_sampling_does_not_depend_on_the_batch(worker):
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=100 + i)
              for i in range(6)]
    together = [s.output_token_ids for s in run(worker, PROMPTS, params)]
    alone = [run(worker, [p], [sp])[0].output_token_ids for p, sp in zip(PROMPTS, params)]
    assert together == alone
