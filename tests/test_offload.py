"""The offload engine on CPU (CPU tensors stand in for the GPU side; copies are synchronous,
so a copy issued before the kernel that still reads its bytes corrupts the output and the
equality checks fail): floor, ring placement, LRU, order divergence, load-time errors, and
offloaded workers that match the all-resident one of the same executor bit for bit."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from raygraph.config import (
    CacheConfig,
    ConfigError,
    GraphConfig,
    OffloadConfig,
    SchedulerConfig,
    ServeConfig,
    parse_bytes,
)
from raygraph.graph.executor import EagerExecutor, GraphExecutor
from raygraph.memory.offload import check_host_weights
from raygraph.memory.offload_engine import spec_of
from raygraph.memory.offload_plan import (
    ALIGN,
    LruPool,
    OffloadBudgetError,
    OffloadError,
    OffloadOrderError,
    WeightSpec,
    aligned,
    check_order,
    compute_floor,
    ring_plan,
    split_ring,
)
from raygraph.protocol import SeqChunk, StepPlan
from raygraph.worker.worker import Worker
from tests.conftest import assert_close_across_shapes

BS = 4
NUM_BLOCKS = 64


def specs(*sizes: int) -> list[WeightSpec]:
    return [WeightSpec(f"w{i}", (s,), "uint8", s) for i, s in enumerate(sizes)]


def test_floor_is_the_largest_consecutive_pair_plus_resident():
    f = compute_floor(specs(1000, 3000, 500, 2500), resident=100)
    # pairs (cyclic): 1000+3000, 3000+500, 500+2500, 2500+1000 (aligned to 256)
    assert f.bytes == 100 + aligned(1000) + aligned(3000) and f.pair == ("w0", "w1")
    f.check(f.bytes)
    with pytest.raises(OffloadBudgetError, match=f"at least {f.bytes} bytes") as e:
        f.check(f.bytes - 1)
    assert e.value.floor == f.bytes and "'w0' and 'w1'" in str(e.value)
    assert compute_floor(specs(700), 0).bytes == aligned(700)
    with pytest.raises(OffloadError, match="no offloaded weight"):
        compute_floor([], 0)


def test_parse_bytes_and_config():
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("800MB") == 800 * 10**6
    assert parse_bytes("4096") == 4096
    with pytest.raises(ConfigError):
        parse_bytes("lots")
    with pytest.raises(ConfigError):
        OffloadConfig(budget_bytes=0)


def live_ranges_ok(sizes: list[int], cap: int) -> None:
    """Check a ring plan: in bounds, and copy j never overwrites an earlier access that
    has not been read when the copy may run (every overlapping one is <= wait_for)."""
    plan = ring_plan(sizes, cap)
    assert len(plan) == len(sizes)
    prev_issue = -1
    for j, s in enumerate(plan):
        assert 0 <= s.offset and s.offset + aligned(sizes[j]) <= cap and s.offset % ALIGN == 0
        for i in range(j):
            o = plan[i]
            if o.offset < s.offset + aligned(sizes[j]) and s.offset < o.offset + aligned(sizes[i]):
                assert i <= s.wait_for < j
        assert s.wait_for <= s.issue_after < j and s.issue_after >= prev_issue
        prev_issue = s.issue_after
    return plan


@pytest.mark.parametrize("seed", range(20))
def test_ring_plan_never_overwrites_a_weight_before_it_is_read(seed):
    rng = random.Random(seed)
    sizes = [rng.randrange(1, 40) * ALIGN for _ in range(rng.randrange(1, 30))]
    floor = compute_floor(specs(*sizes), 0).bytes
    for cap in (max(sizes), floor, floor + 3 * max(sizes), sum(sizes)):
        plan = live_ranges_ok(sizes, cap)
        if cap >= floor:  # at the floor, copy j+1 always overlaps kernel j
            assert all(s.wait_for < j - 1 for j, s in enumerate(plan) if j > 0)


def test_ring_plan_refuses_a_weight_larger_than_the_ring():
    with pytest.raises(OffloadError, match="needs 1024 bytes"):
        ring_plan([256, 1024], 768)


def test_ring_prefetches_deeper_with_room():
    sizes = [ALIGN] * 12
    tight = ring_plan(sizes, 2 * ALIGN)
    roomy = ring_plan(sizes, 6 * ALIGN)
    assert [s.wait_for for s in tight][2:] == list(range(0, 10))  # double buffering
    assert [s.wait_for for s in roomy][6:] == list(range(0, 6))  # five copies in flight


def test_split_ring_keeps_what_the_ring_does_not_need():
    sizes = [4 * ALIGN, ALIGN, ALIGN, 4 * ALIGN, ALIGN, ALIGN]
    assert split_ring(sizes, sum(sizes)) == ([0, 1, 2, 3, 4, 5], 0)
    kept, ring = split_ring(sizes, 10 * ALIGN)  # ring window: 4+1+1 = 6; 4 left
    assert kept == [0] and ring == 6 * ALIGN
    assert split_ring(sizes, 6 * ALIGN) == ([], 6 * ALIGN)


def test_lru_pool_evicts_least_recent_and_respects_pins():
    pool = LruPool(4 * ALIGN)
    assert pool.place("a", ALIGN, set()) == (0, [])
    assert pool.place("b", 2 * ALIGN, set()) == (ALIGN, [])
    assert pool.place("c", ALIGN, set()) == (3 * ALIGN, [])
    assert pool.lookup("a") == 0  # a is now the most recent
    assert pool.place("d", 2 * ALIGN, set()) == (ALIGN, ["b"])
    assert pool.lookup("b") is None and set(pool.where) == {"a", "c", "d"}
    # c is the oldest, but pinned along with d: a (recent) goes; nothing else fits
    assert pool.place("e", 2 * ALIGN, {"c", "d"}) is None
    assert list(pool.where) == ["c", "a", "d"]  # a refused placement evicts nothing, keeps order
    assert pool.place("e", 2 * ALIGN, {"d"}) is None  # d sits in the middle: no 2-hole
    assert pool.place("e", ALIGN, {"d"}) == (3 * ALIGN, ["c"])  # c was the oldest
    assert pool.evictions == 2
    with pytest.raises(OffloadBudgetError, match="alone does not fit"):
        pool.place("huge", 5 * ALIGN, set())


def test_check_order_and_host_weights():
    check_order(["a", "b"], ["b", "a"])
    with pytest.raises(OffloadError, match="'a' is read twice"):
        check_order(["a", "b", "a"], ["a", "b"])
    with pytest.raises(OffloadError, match=r"never read.*'c'"):
        check_order(["a", "b"], ["a", "b", "c"])
    want = [spec_of("x.weight", torch.zeros(4, 8)), spec_of("y.weight", torch.zeros(2))]
    good = {"x.weight": torch.ones(4, 8), "y.weight": torch.ones(2)}
    check_host_weights(want, good)
    with pytest.raises(OffloadError, match=r"lack \['y.weight'\]"):
        check_host_weights(want, {"x.weight": torch.ones(4, 8)})
    with pytest.raises(OffloadError, match=r"'x.weight' has shape \(8, 4\)"):
        check_host_weights(want, {**good, "x.weight": torch.ones(8, 4)})
    with pytest.raises(OffloadError, match="'y.weight' has dtype float16"):
        check_host_weights(want, {**good, "y.weight": torch.ones(2, dtype=torch.float16)})


# ---- whole workers on the tiny checkpoint ---------------------------------------------

def make_worker(ckpt, offload: OffloadConfig | None, mode: str = "eager",
                prefill_graph: str = "full", quantization: str = "auto") -> Worker:
    cfg = ServeConfig(
        model=str(ckpt), device="cpu", quantization=quantization,
        cache=CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=200),
        graph=GraphConfig(mode=mode, prefill_graph=prefill_graph),
        offload=offload or OffloadConfig(),
    )
    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(NUM_BLOCKS)
    return w


def plans(seed: int) -> list[StepPlan]:
    """A prefill of three sequences, then decode steps over the same blocks."""
    rng = random.Random(seed)
    lens = [rng.randrange(2, 9) for _ in range(3)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    out = [StepPlan(0, [SeqChunk(i, [rng.randrange(3, 256) for _ in range(n)], 0, tables[i],
                                 True) for i, n in enumerate(lens)])]
    for step in range(3):
        out.append(StepPlan(step + 1, [SeqChunk(i, [rng.randrange(3, 256)], n + step,
                                                tables[i], True)
                                       for i, n in enumerate(lens)]))
    return out


def run(w: Worker, seed: int = 0) -> list[torch.Tensor]:
    for layer in w.model.attention_layers():
        layer.k_cache.zero_()
        layer.v_cache.zero_()
    return [w.executor.logits(p).clone() for p in plans(seed)]


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, tuple[Worker, list[torch.Tensor]]]:
    """All-resident workers and their logits, one per executor kind ("eager", "graph").

    Offloading moves weights, never a GEMM's shape: an offloaded worker must give the
    all-resident logits of its own executor bit for bit. Across executors the shapes differ
    (graph mode pads a batch to its bucket: 3 decode rows run as 4, which changes the GEMMs'
    M and, on some CPUs, their reduction order), so graph and eager agree only within the
    dtype's rounding noise; that is checked here once, with a tolerance."""
    out = {}
    for kind in ("eager", "graph"):
        w = make_worker(tiny_llama, None, kind)
        out[kind] = w, run(w)
    assert isinstance(out["eager"][0].executor, EagerExecutor)
    assert isinstance(out["graph"][0].executor, GraphExecutor)
    for g, e in zip(out["graph"][1], out["eager"][1], strict=True):
        assert_close_across_shapes(g, e)
    return out


def like_with_like(reference, w: Worker) -> list[torch.Tensor]:
    """The all-resident logits of the executor `w` actually runs (lru forces eager)."""
    return reference["graph" if isinstance(w.executor, GraphExecutor) else "eager"][1]


def weight_sizes(w: Worker) -> tuple[int, int, int]:
    """(resident bytes, largest offloaded weight, all weights) of an offloaded worker."""
    e = w.offload
    return e.resident, max(aligned(s.nbytes) for s in e.specs), e.resident + sum(
        s.nbytes for s in e.specs)


@pytest.mark.parametrize("mode,graph", [("sync", "eager"), ("lru", "eager"),
                                        ("ring", "eager"), ("ring", "graph")])
def test_offloaded_worker_matches_all_resident(tiny_llama, reference, mode, graph):
    probe = make_worker(tiny_llama, OffloadConfig(budget_bytes=10**9, mode="sync"))
    floor = probe.offload.floor.bytes
    for budget in (floor, floor + 3 * ALIGN * 64):
        w = make_worker(tiny_llama, OffloadConfig(budget_bytes=budget, mode=mode), graph)
        assert not any(p.device.type == "meta" for p in w.model.parameters())
        # recorder, then engine: one reading class over the model's own, not one per install
        assert not any(isinstance(vars(type(m).__mro__[1]).get("weight"), property)
                       for m in w.offload.modules)
        if mode == "lru":
            assert isinstance(w.executor, EagerExecutor)  # forced eager
        else:
            assert isinstance(w.executor, GraphExecutor if graph == "graph" else EagerExecutor)
        got = run(w)
        # like with like: the same executor, so the same shapes and kernels; only the
        # weights' home differs, and a copy racing a kernel changes the bits
        for a, b in zip(got, like_with_like(reference, w), strict=True):
            assert torch.equal(a, b)
        if mode == "lru":
            assert w.offload.misses > 0 and w.offload.bytes_copied > 0
        w.execute(plans(0)[1])
        stats = w.offload_stats()
        assert stats.steps == 1 and stats.bytes_copied > 0 and stats.floor_bytes == floor
        assert (stats.evictions > 0) == (mode == "lru")  # only the capped pool evicts
        msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=type(stats))


@pytest.mark.parametrize("mode,graph", [("sync", "eager"), ("ring", "graph")])
def test_fp8_weights_offload_as_stored(tiny_llama, mode, graph):
    """FP8 linear weights move as FP8 (their scales stay resident): the offloaded worker
    gives the all-resident FP8 worker's logits bit for bit and copies under half the bytes
    a step of the unquantized one (float32 here: a quarter for the linears; the lm_head
    stays float32)."""
    copied = {}
    for quantization in ("auto", "fp8"):
        probe = make_worker(tiny_llama, OffloadConfig(budget_bytes=10**9, mode="sync"),
                            quantization=quantization)
        w = make_worker(tiny_llama, OffloadConfig(budget_bytes=probe.offload.floor.bytes,
                                                  mode=mode), graph, quantization=quantization)
        if quantization == "fp8":
            want = run(make_worker(tiny_llama, None, graph, quantization="fp8"))
            for a, b in zip(run(w), want, strict=True):
                assert torch.equal(a, b)
            assert {str(s.dtype) for s in w.offload.specs} == {"float8_e4m3fn", "float32"}
        w.execute(plans(0)[1])
        copied[quantization] = w.offload_stats().bytes_copied
    assert copied["fp8"] < 0.5 * copied["auto"]


def test_offloaded_graph_worker_skips_the_logits_warm_up(tiny_llama, monkeypatch):
    """GraphExecutor.warm_logits runs the lm_head outside a forward. An offloaded model reads
    its head only after the body (the recorded order) and refuses that read, which failed
    every graph-mode offload worker on a GPU at load; such workers skip the warm-up. Off
    CUDA warm_logits does nothing, so here it runs the head once, as on a GPU."""
    warmed = []

    def warm_logits(self) -> None:
        hidden = self.model.config.hidden_size
        self.model.compute_logits(torch.zeros(1, hidden, dtype=self.model.lm_head.weight.dtype))
        warmed.append(self)

    monkeypatch.setattr(GraphExecutor, "warm_logits", warm_logits)
    w = make_worker(tiny_llama, OffloadConfig(budget_bytes=10**6, mode="ring"), "graph")
    assert isinstance(w.executor, GraphExecutor) and not warmed
    run(w)  # and it serves
    assert len(warmed) == 0
    make_worker(tiny_llama, None, "graph")  # an all-resident graph worker still warms up
    assert len(warmed) == 1


@pytest.mark.parametrize("prefill_graph", ["piecewise", "full"])
def test_ring_graph_executor_runs_prefill_graphs(tiny_llama, reference, prefill_graph):
    """CPU eager backend of the graph executor: piecewise prefill goes through the split hook
    that the ring wraps with a join/fork; a full prefill graph runs the ring as decode does."""
    w = make_worker(tiny_llama, OffloadConfig(budget_bytes=10**6, mode="ring"), "graph",
                    prefill_graph)
    got = run(w)
    assert w.executor.last_key.phase == "decode"
    resident = (reference["graph"][1] if prefill_graph == "full" else
                run(make_worker(tiny_llama, None, "graph", prefill_graph)))
    # the all-resident graph worker's prefill: the same padded bucket, so bit for bit
    assert torch.equal(got[0], resident[0])


def test_budget_below_floor_fails_at_load_with_the_exact_minimum(tiny_llama):
    probe = make_worker(tiny_llama, OffloadConfig(budget_bytes=10**9, mode="sync"))
    floor = probe.offload.floor.bytes
    resident, biggest, _ = weight_sizes(probe)
    assert floor == resident + max(
        aligned(a.nbytes) + aligned(b.nbytes)
        for a, b in zip(probe.offload.specs, probe.offload.specs[1:] + probe.offload.specs[:1]))
    with pytest.raises(OffloadBudgetError, match=f"at least {floor} bytes"):
        make_worker(tiny_llama, OffloadConfig(budget_bytes=floor - 1))
    with pytest.raises(OffloadError, match="needs"):  # check off, below one weight: refused
        make_worker(tiny_llama, OffloadConfig(budget_bytes=resident + biggest - ALIGN,
                                              check_floor=False, mode="ring"))


@pytest.mark.parametrize("mode", ["ring", "lru", "sync"])
def test_floor_is_tight_and_safe(tiny_llama, reference, mode):
    """Floor check off: the smallest budget giving the all-resident logits is at most the
    floor and at least the floor minus one largest weight."""
    _, ref = reference["eager"]  # these workers run eagerly too: like with like, exactly
    probe = make_worker(tiny_llama, OffloadConfig(budget_bytes=10**9, mode="sync"))
    floor = probe.offload.floor.bytes
    resident, biggest, _ = weight_sizes(probe)

    def works(budget: int) -> bool:
        try:
            w = make_worker(tiny_llama, OffloadConfig(budget_bytes=budget, check_floor=False,
                                                      mode=mode))
        except OffloadError:
            return False
        assert isinstance(w.executor, EagerExecutor)
        return all(torch.equal(a, b) for a, b in zip(run(w), ref, strict=True))

    lo, hi = resident, floor  # works(hi); find the smallest working budget in ALIGN steps
    assert works(hi) and not works(lo)
    while hi - lo > ALIGN:
        mid = (lo + hi) // 2 // ALIGN * ALIGN
        lo, hi = (lo, mid) if works(mid) else (mid, hi)
    assert floor >= hi >= floor - biggest


def test_order_divergence_is_a_hard_error_naming_the_weight(tiny_llama):
    w = make_worker(tiny_llama, OffloadConfig(budget_bytes=10**6, mode="sync"))
    x = torch.zeros(1, w.model_cfg.hidden_size)
    first = "model.layers.0.self_attn.qkv_proj.weight"
    w.offload._begin()
    with pytest.raises(OffloadOrderError, match=f"'lm_head.weight' where the recorded order "
                                                f"has '{first}'"):
        w.model.lm_head(x)
    w.offload._begin()
    w.model.model.layers[0].self_attn.qkv_proj(x)
    with pytest.raises(OffloadOrderError, match="without reading weight "
                                                "'model.layers.0.self_attn.o_proj.weight'"):
        w.offload._end()


def test_offload_config_rides_in_serve_config():
    cfg = msgspec.toml.decode(b'[offload]\nbudget_bytes = 1000\nmode = "lru"\n',
                              type=ServeConfig)
    assert cfg.offload == OffloadConfig(budget_bytes=1000, mode="lru")


def cpu_model(ckpt) -> torch.nn.Module:
    from raygraph.config import ModelConfig
    from raygraph.model.loader import build_model
    from raygraph.model.parallel import Comm

    return build_model(ModelConfig.from_pretrained(str(ckpt)), Comm(), torch.float32,
                       torch.device("cpu"))


def test_external_host_weights_and_forwards_that_skip_weights_fail_at_load(tiny_llama):
    from raygraph.memory.offload import apply_offload, offload_targets

    model = cpu_model(tiny_llama)
    host = {n: m.weight.detach().clone() for n, m in offload_targets(model).items()}
    cfg, cpu = OffloadConfig(budget_bytes=10**7), torch.device("cpu")
    missing = {n: t for n, t in host.items() if n != "lm_head.weight"}
    with pytest.raises(OffloadError, match=r"lack \['lm_head.weight'\]"):
        apply_offload(model, model.model, cfg, cpu, lambda: None, host=missing)
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(OffloadError, match=f"'{name}' has dtype float16"):
        apply_offload(model, model.model, cfg, cpu, lambda: None,
                      host={**host, name: host[name].half()})
    # a recording forward that reads nothing: every weight is named as never read
    with pytest.raises(OffloadError, match="never read by the recorded forward"):
        apply_offload(model, model.model, cfg, cpu, lambda: None, host=host)
    # without an engine, running an offloaded module is a loud error, not garbage
    with pytest.raises(OffloadError, match="'lm_head.weight' is offloaded and no engine"):
        model.lm_head(torch.zeros(1, 64))


class StreamDag:
    """Stands in for the engine's CUDA streams: records every copy, wait, event and kernel
    as a DAG with GPU semantics (two in-order streams, events as cross edges) so a test
    can look for races a synchronous CPU copy would hide."""

    cuda = False

    def __init__(self, engine) -> None:
        self.engine = engine
        self.preds: list[set[int]] = []
        self.nodes: list[tuple[str, int, int, int]] = []  # (kind, access, ptr, nbytes)
        self.last = {"compute": None, "copy": None}
        self.copied: dict[int, int | None] = {}
        self.computed: dict[int, int | None] = {}

    def _add(self, stream: str, kind: str, j: int = -1, t: torch.Tensor | None = None,
             after: tuple = ()) -> int:
        preds = {p for p in (self.last[stream], *after) if p is not None}
        self.preds.append(preds)
        ptr, n = (t.data_ptr(), t.numel() * t.element_size()) if t is not None else (0, 0)
        self.nodes.append((kind, j, ptr, n))
        self.last[stream] = len(self.nodes) - 1
        return self.last[stream]

    def fork(self) -> None:
        self._add("copy", "wait", after=(self.last["compute"],))

    def join(self) -> None:
        self._add("compute", "wait", after=(self.last["copy"],))

    def copy_in(self, dst, src, j, after) -> None:
        for k in after:
            self._add("copy", "wait", after=(self.computed[k],))
        self.copied[j] = self._add("copy", "copy", j, dst)

    def wait_copied(self, j) -> None:
        self._add("compute", "wait", after=(self.copied[j],))

    def mark_computed(self, j) -> None:  # the kernel of j was enqueued just before
        self.computed[j] = self._add("compute", "kernel", j, self.engine.views[j])

    def before(self, a: int, b: int) -> bool:
        """a happens before b."""
        seen, todo = set(), [b]
        while todo:
            n = todo.pop()
            if n == a:
                return True
            for p in self.preds[n] - seen:
                seen.add(p)
                todo.append(p)
        return False

    def races(self) -> list[str]:
        """Kernels that may read bytes their own copy has not landed, or that another copy
        may overwrite before they are done."""
        out = []
        copies = [i for i, n in enumerate(self.nodes) if n[0] == "copy"]
        for k, (kind, j, ptr, n) in enumerate(self.nodes):
            if kind != "kernel" or j in getattr(self.engine, "kept", ()):
                continue
            src = max((c for c in copies if c < k and self.nodes[c][1] == j), default=None)
            if src is None or not self.before(src, k):
                out.append(f"kernel {j} does not wait for its copy")
                continue
            for c in copies:
                _, i, cp, cn = self.nodes[c]
                if c != src and cp < ptr + n and ptr < cp + cn:
                    if not (self.before(c, src) or self.before(k, c)):
                        out.append(f"copy of {i} races kernel {j}")
        return out


@pytest.mark.parametrize("mode,graph", [("ring", "eager"), ("ring", "graph"), ("lru", "eager")])
@pytest.mark.parametrize("extra", [0, 2048])
def test_no_copy_races_a_kernel_under_gpu_stream_semantics(tiny_llama, mode, graph, extra):
    probe = make_worker(tiny_llama, OffloadConfig(budget_bytes=10**9, mode="sync"))
    floor = probe.offload.floor.bytes
    w = make_worker(tiny_llama, OffloadConfig(budget_bytes=floor + extra, mode=mode), graph)
    dag = StreamDag(w.offload)
    w.offload.streams = dag
    run(w)  # prefill (piecewise splits in graph mode) then decode steps
    kernels = sum(1 for n in dag.nodes if n[0] == "kernel")
    assert kernels >= 4 * len(w.offload.names) - len(getattr(w.offload, "kept", ()))
    assert dag.races() == []


def test_served_lru_offload_runs_eagerly_on_every_rank_and_the_coordinator(ray_session,
                                                                            tiny_llama):
    """lru moves weights between steps: graph mode (the default) must fall back to eager on
    the coordinator's side too, or it would key and capture steps the workers never run."""
    from raygraph.client.connect import start_coordinator
    from raygraph.config import ParallelConfig, SchedulerConfig
    from raygraph.protocol import SamplingParams
    from tests.hf_ref import hf_greedy

    cfg = ServeConfig(model=str(tiny_llama), device="cpu", parallel=ParallelConfig(tp=2),
                      offload=OffloadConfig(budget_bytes=10**9, mode="lru"),
                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                      coordinator_name="offload-lru")
    assert cfg.graph.mode == "graph" and not cfg.uses_graphs
    coord = start_coordinator(cfg)
    try:
        out = ray_session.get(coord.generate.remote(
            [[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True)))
        assert out[0].token_ids == hf_greedy(tiny_llama, [[5, 6, 7]], 4)[0]
        assert ray_session.get(coord.capture_report.remote()) == []
        stats = ray_session.get(coord.worker_stats.remote())
        assert all(s["offload"] is not None for s in stats)
    finally:
        ray_session.get(coord.shutdown.remote())
        ray_session.kill(coord)
