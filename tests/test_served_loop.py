"""The served loop's logic with a real model, in one process: deltas, tokens fed on the
device, replies one step late, stop conditions applied late. Greedy tokens must equal HF
transformers whatever the batching, chunking and preemption; seeded sampling must equal the
same requests run one at a time."""

from __future__ import annotations

import pytest

from raygraph.config import CacheConfig, SchedulerConfig, ServeConfig
from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler
from raygraph.engine.sequence import Sequence
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
        num_blocks: int = 64, caching: bool = True, max_num_seqs: int = 8) -> list[Sequence]:
    sched = Scheduler(PagePool(num_blocks, 4), max_num_seqs, 12, 512, (2,),
                      prefix_caching=caching)
    seqs = [Sequence(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for s in seqs:
        sched.add(s)
    run_to_completion(EngineCore([sched], None, ep=False), local_dispatch(worker))
    assert sched.pool.num_pinned == 0 and not sched.running and not sched.waiting
    assert sched.pool.num_free == num_blocks or caching
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


# a shared 10-token head (two full blocks and two tokens), prompts that are prefixes of
# others, one repeated whole (fully cached: its last block is computed again)
HEAD = [17, 3, 250, 8, 64, 99, 12, 41, 77, 6]
SHARED = [HEAD + [5, 9], HEAD, HEAD + [5, 9], HEAD[:8], HEAD + [5, 9, 11, 13, 40],
          HEAD[:4] + [100, 101], HEAD + [30, 31, 32]]


@pytest.mark.parametrize(("num_blocks", "max_num_seqs"), [(64, 3), (8, 4)])  # 8: preempted
def test_prefix_caching_gives_the_greedy_tokens_of_caching_off(worker, tiny_llama, num_blocks,
                                                               max_num_seqs):
    """Sequences admitted a few at a time reuse the blocks of those before them, running or
    finished; under pressure they are preempted and recompute from what is still cached."""
    params = [SamplingParams(max_tokens=6 + i % 3, ignore_eos=True) for i in range(7)]
    on = run(worker, SHARED, params, num_blocks, caching=True, max_num_seqs=max_num_seqs)
    off = run(worker, SHARED, params, num_blocks, caching=False, max_num_seqs=max_num_seqs)
    ref = hf_greedy(tiny_llama, SHARED, 8)
    assert [s.output_token_ids for s in on] == [s.output_token_ids for s in off]
    for s, r in zip(on, ref):
        assert s.output_token_ids == r[: s.params.max_tokens]
    assert sum(s.num_cached_tokens for s in on) >= 4 * 8
    assert all(s.num_cached_tokens == 0 for s in off)
    if num_blocks == 8:
        assert sum(s.num_preemptions for s in on) > 0


def test_device_time_is_counted_by_the_phase_of_the_step_it_ran(tiny_llama):
    """A step's tokens (and its device time) come back a step late: the time is put on the
    phase of the step that ran, so every phase's steps returned equal its steps sent."""
    cfg = ServeConfig(model=str(tiny_llama), device="cpu",
                      cache=CacheConfig(block_size=4, num_blocks=64),
                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    worker = loaded_worker(cfg, 64, capture=True)
    core = EngineCore.from_config(cfg, worker.model_cfg, 64)
    core.add([Sequence(i, p, SamplingParams(max_tokens=5, ignore_eos=True))
              for i, p in enumerate(PROMPTS[:3])])
    run_to_completion(core, local_dispatch(worker))
    assert core.device_steps == core.phase_steps
    assert set(core.device_steps) == {"prefill", "decode"}
    assert all(core.device_s[k] > 0 for k in core.device_steps)
