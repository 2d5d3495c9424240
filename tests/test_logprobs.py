"""Logprobs through the served loop's logic (deltas, tokens fed on the device, replies one
step late) with the default model: a greedy token's logprob equals log_softmax of HF
transformers' logits, the top alternatives are sorted and start with the chosen token, and
rows that did not ask get nothing."""

from __future__ import annotations

import math

import pytest
import torch

from raygraph.config import DEFAULT_MODEL, CacheConfig, SchedulerConfig, ServeConfig
from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler
from raygraph.engine.sequence import Sequence
from raygraph.protocol import SamplingParams
from raygraph.worker.worker import Worker
from tests.conftest import dtype_tol, loaded_worker

PROMPTS = [[0, 464, 1330, 2643], [0, 317, 1398], [0, 383, 329, 2643, 12, 90, 31]]


@pytest.fixture(scope="module")
def worker():
    cfg = ServeConfig(model=DEFAULT_MODEL, device="cpu",
                      cache=CacheConfig(block_size=4, num_blocks=64),
                      scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8))
    return loaded_worker(cfg, 64)


def hf_logprobs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of HF's float32 logits at each output position: [len(tokens), vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : -1].log_softmax(-1)


def run(worker: Worker, params: list[SamplingParams], num_blocks: int = 64) -> list[Sequence]:
    sched = Scheduler(PagePool(num_blocks, 4), 8, 8, 512, (1,))
    seqs = [Sequence(i, p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    for s in seqs:
        sched.add(s)
    run_to_completion(EngineCore([sched], None, ep=False), local_dispatch(worker))
    return seqs


@pytest.mark.parametrize("num_blocks", [64, 5])  # 5: sequences are preempted and recomputed
def test_greedy_logprobs_equal_hf_log_softmax(worker, num_blocks):
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=5, ignore_eos=True),  # did not ask
              SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)]
    seqs = run(worker, params, num_blocks)
    if num_blocks == 5:
        assert sum(s.num_preemptions for s in seqs) > 0
    assert seqs[1].logprobs == []
    for s in (seqs[0], seqs[2]):
        k = s.params.logprobs
        assert len(s.logprobs) == len(s.output_token_ids) == 6
        ref = hf_logprobs(s.prompt_token_ids, s.output_token_ids)
        atol, rtol = dtype_tol(torch.float32, ref.abs().max().item())
        for pos, (token, lp) in enumerate(zip(s.output_token_ids, s.logprobs)):
            assert token == ref[pos].argmax().item()
            assert math.isclose(lp.logprob, ref[pos, token].item(), rel_tol=rtol, abs_tol=atol)
            assert len(lp.top_ids) == len(lp.top_logprobs) == k
            if k:
                assert lp.top_ids[0] == token and lp.top_logprobs[0] == lp.logprob
                assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
                want = ref[pos].topk(k)
                assert lp.top_ids == want.indices.tolist()
                torch.testing.assert_close(torch.tensor(lp.top_logprobs), want.values,
                                           atol=atol, rtol=rtol)


def test_sampled_rows_get_the_raw_logprob_of_the_drawn_token(worker):
    params = [SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=7,
                             logprobs=2) for _ in PROMPTS]
    seqs = run(worker, params)
    for s in seqs:
        ref = hf_logprobs(s.prompt_token_ids, s.output_token_ids)
        atol, rtol = dtype_tol(torch.float32, ref.abs().max().item())
        for pos, (token, lp) in enumerate(zip(s.output_token_ids, s.logprobs)):
            assert math.isclose(lp.logprob, ref[pos, token].item(), rel_tol=rtol, abs_tol=atol)
            assert lp.top_ids == ref[pos].topk(2).indices.tolist()
