"""GPU: sleep releases the graph pool and the KV cache (level 1) and the weights too (level
2), as device free memory shows; wake maps them at the same addresses, fast, and greedy
tokens after wake equal those before, with no recapture. The KV cache comes back with
unspecified contents: requests were drained, and attention reads only what it wrote.

The graph worker wakes staged: wake_up returns with the KV cache's first 1024 blocks (32 MiB)
mapped, greedy tokens run from them at once while a thread maps the rest; the eager worker
wakes whole (CacheConfig.staged_wake off)."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch

from bench.sleep import greedy_tokens, wait_whole_kv
from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.worker.worker import Worker
from tests.conftest import make_checkpoint

pytestmark = pytest.mark.gpu

MiB = 1 << 20
BLOCKS = 8192  # 32 KiB a block: a 256 MiB KV cache
FIRST = 1024  # blocks a staged wake maps before it returns (32 MiB)
PROMPTS = [[1, 17, 300, 4000, 52], [1, 9, 9, 9], [1, 2000, 3000, 100, 7, 8, 5]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """~20M parameters (40 MiB in bf16): weights big enough to show in mem_get_info."""
    return make_checkpoint(tmp_path_factory.mktemp("sleep-llama"), "LlamaForCausalLM",
                           vocab_size=4096, hidden_size=512, intermediate_size=2048,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


def make_worker(ckpt, mode: str = "graph", staged: bool = True) -> Worker:
    cfg = ServeConfig(
        model=str(ckpt), device="cuda", dtype="bfloat16",
        cache=CacheConfig(block_size=16, num_blocks=BLOCKS, staged_wake=staged,
                          wake_first_bytes=FIRST * 32 * 1024),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256,
                                  max_model_len=512),
        graph=GraphConfig(mode=mode, pool="vmm"),
    )
    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(BLOCKS)
    w.capture_all()
    return w


@pytest.fixture(scope="module")
def worker(ckpt):
    w = make_worker(ckpt)
    yield w
    w.shutdown()


def free_bytes() -> int:
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def addresses(w: Worker) -> list[int]:
    layers = w.model.attention_layers()
    return ([t.data_ptr() for layer in layers for t in (layer.k_cache, layer.v_cache)]
            + [p.data_ptr() for p in w.model.parameters()])


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wake_serves_the_same_tokens(worker, level):
    w = worker
    before = greedy_tokens(w, PROMPTS, 16)
    graphs, ptrs = dict(w.executor.graphs), addresses(w)
    assert graphs, "the schedule was captured"
    graph_held = w.executor.pool.held_bytes()
    m = w.memory_stats()
    kv_held, weights_held = m.kv_cache_vmm.physical_bytes, m.weight_vmm.physical_bytes
    assert graph_held > 0 and kv_held >= w.kv_cache_bytes >= 200 * MiB
    assert weights_held >= w.weight_bytes >= 30 * MiB
    expected = graph_held + kv_held + (weights_held if level == 2 else 0)

    free_awake = free_bytes()
    t0 = time.perf_counter()
    slept = w.sleep(level)
    sleep_s = time.perf_counter() - t0
    free_asleep = free_bytes()
    assert (slept.graph_bytes, slept.kv_cache_bytes) == (graph_held, kv_held)
    assert slept.weight_bytes == (weights_held if level == 2 else 0)
    released = free_asleep - free_awake
    # the driver gives back exactly the chunks; allow for its own bookkeeping
    assert expected - 8 * MiB <= released <= expected + 64 * MiB, (released, expected)
    m = w.memory_stats()
    assert m.sleep_level == level and m.graph.held_bytes == 0
    assert m.kv_cache_vmm.physical_bytes == 0
    assert (m.weight_vmm.physical_bytes == 0) == (level == 2)

    t0 = time.perf_counter()
    woke = w.wake_up()
    wake_s = time.perf_counter() - t0
    assert FIRST <= woke.kv_blocks_ready < BLOCKS  # staged: the first slice only
    assert woke.total_bytes == expected - kv_held + woke.kv_cache_bytes
    assert woke.kv_cache_bytes < kv_held // 2
    after = greedy_tokens(w, PROMPTS, 16)  # from the first slice, while the rest maps
    tokens_ready = w.kv_blocks_ready()
    whole_s = wait_whole_kv(w, t0)
    free_woken = free_bytes()
    assert w.memory_stats().kv_cache_vmm.physical_bytes == kv_held
    assert abs(free_woken - free_awake) <= 16 * MiB
    assert addresses(w) == ptrs
    assert all(w.executor.graphs[k] is r for k, r in graphs.items())  # no recapture
    assert after == before
    assert greedy_tokens(w, PROMPTS, 16) == before  # and from the whole cache
    print(json.dumps({"level": level, "released_mib": round(released / MiB, 1),
                      "expected_mib": round(expected / MiB, 1), "sleep_s": round(sleep_s, 4),
                      "wake_s": round(wake_s, 4), "kv_blocks_ready": woke.kv_blocks_ready,
                      "kv_blocks": BLOCKS, "first_slice_mib": round(woke.kv_cache_bytes / MiB, 1),
                      "kv_blocks_ready_at_tokens_done": tokens_ready,
                      "kv_whole_s": round(whole_s, 4), "tokens_equal": after == before}))
    assert wake_s < (0.1 if level == 1 else 1.0)


def test_eager_executor_sleeps_too(ckpt):
    w = make_worker(ckpt, mode="eager", staged=False)
    before = greedy_tokens(w, PROMPTS, 8)
    free_awake = free_bytes()
    slept = w.sleep(2)
    assert slept.graph_bytes == 0 and slept.kv_cache_bytes > 0 and slept.weight_bytes > 0
    assert free_bytes() - free_awake >= slept.total_bytes - 8 * MiB
    woke = w.wake_up()
    assert woke.kv_blocks_ready == BLOCKS and woke.kv_cache_bytes == slept.kv_cache_bytes
    assert greedy_tokens(w, PROMPTS, 8) == before
    w.shutdown()
