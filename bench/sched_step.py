"""The scheduler's host time in a decode step, on a CPU: no model, no Ray.

    python -m bench.sched_step [--seqs 256] [--steps 384] [--block-size 16] [--prompt-len 8]
                               [--repeats 5] [--no-prefix-caching] [--profile]

EngineCore drives one scheduler (built by EngineCore.from_config, as the coordinator builds
it) against a fake pipelined worker that replies one step late with a token per sampling
row, as Worker.run does. `--seqs` sequences are admitted and prefilled, then `--steps` steady
decode steps are timed: schedule, encode (msgpack StepDelta) and apply (Scheduler.update),
per step; the best of --repeats runs. A new KV block every block_size steps per sequence is
part of it. Then every sequence finishes at once: finish_us_per_seq is those last steps'
time per sequence, where its blocks are released (with prefix caching, its output blocks
are keyed then). --profile: cProfile's share of the timed steps spent inside the page pool
(raygraph/engine/pages.py).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import msgspec

from raygraph.config import DEFAULT_MODEL, CacheConfig, ModelConfig, SchedulerConfig, ServeConfig
from raygraph.engine.core import EngineCore
from raygraph.engine.sequence import Sequence
from raygraph.protocol import SamplingParams, StepDelta, StepOutput


def fake_worker():
    """Worker.run's contract: the reply to a step carries the previous step's tokens."""
    dec, pending = msgspec.msgpack.Decoder(StepDelta), [None]

    def dispatch(msgs: list[bytes]) -> list[StepOutput]:
        (msg,) = msgs
        reply, pending[0] = pending[0], None
        if msg:
            d = dec.decode(msg)
            n = len(d.feed) + sum(c.sample for c in d.chunks)
            pending[0] = StepOutput(d.step_id, [7 + i % 50 for i in range(n)])
        return [reply or StepOutput(-1, [])]

    return dispatch


def build(a: argparse.Namespace) -> EngineCore:
    blocks = a.seqs * -(-(a.prompt_len + a.steps + 8) // a.block_size) + 16
    cache = CacheConfig(block_size=a.block_size, num_blocks=blocks)
    if a.no_prefix_caching:
        cache = msgspec.structs.replace(cache, enable_prefix_caching=False)
    cfg = ServeConfig(cache=cache, scheduler=SchedulerConfig(
        max_num_seqs=a.seqs, max_num_batched_tokens=max(2048, a.seqs * a.prompt_len),
        max_model_len=a.prompt_len + a.steps + 64))
    return EngineCore.from_config(cfg, ModelConfig.from_pretrained(DEFAULT_MODEL), blocks)


def run(a: argparse.Namespace, profile: cProfile.Profile | None = None) -> dict:
    core = build(a)
    (sched,) = core.schedulers
    params = SamplingParams(max_tokens=a.steps + 8, ignore_eos=True, temperature=0.0)
    for i in range(a.seqs):
        sched.add(Sequence(i, [3 + (i * 31 + j) % 4000 for j in range(a.prompt_len)], params))
    dispatch = fake_worker()
    for _ in range(3):  # prefill, then the overlapped order settles
        core.step(dispatch)
    sched_s = enc_s = apply_s = 0.0
    if profile is not None:
        profile.enable()
    for _ in range(a.steps):
        t0 = time.perf_counter()
        planned = core.schedule()
        t1 = time.perf_counter()
        msgs = core.encode(*planned)
        t2 = time.perf_counter()
        core.apply(dispatch(msgs))
        core.in_flight = planned[0]
        t3 = time.perf_counter()
        sched_s += t1 - t0
        enc_s += t2 - t1
        apply_s += t3 - t2
        assert planned[0][0].decode and planned[0][0].num_seqs == a.seqs
    if profile is not None:
        profile.disable()
    t0 = time.perf_counter()  # the rest: every sequence finishes, its blocks are released
    while core.step(dispatch) is not None:
        pass
    end_s = time.perf_counter() - t0
    n = a.steps
    return {"schedule_us": 1e6 * sched_s / n, "encode_us": 1e6 * enc_s / n,
            "apply_us": 1e6 * apply_s / n, "schedule_apply_us": 1e6 * (sched_s + apply_s) / n,
            "finish_us_per_seq": 1e6 * end_s / a.seqs}


def pool_share(a: argparse.Namespace) -> dict:
    """cProfile's time inside engine/pages.py over the whole timed loop (profiled: slower)."""
    prof = cProfile.Profile()
    run(a, prof)
    st = pstats.Stats(prof)
    total = st.total_tt
    in_pool = sum(v[2] for k, v in st.stats.items() if k[0].endswith("engine/pages.py"))
    in_pages = sum(v[2] for k, v in st.stats.items() if k[0].endswith("memory/pages.py"))
    return {"profiled_pool_share_of_loop": round((in_pool + in_pages) / total, 4)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    runs = [run(a) for _ in range(a.repeats)]
    best = {k: round(min(r[k] for r in runs), 2) for k in runs[0]}
    row = {"seqs": a.seqs, "steps": a.steps, "block_size": a.block_size,
           "prefix_caching": not a.no_prefix_caching} | best
    if a.profile:
        row |= pool_share(a)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
