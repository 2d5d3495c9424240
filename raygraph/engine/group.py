"""The worker group: its placement and actors, and its hot path, one Ray Compiled Graph
over every worker's `run`.

A plain actor call per step costs ~1-2 ms (DESIGN.md); a compiled graph moves the message
over shared-memory channels in ~0.1 ms. Steps, flushes and method calls (lockstep capture,
stats) all travel on it, so nothing is torn down to capture a key first seen at run time.
While the graph is up the actors run its loop: plain `.remote()` calls to them would wait.
Its input channels ring a doorbell (engine/doorbell.py), so an idle worker sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import msgspec
import ray
from ray.dag import InputNode, MultiOutputNode
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raygraph.config import ParallelConfig, ServeConfig
from raygraph.engine.doorbell import DoorbellType
from raygraph.protocol import StepOutput, WorkerCall, WorkerInfo
from raygraph.worker.actor import WorkerActor

log = logging.getLogger("raygraph.coordinator")

OUTPUT = msgspec.msgpack.Decoder(StepOutput)


async def place_workers(cfg: ServeConfig, node: str | None = None, timeout: float = 60) -> Any:
    """The placement group of one replica: a bundle per rank (a GPU and a CPU, or a CPU),
    packed on one node, `node` if it has room. Its owner (the coordinator) removes it when
    the replica goes: an actor's placement group outlives the actor otherwise."""
    world = cfg.parallel.world_size
    bundle = {"CPU": 1, "GPU": 1} if cfg.device == "cuda" else {"CPU": 1}
    pg = placement_group([bundle] * world, strategy="STRICT_PACK", _soft_target_node_id=node)
    try:
        await asyncio.wait_for(pg.ready(), timeout=timeout)
    except asyncio.TimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"could not place {world} workers ({bundle} each) within "
                           f"{timeout:.0f} s; cluster resources: {ray.cluster_resources()}"
                           ) from None
    return pg


class GroupTimeout(RuntimeError):
    """The group did not answer within the timeout (a rank hangs, or is blocked in a
    collective because another one died)."""


# Passed to every worker: NVLink multicast must stay off on shared hosts.
FORWARDED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                 "RAYGRAPH_CPU_THREADS", "PYTHONPATH")


class WorkerGroup:
    def __init__(self, workers: list[Any], parallel: ParallelConfig) -> None:
        self.workers = workers
        self.parallel = parallel
        # the rank that reports each DP group's tokens: its first TP rank
        self.reporters = [g * parallel.tp for g in range(parallel.dp)]
        self._dag: Any = None

    @staticmethod
    async def start(cfg: ServeConfig, pg: Any, reporter: Any = None
                    ) -> tuple[WorkerGroup, list[WorkerInfo]]:
        """Start one worker per rank in its bundle of `pg` (place_workers; the caller owns
        it), form the process group and load the model; rank 0 reports load progress to
        `reporter`."""
        world = cfg.parallel.world_size
        gpu = cfg.device == "cuda"
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        actor = ray.remote(WorkerActor)
        workers = [
            actor.options(
                num_cpus=1, num_gpus=1 if gpu else 0, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i),
            ).remote(cfg, i)
            for i in range(world)
        ]
        group = WorkerGroup(workers, cfg.parallel)
        try:
            addr = await workers[0].address.remote()
            log.info("loading %s on %d %s worker(s) (tp=%d)", cfg.model, world, cfg.device,
                     cfg.parallel.tp)
            infos = await asyncio.gather(*(w.load.remote(addr, reporter if r == 0 else None)
                                           for r, w in enumerate(workers)))
        except BaseException:
            group.stop()
            raise
        return group, list(infos)

    def stop(self) -> None:
        """Kill the workers (one may hang in a collective), then drop the graph; the
        placement stays, for the next group."""
        for w in self.workers:
            ray.kill(w)
        self.teardown()

    def _compiled(self) -> Any:
        if self._dag is None:
            with InputNode() as inp:
                for g in range(self.parallel.dp):
                    inp[g].type_hint = DoorbellType()
                outs = [w.run.bind(inp[self.parallel.dp_rank(r)])
                        for r, w in enumerate(self.workers)]
                dag = MultiOutputNode(outs)
            self._dag = dag.experimental_compile(_max_inflight_executions=2)
            log.info("compiled the step graph over %d worker(s)", len(self.workers))
        return self._dag

    def _execute(self, per_group: list[Any], timeout: float) -> list[Any]:
        ref = self._compiled().execute(*per_group)
        try:
            return ray.get(ref, timeout=timeout)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayChannelTimeoutError):
            raise GroupTimeout(f"the worker group did not answer within {timeout:.0f}s "
                               "(a rank hangs or is blocked in a collective)") from None

    def step(self, deltas: list[bytes], timeout: float) -> list[StepOutput]:
        """Send one step (a msgpack StepDelta per DP group, b"" to flush); returns each
        group's tokens of the step before it, with the LoRA loads of all its ranks."""
        outs = self._execute(deltas, timeout)
        got = [OUTPUT.decode(outs[r]) for r in self.reporters]
        for r, out in enumerate(outs):  # other ranks answer only when the step loaded slots
            if out is not None and self.parallel.tp_rank(r):
                g = self.parallel.dp_rank(r)
                got[g] = msgspec.structs.replace(
                    got[g], lora_loads=got[g].lora_loads + OUTPUT.decode(out).lora_loads)
        return got

    def call(self, method: str, *args: Any, timeout: float, only: int = -1) -> list[Any]:
        """A worker method on every rank (or `only` that one); one result per rank."""
        call = WorkerCall(method, args, only)
        return self._execute([call] * self.parallel.dp, timeout)

    @property
    def compiled(self) -> bool:
        return self._dag is not None

    def teardown(self) -> None:
        if self._dag is not None:
            dag, self._dag = self._dag, None
            try:
                dag.teardown()
            except Exception as e:  # dead actors: nothing left to stop
                log.warning("compiled graph teardown: %s", e)
