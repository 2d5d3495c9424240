"""The GPU's kernels end to end on CPU: a tiny model served through the graph executor's
buffers and buckets (eager backend) with every op on the Triton kernels, run by Triton's
interpreter, gives the greedy tokens of the torch reference path. The decode cascade is on,
under prefix caching, so Llama's decode steps read a prefix their sequences share; Mistral
runs the kernels' sliding window (no cascade there), Qwen3 the per-head q/k norms."""

from __future__ import annotations

import pytest

from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.engine.sequence import Sequence
from raygraph.graph import inputs
from raygraph.model import ops
from raygraph.protocol import SamplingParams
from tests.conftest import cascade_lengths, loaded_worker, make_checkpoint, serve_in_process

NUM_BLOCKS = 96
HEAD = [17, 3, 250, 8, 64, 99, 12, 41, 77, 6, 5, 9, 11, 13, 40, 30, 31, 32, 7, 21]  # 5 blocks


SLOW = pytest.mark.slow  # the kernels' logic is the same; each model adds minutes on CPU


@pytest.fixture(params=["llama", pytest.param("mistral", marks=SLOW),
                        pytest.param("qwen3", marks=SLOW)])
def ckpt(request, tiny_llama, tmp_path):
    if request.param == "llama":
        return request.param, tiny_llama
    if request.param == "mistral":  # a window shorter than the prompts
        return request.param, make_checkpoint(tmp_path / "m", "MistralForCausalLM",
                                              sliding_window=8)
    return request.param, make_checkpoint(tmp_path / "q", "Qwen3ForCausalLM", head_dim=16,
                                          random_norms=True)


def served(model) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of 9 prompts behind HEAD, and the shared length each step's cascade
    graph read (0: the plain graph ran)."""
    cfg = ServeConfig(model=str(model), device="cpu", dtype="float32",
                      cache=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
                      scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                                max_model_len=128),
                      graph=GraphConfig(decode_sizes=[10], prefill_sizes=[64],
                                        decode_cascade=True))
    # one bucket each (few runs); the decode bucket: 9 sequences and a padding row
    worker = loaded_worker(cfg, NUM_BLOCKS, capture=True)
    shared = cascade_lengths(worker.executor)
    seqs = serve_in_process(cfg, worker, [
        Sequence(i, HEAD + [100 + i] * (1 + i % 3), SamplingParams(max_tokens=3,
                                                                  ignore_eos=True))
        for i in range(9)], NUM_BLOCKS)
    worker.shutdown()
    return [s.output_token_ids for s in seqs], shared


def test_triton_kernels_serve_the_reference_greedy_tokens(interpreted, ckpt, monkeypatch):
    kernels = interpreted("triton_attention")  # skips where the interpreter is not in use
    name, model = ckpt
    monkeypatch.setattr(inputs, "CASCADE_MIN_TOKENS", 16)  # a 20-token head is enough here
    # the cascade's prefix splits fill 32 programs, not a GPU's 256 (the interpreter runs
    # every program, and a 20-token prefix leaves most of them empty)
    monkeypatch.setattr(kernels, "FILL_PROGRAMS", 32)
    want, ref_shared = served(model)
    monkeypatch.setattr(ops, "kernels", lambda x: True)
    got, shared = served(model)
    assert got == want
    assert max(shared) == max(ref_shared) == 20  # decode steps ran the cascade graph
