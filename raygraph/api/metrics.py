"""Prometheus metrics with vLLM's names under the `raygraph:` prefix.

Several HTTP servers may share one coordinator, so what must be global (gauges of the
scheduler, token and finish counters, graph and offload figures) is read from the
coordinator's `stats()` at scrape time by a custom collector; per-request histograms are
this server's own. Every series carries a `replica` label: the engine (model replica) it
describes or whose request it timed. Each app has its own registry (tests build several in
one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from raygraph.protocol import ALLOCATE_SAMPLE, RequestTiming, replica_of

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class CoordinatorCollector:
    """The coordinator's figures, as of the last `stats()` read (set before each scrape)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats: dict | None = None
        self.offload_h2d_bytes = 0
        self.replica = "0"  # the replica whose figures are being collected

    def _family(self, kind: type, name: str, doc: str, value: float,
                labels: dict[str, str] | None = None):
        f = kind(f"raygraph:{name}", doc, labels=["model_name", "replica", *(labels or {})])
        f.add_metric([self.model, self.replica, *(labels or {}).values()], value)
        return f

    def collect(self):
        """Each family once, with a sample per serving replica (asleep ones included)."""
        if self.stats is None:
            return
        families: dict[str, Metric] = {}
        for s in self.stats.get("replicas", []):
            if s.get("state") != "serving":
                continue
            self.replica = str(s["replica"])
            for f in self._families(s):
                if f.name in families:
                    families[f.name].samples += f.samples
                else:
                    families[f.name] = f
        self.replica = "0"  # the front reads the offloaded bytes of replica 0's workers
        yield from families.values()
        yield self._family(CounterMetricFamily, "offload_h2d_bytes", "Offloaded weight bytes "
                           "copied to the device (all ranks).", self.offload_h2d_bytes)

    def _families(self, s: dict):
        """One replica's figures (its engine's stats)."""
        G, C = GaugeMetricFamily, CounterMetricFamily
        yield self._family(G, "num_requests_running", "Sequences running on the workers.",
                           s["running"])
        yield self._family(G, "num_requests_waiting", "Sequences waiting to be scheduled.",
                           s["waiting"])
        yield self._family(G, "kv_cache_usage_perc", "KV cache use, 0 to 1: pages pinned by "
                           "running sequences (the fullest DP group); cached pages count as "
                           "free, offline pages (a wake still mapping them) not at all.",
                           s["kv_utilization"])
        yield from self._pool(s["kv_cache"])
        yield self._family(C, "prompt_tokens", "Prompt tokens of finished requests.",
                           s["prompt_tokens"])
        yield self._family(C, "generation_tokens", "Tokens generated for finished requests.",
                           s["generation_tokens"])
        yield self._family(C, "num_preemptions", "Sequences preempted (recomputed later).",
                           s["preemptions"])
        yield self._family(C, "spec_decode_num_draft_tokens", "Draft tokens proposed for "
                           "speculative decoding.", s.get("spec_decode_num_draft_tokens", 0))
        yield self._family(C, "spec_decode_num_accepted_tokens", "Draft tokens the target "
                           "kept.", s.get("spec_decode_num_accepted_tokens", 0))
        yield self._family(C, "spec_decode_num_drafts", "Verify chunks: one sequence's drafts "
                           "of a step (mean accepted length: 1 + accepted / drafts).",
                           s.get("spec_decode_num_drafts", 0))
        yield self._family(C, "spec_decode_draft_time_seconds", "Time the drafter took on "
                           "the device (a draft model's or EAGLE-3 head's passes and proposal "
                           "loops; the first DP group's sampling rank).",
                           s.get("spec_decode_draft_s", 0.0))
        yield self._family(C, "spec_decode_verify_time_seconds", "Time of the steps that "
                           "verified drafts, their drafting included (the first DP group's "
                           "rank 0).", s.get("spec_decode_verify_s", 0.0))
        per_pos = C("raygraph:spec_decode_num_accepted_tokens_per_pos", "Draft tokens the "
                    "target kept, by their place among a step's drafts.",
                    labels=["model_name", "replica", "position"])
        for pos, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([self.model, self.replica, str(pos)], n)
        yield per_pos
        done = C("raygraph:request_success", "Finished requests by finish reason.",
                 labels=["model_name", "replica", "finished_reason"])
        for reason in ("stop", "length", "abort"):
            done.add_metric([self.model, self.replica, reason], s["finished"].get(reason, 0))
        yield done
        # a step of a captured bucket replays its graph; on the eager backend (CPU) or for
        # steps above the largest bucket nothing was captured: those are eager steps
        replays = C("raygraph:cuda_graph_replays", "Steps that replayed a CUDA graph, by "
                    "bucket phase (one per DP group).", labels=["model_name", "replica", "phase"])
        eager = 0
        for phase, n in sorted(s["steps_by_phase"].items()):
            if s["graphs_captured"] and phase != "eager":
                replays.add_metric([self.model, self.replica, phase], n)
            else:
                eager += n
        yield replays
        yield self._family(C, "eager_steps", "Steps run eagerly (one per DP group).", eager)
        yield self._family(G, "cuda_graph_capture_seconds", "Time spent capturing graphs.",
                           s["capture_s"])
        yield self._family(G, "cuda_graph_keys_captured", "Bucket keys captured on every rank "
                           "(with background capture, the schedule's progress).",
                           s["keys_captured"])
        yield self._family(G, "graph_pool_bytes", "Graph memory pool bytes (capture records, "
                           "all ranks).", s["graph_pool_bytes"])
        yield self._family(C, "worker_restarts", "Worker group restarts after a failure.",
                           s["restarts"])
        if s.get("lora"):
            yield from self._lora(s["lora"])

    def _lora(self, lora: dict):
        """LoRA adapters (engine/lora.py): requests, tier moves, load times, hot hits."""
        requests = CounterMetricFamily("raygraph:lora_requests", "Requests (sequences) per "
                                       "LoRA adapter.", labels=["model_name", "replica", "adapter"])
        for name, n in sorted(lora["requests"].items()):
            requests.add_metric([self.model, self.replica, name], n)
        yield requests
        moves = CounterMetricFamily("raygraph:lora_promotions", "Adapters moved between "
                                    "tiers: cold (files) or warm (host memory) to hot (a GPU "
                                    "slot); hot to warm is a demotion.",
                                    labels=["model_name", "replica", "from", "to"])
        for src, dst, n in lora["moves"]:
            moves.add_metric([self.model, self.replica, src, dst], n)
        yield moves
        yield self._histogram("lora_load_seconds", "Time to load one adapter into a slot "
                              "(the slowest rank).", lora["load_seconds"])
        yield self._family(GaugeMetricFamily, "lora_hot_hit_rate", "Of the requests given "
                           "an adapter slot, those that found their adapter hot.",
                           lora["hot_hit_rate"])

    def _histogram(self, name: str, doc: str, h: dict) -> HistogramMetricFamily:
        """A histogram from {"bounds", "counts" (one more: over every bound), "sum"}."""
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, h["bounds"]), "+Inf"], h["counts"]):
            cumulative += n
            buckets.append((bound, cumulative))
        f = HistogramMetricFamily(f"raygraph:{name}", doc,
                                  labels=["model_name", "replica"])
        f.add_metric([self.model, self.replica], buckets, h["sum"])
        return f


    def _pool(self, kv: dict):
        """The KV page pools (engine/kv_cache.merge_stats): counts summed over DP groups."""
        G, C = GaugeMetricFamily, CounterMetricFamily
        yield self._family(C, "prefix_cache_queries", "Prompt tokens (with outputs, for a "
                           "recompute) looked up in the prefix cache at admission.",
                           kv["prefix_cache_queries"])
        yield self._family(C, "prefix_cache_hits", "Of the tokens looked up, those found "
                           "cached (not computed).", kv["prefix_cache_hits"])
        pages = G("raygraph:pool_pages", "Page pool pages by state (free, cached: unpinned "
                  "but kept for their content, pinned: in use, offline: not mapped yet after "
                  "a wake) and content kind (kv; free and offline pages: none).",
                  labels=["model_name", "replica", "state", "kind"])
        for state in ("free", "offline", "cached", "pinned"):
            kind = "kv" if state in ("cached", "pinned") else "none"
            pages.add_metric([self.model, self.replica, state, kind], kv["pages"][state])
        yield pages
        evictions = C("raygraph:pool_evictions", "Cached pages evicted (LRU) by content "
                      "kind (kv).", labels=["model_name", "replica", "kind"])
        evictions.add_metric([self.model, self.replica, "kv"], kv["evictions"])
        yield evictions
        yield self._histogram("pool_allocate_seconds", "Time of one KV page allocation "
                              "call by the scheduler (sampled: one call in "
                              f"{ALLOCATE_SAMPLE}).", kv["allocate_seconds"])


class Metrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.coordinator = CoordinatorCollector(model)
        self.registry.register(self.coordinator)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"raygraph:{name}", doc, ["model_name", "replica"],
                             buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Request arrival (at the "
                              "coordinator) to its first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens (streams: as "
                             "delivered here; whole responses: their mean gap).", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request arrival to its end.",
                             LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Request arrival to its first "
                               "scheduled step.", LATENCY_BUCKETS)

    def finished(self, request_id: int, timing: RequestTiming | None, num_tokens: int,
                 gaps: list[float] | None = None) -> None:
        """One finished sequence: its engine's timing, and the gaps between its tokens
        where they were seen one by one (else the mean gap, once per token after the first).
        The request id names its replica."""
        if timing is None:
            return
        labels = (self.model, str(replica_of(request_id)))
        self.ttft.labels(*labels).observe(timing.ttft_s)
        self.e2e.labels(*labels).observe(timing.e2e_s)
        self.queue.labels(*labels).observe(timing.queue_s)
        if gaps is None and num_tokens > 1:
            gaps = [(timing.e2e_s - timing.ttft_s) / (num_tokens - 1)] * (num_tokens - 1)
        itl = self.itl.labels(*labels)
        for g in gaps or ():
            itl.observe(g)

    def render(self, stats: dict, offload_h2d_bytes: int = 0) -> bytes:
        """Prometheus text, with the coordinator's figures as of `stats`."""
        self.coordinator.stats = stats
        self.coordinator.offload_h2d_bytes = offload_h2d_bytes
        return generate_latest(self.registry)
