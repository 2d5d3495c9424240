"""The replicas' lifecycle, in the coordinator's process: where each engine runs (its
placement group on a node with room), starting it, noticing it die and starting it again
where the resources are, and scaling the count at run time. The router is told which
replicas serve."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import ray
from ray._private.state import available_resources_per_node
from ray.exceptions import RayActorError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raygraph.coordinator.router import Router
from raygraph.engine.engine import Engine
from raygraph.engine.group import place_workers
from raygraph.errors import BadRequest, last_line
from raygraph.protocol import ROUTES_REFRESH_S, ReplicaState

log = logging.getLogger("raygraph.coordinator")

RETRY_S = 5.0  # a replica that could not start is tried again this often


class ReplicaSet:
    def __init__(self, cfg: Any, router: Router, engine_cls: type | None = None) -> None:
        self.cfg = cfg
        self.router = router
        self.engine_cls = engine_cls or Engine
        n = cfg.replica.replicas
        self.states = [ReplicaState(r, None, "starting") for r in range(n)]
        self.restarts = 0  # engines started again after theirs died
        self._pgs: dict[int, Any] = {}  # replica -> its placement group
        self._starting = [asyncio.Lock() for _ in range(n)]
        self._watchers: list[asyncio.Task | None] = [None] * n
        self.stopping = False
        self.first_start = True

    async def start(self) -> None:
        """Start every replica and wait until each serves; the first failure is raised."""
        self.first_start = True
        await asyncio.gather(*(self.start_again(r) for r in range(len(self.states))))
        self.first_start = False
        for r in range(len(self.states)):
            self.watch(r)

    async def start_again(self, replica: int) -> None:
        """A replica whose engine lives (a retry after a failed capture tore its group down)
        starts its workers again in its own placement; others start from scratch."""
        state = self.states[replica]
        if state.engine is None or state.state == "stopped":
            return await self.start_replica(replica, raise_errors=True)
        await state.engine.start.remote()
        self.states[replica] = ReplicaState(replica, state.engine, "serving",
                                              node_id=state.node_id)
        self.router.set_up(replica, True)

    def node_for(self, replica: int) -> str | None:
        """The node for a replica's engine (its workers pack beside it): among live nodes
        with room for its workers now, the one holding the fewest other replicas (spread)
        or the most (pack). None when no node has room."""
        world = self.cfg.parallel.world_size
        unit = "GPU" if self.cfg.device == "cuda" else "CPU"
        free = available_resources_per_node()
        fits = [node for node, res in free.items() if res.get(unit, 0) >= world]
        used = [s.node_id for s in self.states if s.replica != replica and s.engine]
        sign = 1 if self.cfg.replica.placement == "spread" else -1
        return min(fits, key=lambda node: (sign * used.count(node), node), default=None)

    async def start_replica(self, replica: int, raise_errors: bool = False) -> None:
        """Start (or start again) one replica: its placement group on a node with room,
        its engine inside it (beside its workers), loaded and serving. One at a time per
        replica: two would each place a group, and one would be lost."""
        async with self._starting[replica]:
            await self._place_and_start(replica, raise_errors)

    async def _place_and_start(self, replica: int, raise_errors: bool) -> None:
        self.release(replica)  # a lost engine's placement: its resources count as free
        node = self.node_for(replica)
        if node is None and not self.first_start:  # its supervisor tries again
            self.states[replica] = ReplicaState(
                replica, None, "failed", f"waiting for a node with room for "
                f"{self.cfg.parallel.world_size} worker(s)")
            self.router.set_up(replica, False)
            return
        engine = None
        try:
            pg = self._pgs[replica] = await place_workers(self.cfg, node)
            engine = ray.remote(self.engine_cls).options(
                num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)
            ).remote(self.cfg, replica, pg)
            self.states[replica] = ReplicaState(replica, engine, "starting", node_id=node)
            await engine.start.remote()
            where = await engine.node_id.remote()
        except Exception as e:
            if engine is not None:
                ray.kill(engine)
            self.release(replica)
            why = f"{type(e).__name__}: {last_line(e)}"
            self.states[replica] = ReplicaState(replica, None, "failed", why)
            self.router.set_up(replica, False)
            log.error("replica %d could not start: %s", replica, why)
            if raise_errors:
                raise
            return
        self.states[replica] = ReplicaState(replica, engine, "serving", node_id=where)
        self.router.set_up(replica, True)
        log.info("replica %d serving on node %s", replica, where[:12])

    def release(self, replica: int) -> None:
        """Remove a replica's placement group: its resources go back to the cluster."""
        pg = self._pgs.pop(replica, None)
        if pg is not None:
            remove_placement_group(pg)

    def watch(self, replica: int) -> None:
        task = self._watchers[replica]
        if task is None or task.done():
            self._watchers[replica] = asyncio.get_running_loop().create_task(
                self._supervise(replica))

    async def _supervise(self, replica: int) -> None:
        """Notice the replica's engine dying (its process, or its node) and start it again,
        every RETRY_S until there is room for it."""
        while not self.stopping:
            state = self.states[replica]
            if state.state == "serving":
                try:
                    await state.engine.wait_stopped.remote()
                    if self.stopping:
                        return
                    why = "its engine stopped"
                except RayActorError as e:
                    why = f"its engine died: {last_line(e)}"
                if self.stopping:
                    return
                log.error("replica %d failed: %s; starting it again", replica, why)
                self.states[replica] = ReplicaState(replica, None, "failed", why)
                self.router.set_up(replica, False)
                self.restarts += 1
            await self.start_replica(replica)
            if self.states[replica].state != "serving":
                await asyncio.sleep(RETRY_S)

    def serving(self) -> list[ReplicaState]:
        return [s for s in self.states if s.state == "serving"]

    def engine(self, replica: int = 0) -> Any:
        """A serving replica's engine handle (ValueError otherwise)."""
        state = self.states[replica]
        if state.state != "serving":
            raise ValueError(f"replica {replica} is {state.state}: {state.reason}")
        return state.engine

    async def scale(self, replicas: int) -> dict:
        """Run `replicas` engines: new ones start (placed as at start-up) and serve once
        ready; the highest-numbered ones beyond it finish their requests and stop, their
        placement released. Request ids name replicas by number, so numbers stay dense."""
        if replicas < 1:
            raise BadRequest(f"replicas must be >= 1, got {replicas}")
        old = len(self.states)
        rc = self.cfg.replica
        if rc.min_replicas is not None and rc.min_replicas > replicas:
            raise BadRequest(f"replicas must be >= min_replicas ({rc.min_replicas}), "
                             f"got {replicas}")
        self.cfg = msgspec.structs.replace(self.cfg, replica=msgspec.structs.replace(
            rc, replicas=replicas))
        if replicas > old:
            self.states += [ReplicaState(r, None, "starting") for r in range(old, replicas)]
            self._starting += [asyncio.Lock() for _ in range(old, replicas)]
            self._watchers += [None] * (replicas - old)
            self.router.resize(replicas)
            for r in range(old, replicas):
                self.router.set_up(r, False)  # until it serves
            await asyncio.gather(*(self.start_replica(r) for r in range(old, replicas)))
            for r in range(old, replicas):
                self.watch(r)
        else:
            for r in range(replicas, old):
                self.router.set_up(r, False)
            await asyncio.gather(*(self._stop_replica(r) for r in range(replicas, old)))
            del self.states[replicas:], self._starting[replicas:], self._watchers[replicas:]
            self.router.resize(replicas)
        log.info("scaled from %d to %d replica(s)", old, replicas)
        return {"replicas": replicas, "serving": len(self.serving()), "was": old}

    async def _stop_replica(self, replica: int) -> None:
        """Stop one replica for good. It leaves the routes first: every router learns of it
        within ROUTES_REFRESH_S (requests sent meanwhile are served); then its requests
        finish (at most step_timeout_s), and its engine and placement go."""
        task = self._watchers[replica]
        if task is not None:
            task.cancel()
        state = self.states[replica]
        self.states[replica] = ReplicaState(replica, None, "stopped", "scaled down")
        if state.engine is not None:
            try:
                await asyncio.sleep(ROUTES_REFRESH_S)
                left = await state.engine.drain.remote(self.cfg.step_timeout_s)
                if left:
                    log.warning("replica %d stops with %d request(s) unfinished", replica, left)
                await state.engine.shutdown.remote()
            except RayActorError:
                pass
            ray.kill(state.engine)
        self.release(replica)

    async def shutdown(self) -> None:
        """Every engine stops; placements are released; nothing restarts."""
        self.stopping = True
        await asyncio.gather(*(s.engine.shutdown.remote() for s in self.serving()),
                             return_exceptions=True)
        for s in self.states:
            if s.engine is not None:
                ray.kill(s.engine)
        for task in self._watchers:
            if task is not None:
                task.cancel()
        for r in range(len(self.states)):
            self.release(r)
            self.router.set_up(r, False)
        self.states = [ReplicaState(s.replica, None, "stopped", "shut down")
                       for s in self.states]
