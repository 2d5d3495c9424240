"""The coordinator: the named actor every client finds. Its ReplicaSet (replicas.py) starts
the engines (one per replica, each with its own worker group, placed over the cluster's
nodes), restarts a replica whose engine died and scales their number (by hand, or by its
Autoscaler, autoscale.py); the coordinator routes the requests of Ray clients to them and
fans operator calls (sleep, LoRA) out to every replica.

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
from ray.exceptions import RayActorError

from raygraph.coordinator.autoscale import Autoscaler
from raygraph.coordinator.replicas import ReplicaSet
from raygraph.coordinator.router import Router
from raygraph.errors import WorkerFailure, last_line
from raygraph.process import setup_logging
from raygraph.protocol import GenerateResult, ReplicaState, StartupProgress, StreamDelta
from raygraph.requests import parse_params, split_prompts

log = logging.getLogger("raygraph.coordinator")

CHARS_PER_TOKEN = 4  # a text prompt's cost estimate for routing


class Coordinator:
    def __init__(self, cfg: Any, engine_cls: type | None = None) -> None:
        """`engine_cls`: the engine actor's class, built as (cfg, replica, placement group);
        Engine unless a benchmark passes a stand-in with its surface and no model
        (bench/frontdoor.py's NullEngine), to measure the front door alone."""
        setup_logging()
        self.router = Router(cfg.replica.replicas, cfg.replica, cfg.cache.block_size,
                             spill_at(cfg))
        # the engines: placement, restarts, scale
        self.fleet = ReplicaSet(cfg, self.router, engine_cls)
        self.autoscaler = Autoscaler(self.fleet)  # with replica.max_replicas
        if ray.get_runtime_context().was_current_actor_reconstructed:
            # a detached service whose process died: Ray restarted it, nobody calls start()
            self._reason = "the coordinator's process died; starting it again"
            log.error(self._reason)
            # an async actor's __init__ runs on its event loop: the task starts after it
            self._recovery = asyncio.get_running_loop().create_task(self._recover())
        else:
            self._reason = "not started"

    # ---- start-up and supervision ---------------------------------------------------
    async def start(self) -> dict:
        """Start every replica and wait until each serves; the first failure is raised (the
        caller kills this actor, and the engines with it)."""
        await self.fleet.start()
        self._reason = None
        self.autoscaler.start()
        return await self.describe()

    async def _recover(self) -> None:
        """`start` after Ray restarted this actor; a failure stays in /health and the log."""
        try:
            await self.start()
            log.info("the coordinator serves again after its process died")
        except Exception as e:
            self._reason = (f"the coordinator's process died and it could not start again: "
                            f"{type(e).__name__}: {last_line(e)}")
            log.error(self._reason)

    @property
    def cfg(self) -> Any:
        """The serving config, as scaling last left it (the fleet's)."""
        return self.fleet.cfg

    @property
    def replicas(self) -> list[ReplicaState]:
        return self.fleet.states

    def _serving(self) -> list[ReplicaState]:
        return self.fleet.serving()

    def engine(self, replica: int = 0) -> Any:
        """A serving replica's engine handle (ValueError otherwise)."""
        return self.fleet.engine(replica)

    def replica_states(self) -> list[ReplicaState]:
        """Every replica: its engine handle (None unless serving) and state. HTTP servers
        read this to send their streams to the engines directly."""
        return list(self.fleet.states)

    async def scale(self, replicas: int) -> dict:
        """Run `replicas` engines (replicas.ReplicaSet.scale)."""
        return await self.fleet.scale(replicas)

    # ---- requests ----------------------------------------------------------------------
    async def _routed(self, prompt: Any, params: Any,
                      call: Callable[[Any], Awaitable[Any]]) -> Any:
        """`call(engine)` on the replica the router picks for `prompt`; if that engine dies
        before answering, once more on another (the client has seen nothing of it)."""
        cost, adapter = self._cost(prompt, params), parse_params(params).lora
        for attempt in range(2):
            replica = self._pick(prompt, cost, adapter)
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

    def _pick(self, prompt: Any, cost: int, adapter: str | None) -> int:
        try:
            return self.router.pick(prompt, cost, adapter)
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
        replica = self._pick(prompt, cost, parse_params(params).lora)
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
                      replicas=per, replica_restarts=self.fleet.restarts,
                      scale_ups=self.autoscaler.scale_ups)
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
                "spill_at": spill_at(self.cfg),
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
        self.autoscaler.stop()
        await self.fleet.shutdown()
        self._reason = "shut down"

    def ping(self) -> bool:
        return True


def spill_at(cfg: Any) -> int:
    """A replica's batch: the requests outstanding on each awake replica before a router
    sends requests to elastic ones too."""
    return cfg.scheduler.max_num_seqs * cfg.parallel.dp


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
