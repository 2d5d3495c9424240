"""The coordinator: the named actor every client finds. It starts the engines (one per
replica, each with its own worker group, placed over the cluster's nodes), routes the
requests of Ray clients to them, restarts a replica whose engine died, and fans operator
calls (sleep, LoRA) out to every replica.

HTTP servers ask it for the engines (`replicas`) and send their streams to them directly,
so a streamed token never passes through here. A replica fails alone: its requests end
with an error (a plain `generate` whose engine died is sent again to another replica,
since its client has seen nothing of it), the others serve on, and the coordinator starts
the lost one again where the resources are, retrying until the cluster has room.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
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
from raygraph.errors import WorkerFailure, last_line
from raygraph.process import setup_logging
from raygraph.protocol import GenerateResult, ReplicaState, StartupProgress, StreamDelta
from raygraph.requests import parse_params, split_prompts

log = logging.getLogger("raygraph.coordinator")

RETRY_S = 5.0  # a replica that could not start is tried again this often
CHARS_PER_TOKEN = 4  # a text prompt's cost estimate for routing


class Coordinator:
    def __init__(self, cfg: Any, engine_cls: type = Engine) -> None:
        """`engine_cls`: the engine actor's class, built as (cfg, replica, placement group).
        A benchmark passes a stand-in with Engine's surface and no model (bench/frontdoor.py's
        NullEngine), so the front door is measured without one."""
        setup_logging()
        self.cfg = cfg
        self.engine_cls = engine_cls
        n = cfg.replica.replicas
        self.replicas = [ReplicaState(r, None, "starting") for r in range(n)]
        self.router = Router(n, cfg.replica, cfg.cache.block_size)
        self.restarts = 0  # engines started again after theirs died
        self._pgs: dict[int, Any] = {}  # replica -> its placement group
        self._starting = [asyncio.Lock() for _ in range(n)]
        self._watchers: list[asyncio.Task | None] = [None] * n
        self._stopping = False
        self._first_start = True
        if ray.get_runtime_context().was_current_actor_reconstructed:
            # a detached service whose process died: Ray restarted it, nobody calls start()
            self._reason = "the coordinator's process died; starting it again"
            log.error(self._reason)
            ray.get_runtime_context().current_actor.recover.remote()  # runs after __init__
        else:
            self._reason = "not started"

    # ---- start-up and supervision ---------------------------------------------------
    async def start(self) -> dict:
        """Start every replica and wait until each serves; the first failure is raised (the
        caller kills this actor, and the engines with it)."""
        self._first_start = True
        await asyncio.gather(*(self._start_again(r) for r in range(len(self.replicas))))
        self._first_start = False
        self._reason = None
        for r in range(len(self.replicas)):
            self._watch(r)
        return await self.describe()

    async def _start_again(self, replica: int) -> None:
        """A replica whose engine lives (a retry after a failed capture tore its group down)
        starts its workers again in its own placement; others start from scratch."""
        state = self.replicas[replica]
        if state.engine is None or state.state == "stopped":
            return await self._start_replica(replica, raise_errors=True)
        await state.engine.start.remote()
        self.replicas[replica] = ReplicaState(replica, state.engine, "serving",
                                              node_id=state.node_id)
        self.router.set_up(replica, True)

    async def recover(self) -> None:
        """`start` after Ray restarted this actor; a failure stays in /health and the log."""
        try:
            await self.start()
            log.info("the coordinator serves again after its process died")
        except Exception as e:
            self._reason = (f"the coordinator's process died and it could not start again: "
                            f"{type(e).__name__}: {last_line(e)}")
            log.error(self._reason)

    def _node_for(self, replica: int) -> str | None:
        """The node for a replica's engine (its workers pack beside it): among live nodes
        with room for its workers now, the one holding the fewest other replicas (spread)
        or the most (pack). None when no node has room."""
        world = self.cfg.parallel.world_size
        unit = "GPU" if self.cfg.device == "cuda" else "CPU"
        free = available_resources_per_node()
        fits = [node for node, res in free.items() if res.get(unit, 0) >= world]
        used = [s.node_id for s in self.replicas if s.replica != replica and s.engine]
        sign = 1 if self.cfg.replica.placement == "spread" else -1
        return min(fits, key=lambda node: (sign * used.count(node), node), default=None)

    async def _start_replica(self, replica: int, raise_errors: bool = False) -> None:
        """Start (or start again) one replica: its placement group on a node with room,
        its engine inside it (beside its workers), loaded and serving. One at a time per
        replica: two would each place a group, and one would be lost."""
        async with self._starting[replica]:
            await self._place_and_start(replica, raise_errors)

    async def _place_and_start(self, replica: int, raise_errors: bool) -> None:
        self._release(replica)  # a lost engine's placement: its resources count as free
        node = self._node_for(replica)
        if node is None and not self._first_start:  # its supervisor tries again
            self.replicas[replica] = ReplicaState(
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
            self.replicas[replica] = ReplicaState(replica, engine, "starting", node_id=node)
            await engine.start.remote()
            where = await engine.node_id.remote()
        except Exception as e:
            if engine is not None:
                ray.kill(engine)
            self._release(replica)
            why = f"{type(e).__name__}: {last_line(e)}"
            self.replicas[replica] = ReplicaState(replica, None, "failed", why)
            self.router.set_up(replica, False)
            log.error("replica %d could not start: %s", replica, why)
            if raise_errors:
                raise
            return
        self.replicas[replica] = ReplicaState(replica, engine, "serving", node_id=where)
        self.router.set_up(replica, True)
        log.info("replica %d serving on node %s", replica, where[:12])

    def _release(self, replica: int) -> None:
        """Remove a replica's placement group: its resources go back to the cluster."""
        pg = self._pgs.pop(replica, None)
        if pg is not None:
            remove_placement_group(pg)

    def _watch(self, replica: int) -> None:
        task = self._watchers[replica]
        if task is None or task.done():
            self._watchers[replica] = asyncio.get_running_loop().create_task(
                self._supervise(replica))

    async def _supervise(self, replica: int) -> None:
        """Notice the replica's engine dying (its process, or its node) and start it again,
        every RETRY_S until there is room for it."""
        while not self._stopping:
            state = self.replicas[replica]
            if state.state == "serving":
                try:
                    await state.engine.wait_stopped.remote()
                    if self._stopping:
                        return
                    why = "its engine stopped"
                except RayActorError as e:
                    why = f"its engine died: {last_line(e)}"
                if self._stopping:
                    return
                log.error("replica %d failed: %s; starting it again", replica, why)
                self.replicas[replica] = ReplicaState(replica, None, "failed", why)
                self.router.set_up(replica, False)
                self.restarts += 1
            await self._start_replica(replica)
            if self.replicas[replica].state != "serving":
                await asyncio.sleep(RETRY_S)

    def _serving(self) -> list[ReplicaState]:
        return [s for s in self.replicas if s.state == "serving"]

    def engine(self, replica: int = 0) -> Any:
        """A serving replica's engine handle (ValueError otherwise)."""
        state = self.replicas[replica]
        if state.state != "serving":
            raise ValueError(f"replica {replica} is {state.state}: {state.reason}")
        return state.engine

    def replica_states(self) -> list[ReplicaState]:
        """Every replica: its engine handle (None unless serving) and state. HTTP servers
        read this to send their streams to the engines directly."""
        return list(self.replicas)

    # ---- requests ----------------------------------------------------------------------
    async def _routed(self, prompt: Any, params: Any,
                      call: Callable[[Any], Awaitable[Any]]) -> Any:
        """`call(engine)` on the replica the router picks for `prompt`; if that engine dies
        before answering, once more on another (the client has seen nothing of it)."""
        cost = self._cost(prompt, params)
        for attempt in range(2):
            replica = self._pick(prompt, cost)
            try:
                return await call(self.replicas[replica].engine)
            except RayActorError:
                self.router.set_up(replica, False)  # its supervisor restarts it
                if attempt or not self._serving():
                    raise
                log.warning("replica %d died with a request on it; sending it to another",
                            replica)
            finally:
                self.router.done(replica, cost)
        raise AssertionError("unreachable")

    def _cost(self, prompt: Any, params: Any) -> int:
        """Tokens a request may hold on its replica, for the router's load."""
        size = len(prompt) // CHARS_PER_TOKEN if isinstance(prompt, str) else len(prompt)
        return size + parse_params(params).max_tokens

    def _pick(self, prompt: Any, cost: int) -> int:
        try:
            return self.router.pick(prompt, cost)
        except ValueError:
            raise WorkerFailure(f"not serving: {self._why_not()}") from None

    async def generate(self, prompts: Any, params: Any = None) -> list[GenerateResult]:
        """Generate for one prompt or a list (text or token ids); results in input order.
        Each prompt is routed on its own (its n > 1 choices stay together)."""
        items = split_prompts(prompts)
        if len(self.replicas) == 1:
            return await self._routed(items[0], params,
                                      lambda e: e.generate.remote(prompts, params))
        outs = await asyncio.gather(*(
            self._routed(p, params, lambda e, p=p: e.generate.remote(p, params))
            for p in items))
        return [r for out in outs for r in out]

    async def generate_stream(self, prompt: Any, params: Any = None
                              ) -> AsyncIterator[StreamDelta]:
        """Each step's new tokens for one prompt, from the replica it is routed to. Call as
        `generate_stream.options(num_returns="streaming").remote(...)`; HTTP servers go to
        the engines directly instead."""
        cost = self._cost(prompt, params)
        replica = self._pick(prompt, cost)
        try:
            gen = self.replicas[replica].engine.generate_stream.options(
                num_returns="streaming").remote(prompt, params)
            async for ref in gen:
                yield await ref
        finally:
            self.router.done(replica, cost)

    # ---- state and operator calls ------------------------------------------------------
    def _why_not(self) -> str:
        if self._reason:
            return self._reason
        return "; ".join(f"replica {s.replica} {s.state}: {s.reason}" for s in self.replicas)

    async def _on_all(self, method: str, *args: Any) -> list[Any]:
        """A method of every serving engine, in replica order."""
        return await asyncio.gather(*(getattr(s.engine, method).remote(*args)
                                      for s in self._serving()))

    async def _on_one(self, method: str, replica: int, *args: Any) -> Any:
        return await getattr(self.engine(replica), method).remote(*args)

    async def stats(self) -> dict:
        """Figures summed over the serving replicas (one replica: its own), with each
        replica's under "replicas"; healthy while at least one serves."""
        per = await asyncio.gather(*(self._replica_stats(s) for s in self.replicas))
        merged = merge_stats([p for p in per if p.get("state") == "serving"])
        healthy = any(p.get("healthy") for p in per)
        merged.update(healthy=healthy, reason=None if healthy else self._why_not(),
                      replicas=per, replica_restarts=self.restarts)
        return merged

    async def _replica_stats(self, s: ReplicaState) -> dict:
        base = {"replica": s.replica, "state": s.state, "node_id": s.node_id}
        if s.state != "serving":
            return {**base, "healthy": False, "reason": s.reason}
        try:
            return {**await s.engine.stats.remote(), **base}
        except RayActorError as e:
            return {**base, "state": "failed", "healthy": False, "reason": last_line(e)}

    async def describe(self) -> dict:
        info = await self._on_one("describe", self._serving()[0].replica) \
            if self._serving() else {}
        return {**info, "replicas": len(self.replicas), "block_size": self.cfg.cache.block_size,
                "replica_config": msgspec.to_builtins(self.cfg.replica),
                "serving": len(self._serving()),
                "nodes": [s.node_id for s in self.replicas]}

    async def progress(self) -> StartupProgress:
        """Start-up progress of the first replica still starting (else replica 0's)."""
        starting = [s for s in self.replicas if s.state == "starting" and s.engine]
        engine = starting[0].engine if starting else self.replicas[0].engine
        return await engine.progress.remote() if engine is not None else StartupProgress()

    async def sleep(self, level: int = 1, wait: bool = True) -> dict:
        """Every replica sleeps (engine.Engine.sleep); one replica's figures as they are."""
        return merge_results(await self._on_all("sleep", level, wait))

    async def wake_up(self) -> dict:
        return merge_results(await self._on_all("wake_up"))

    async def is_sleeping(self) -> bool:
        return all(await self._on_all("is_sleeping"))

    async def sleep_level(self) -> int:
        return min(await self._on_all("sleep_level"))

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        """Register an adapter on every replica (each loads it into a slot on first use)."""
        return (await self._on_all("load_lora_adapter", name, path))[0]

    async def unload_lora_adapter(self, name: str) -> None:
        await self._on_all("unload_lora_adapter", name)

    async def list_lora_adapters(self) -> list[dict]:
        return (await self._on_all("list_lora_adapters") or [[]])[0]

    # one replica's internals (tests, fault drills, benchmarks): replica 0 unless named
    async def capture_schedule(self, replica: int = 0) -> list:
        return await self._on_one("capture_schedule", replica)

    async def capture_report(self, replica: int = 0) -> list:
        return await self._on_one("capture_report", replica)

    async def capture_progress(self, replica: int = 0) -> dict:
        return await self._on_one("capture_progress", replica)

    async def worker_stats(self, replica: int = 0) -> list[dict]:
        return await self._on_one("worker_stats", replica)

    async def worker_handles(self, replica: int = 0) -> list[Any]:
        return await self._on_one("worker_handles", replica)

    async def inject_fault(self, rank: int, kind: str, phase: str = "capture", key: Any = None,
                           replica: int = 0) -> None:
        await self._on_one("inject_fault", replica, rank, kind, phase, key)

    async def shutdown(self) -> None:
        self._stopping = True
        await asyncio.gather(*(s.engine.shutdown.remote() for s in self._serving()),
                             return_exceptions=True)
        for s in self.replicas:
            if s.engine is not None:
                ray.kill(s.engine)
        for task in self._watchers:
            if task is not None:
                task.cancel()
        for r in range(len(self.replicas)):
            self._release(r)
        self.replicas = [ReplicaState(s.replica, None, "stopped", "shut down")
                         for s in self.replicas]
        for r in range(len(self.replicas)):
            self.router.set_up(r, False)
        self._reason = "shut down"

    def ping(self) -> bool:
        return True


def merge_stats(per: list[dict]) -> dict:
    """Counters summed over replicas, rates and per-step figures averaged, flags any()."""
    if len(per) == 1:
        return dict(per[0])
    out: dict = {}
    for key in per[0] if per else []:
        values = [p.get(key) for p in per]
        first = values[0]
        if isinstance(first, bool):
            out[key] = any(values)
        elif isinstance(first, int | float) and all(isinstance(v, int | float) for v in values):
            averaged = key.endswith(("_ms", "_per_step", "_rate", "utilization"))
            out[key] = sum(values) / len(values) if averaged else sum(values)
        elif isinstance(first, dict) and all(isinstance(v, dict) for v in values):
            out[key] = merge_stats(values)
        else:
            out[key] = first
    return out


def merge_results(results: list[dict]) -> dict:
    """One replica's result as it is; several: each under "replicas", the slowest time."""
    if len(results) == 1:
        return results[0]
    return {"replicas": results, "seconds": max(r.get("seconds", 0.0) for r in results)}
