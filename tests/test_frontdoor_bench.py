"""bench/frontdoor.py's null engines behind the real coordinator and the real client-side
streams: every stream gets exactly its tokens, in order, and the counts add up on both
sides. It keeps the benchmark from rotting; its figures are in bench/RESULTS.md."""

from __future__ import annotations

import asyncio
import math

from bench.frontdoor import parser, run_point, start_null
from raygraph.client.streams import ReplicaStreams
from raygraph.protocol import SamplingParams, replica_of


def test_null_engines_stream_every_token_in_order(ray_session) -> None:
    async def run() -> None:
        coord, _ = await start_null(2, step_ms=2.0, name="frontdoor-test")
        try:
            hub = ReplicaStreams.from_info(coord, await coord.describe.remote())
            lengths = [1, 5, 17, 3, 9, 12]
            rids = await asyncio.gather(*(hub.open([i + 3] * 20, SamplingParams(max_tokens=n))
                                          for i, n in enumerate(lengths)))

            async def read(rid: int) -> tuple[list[int], str | None, bool]:
                tokens: list[int] = []
                while True:
                    d = await hub.next(rid)
                    tokens += d.token_ids
                    if d.finish_reason is not None:
                        return tokens, d.finish_reason, d.timing is not None

            outs = await asyncio.gather(*(read(r) for r in rids))
            assert outs == [(list(range(n)), "length", True) for n in lengths]
            assert {replica_of(r) for r in rids} == {0, 1}  # the router used both
            assert hub.router.load == [0, 0] and not hub.costs
            stats = await coord.stats.remote()  # summed over the replicas
            assert (stats["tokens_generated"], stats["running"]) == (sum(lengths), 0)
            (one, two) = await coord.generate.remote([[5] * 4, [6] * 4], {"max_tokens": 4})
            assert one.token_ids == two.token_ids == [0, 1, 2, 3]
            stats = await coord.stats.remote()
            assert stats["tokens_generated"] == sum(lengths) + 8
            rid = await hub.open([9] * 20, SamplingParams(max_tokens=10**6))
            assert (await hub.next(rid)).token_ids[0] == 0
            hub.cancel([rid])
            for _ in range(100):
                stats = await coord.stats.remote()
                if stats["running"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert stats["running"] == 0  # the cancel stopped it on its engine
        finally:
            await coord.shutdown.remote()

    asyncio.run(run())


def test_a_bench_point_delivers_every_token(ray_session) -> None:
    a = parser().parse_args(["--streams-per-replica", "4", "--input-len", "16",
                             "--output-len", "8", "--step-ms", "2", "--seconds", "0.1"])
    row = asyncio.run(run_point(a, 2, math.inf))
    assert row["failed"] == 0 and row["requests"] == a.num_prompts >= 8
    assert row["output_tokens"] == 8 * row["requests"]
    assert row["ideal_tok_s"] == 8 * 500 and row["ratio"] > 0
    assert row["front_cpu_s"] > 0 and row["engine_step_ms"] >= 2
