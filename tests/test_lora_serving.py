"""LoRA serving: the adapter registry and hot-slot manager (pure Python), then a real
coordinator on CPU with 2 slots and 4 adapters (greedy tokens equal HF + PEFT while adapters
swap between slots; the prefix cache is not shared across adapters; load/unload at run
time), and the HTTP routes with the official `openai` client."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import msgspec
import openai
import pytest

from raygraph.api.app import HttpConfig
from raygraph.api.server import start_http, stop_http
from raygraph.client.connect import start_coordinator
from raygraph.config import DEFAULT_MODEL, ModelConfig, ParallelConfig
from raygraph.engine.group import WorkerGroup
from raygraph.engine.lora import LoRAAdmission, LoRARegistry
from raygraph.engine.sequence import Sequence
from raygraph.errors import LoRAError, UnknownAdapter
from raygraph.lora import read_adapter
from raygraph.protocol import LoRALoad, SamplingParams, StepOutput
from tests import test_lora
from tests.hf_ref import hf_greedy
from tests.test_lora import MODEL, config

NAMES = ["attn8", "mlp16", "all64", "all16rs"]  # tests/test_lora.py ADAPTERS, in order
SHARED = [11, 22, 33, 44, 55, 66, 77, 88, 99]  # every adapter's prompt: its blocks cached
PROMPTS = {None: [SHARED, [7, 8, 9]], **{n: [SHARED, [100 + i, 5, 6, 200 + i]]
                                         for i, n in enumerate(NAMES)}}
MAX_TOKENS = 6
adapters = test_lora.adapters  # its fixture: PEFT adapters of every module set and rank


# ---- the registry and slot manager ------------------------------------------------------

def registry(slots: int = 2, names: str = "abcd") -> LoRARegistry:
    r = LoRARegistry(slots, read_rank=lambda path: 8)
    for n in names:
        r.register(n, f"/adapters/{n}")
    return r


def test_ids_are_distinct_and_names_unique():
    r = registry()
    assert [a.adapter_id for a in r.adapters()] == [1, 2, 3, 4]
    with pytest.raises(LoRAError, match="'a' is already loaded"):
        r.register("a", "/elsewhere")
    with pytest.raises(UnknownAdapter, match="'z' does not exist"):
        r.open("z")


def test_hits_free_slots_then_lru_among_unpinned():
    r = registry()
    ga, gb = r.acquire("a"), r.acquire("b")
    assert (ga.slot, ga.load, gb.slot, gb.load) == (0, True, 1, True)
    assert r.acquire("a").load is False  # hot: a hit, pinned twice
    r.release(ga.slot), r.release(ga.slot), r.release(gb.slot)  # b used last
    gc = r.acquire("c")
    assert (gc.slot, gc.evicted) == (0, "a")  # a was least recently used: demoted
    r.release(gc.slot)
    gd = r.acquire("d")
    assert (gd.slot, gd.evicted) == (1, "b")
    assert r.hot() == ["c", "d"]
    s = r.stats()
    assert (s["hits"], s["misses"], s["hot_hit_rate"]) == (1, 4, 0.2)
    assert ["hot", "warm", 2] in s["moves"]


def test_all_pinned_waits_until_a_release():
    r = registry()
    ga, gb = r.acquire("a"), r.acquire("b")
    assert r.acquire("c") is None  # every slot pinned: c waits
    assert r.acquire("a").load is False  # a hot adapter's request does not
    r.release(gb.slot)
    assert r.acquire("c").slot == gb.slot
    assert r.pinned(ga.slot) == 2


def test_unregister_refused_while_in_use_and_frees_the_slot():
    r = registry()
    r.open("a")
    g = r.acquire("a")
    with pytest.raises(LoRAError, match="in use by 1 request"):
        r.unregister("a")
    r.release(g.slot)
    r.close("a")
    r.unregister("a")
    assert r.hot() == [None, None] and [a.name for a in r.adapters()] == ["b", "c", "d"]
    r.register("a", "/adapters/a")
    assert r.get("a").adapter_id == 5  # a new id: its old cached blocks are never reused


def test_load_failure_frees_the_slot_and_timings_are_counted():
    r = registry()
    g = r.acquire("a")
    r.load_failed(g.slot)
    assert r.hot() == [None, None] and r.get("a").slot is None
    r.loaded("warm", 0.0004)
    r.loaded("cold", 0.3)
    s = r.stats()
    assert sum(s["load_seconds"]["counts"]) == 2 and ["warm", "hot", 1] in s["moves"]
    assert s["load_ms"]["warm"] == {"count": 1, "p50": 0.4, "p90": 0.4, "p99": 0.4, "max": 0.4}


def seq(i: int) -> Sequence:
    return Sequence(i, [5, 6], SamplingParams(max_tokens=2))


def test_loads_ride_on_the_next_step_and_a_failed_one_fails_only_its_requests():
    r = registry()
    adm = LoRAAdmission(r)
    ready = adm.admit([(seq(0), "a"), (seq(1), None), (seq(2), "b"), (seq(3), "a")])
    assert [(s.seq_id, s.lora_slot) for s in ready] == [(1, -1), (0, 0), (2, 1), (3, 0)]
    assert adm.take_loads() == [(0, "/adapters/a"), (1, "/adapters/b")]
    assert adm.take_loads() == []  # taken by the step that carries them
    a_id = r.get("a").adapter_id
    failed = adm.loaded([LoRALoad(0, "cold", 0.01), LoRALoad(1, "cold", 0.02),
                         LoRALoad(0, "cold", 0.03, "rank 1: LoRA adapter '/adapters/a': gone"),
                         LoRALoad(1, "cold", 0.05)])  # two ranks' reports
    assert failed == [(i, "loading LoRA adapter 'a' failed: rank 1: LoRA adapter "
                          "'/adapters/a': gone") for i in (0, 3)]
    assert r.hot() == [None, "b"] and r.pinned(0) == 0
    s = r.stats()  # b counted once, at the slowest rank's time
    assert s["load_ms"]["cold"]["count"] == 1 and s["load_ms"]["cold"]["max"] == 50.0
    assert r.get("a").adapter_id != a_id  # blocks computed without it are not its own
    late = adm.admit([(seq(4), "a")])[0]
    assert late.adapter_id == r.get("a").adapter_id and adm.take_loads() == [(0, "/adapters/a")]
    # a slot freed and granted again before any step: only its last load is sent
    adm.release(late)
    adm.admit([(seq(5), "c")])
    assert adm.take_loads() == [(0, "/adapters/c")]


def test_the_group_reply_carries_every_ranks_loads():
    """TP ranks that do not sample answer a step only when it loaded slots."""
    enc = msgspec.msgpack.Encoder().encode
    group = WorkerGroup([], ParallelConfig(tp=2, dp=2, ep=4))
    outs = [enc(StepOutput(7, [1], lora_loads=[LoRALoad(0, "warm", 0.1)])),
            enc(StepOutput(-1, [], lora_loads=[LoRALoad(0, "warm", 0.2, "x")])),
            enc(StepOutput(7, [2], lora_loads=[LoRALoad(0, "warm", 0.3)])), None]
    group._execute = lambda deltas, timeout: outs
    got = group.step([b"", b""], timeout=1)
    assert [o.token_ids for o in got] == [[1], [2]]
    assert [[x.seconds for x in o.lora_loads] for o in got] == [[0.1, 0.2], [0.3]]


def test_a_bad_adapter_is_refused_with_one_line_and_not_registered(adapters, tmp_path):
    cfg = ModelConfig.from_pretrained(DEFAULT_MODEL)
    r = LoRARegistry(2, lambda p: read_adapter(p, cfg, 16).rank)
    with pytest.raises(LoRAError, match="rank 64 is over max_lora_rank 16") as e:
        r.register("big", str(adapters[2]))
    assert "\n" not in str(e.value)
    with pytest.raises(LoRAError, match="not a directory"):
        r.register("missing", str(tmp_path / "nope"))
    assert r.adapters() == [] and r.register("ok", str(adapters[0])).rank == 8
    # the coordinator's reader checks the served target modules (attn8 has k_proj, o_proj)
    qv = LoRARegistry(2, lambda p: read_adapter(p, cfg, 64, ("q_proj", "v_proj")).rank)
    with pytest.raises(LoRAError, match="targets 'k_proj', which has no adapter slots .*"
                                        "--lora-target-modules"):
        qv.register("attn", str(adapters[0]))


# ---- a coordinator with 2 slots and 4 adapters --------------------------------------------

@pytest.fixture(scope="module")
def expected(adapters) -> dict[str | None, list[list[int]]]:
    paths = dict(zip(NAMES, adapters))
    return {name: hf_greedy(MODEL, prompts, MAX_TOKENS, paths.get(name))
            for name, prompts in PROMPTS.items()}


@pytest.fixture(scope="module")
def coord(ray_session, adapters, tmp_path_factory):
    modules = tuple((n, str(p)) for n, p in zip(NAMES, adapters))
    cfg = config(max_loras=2, modules=modules,
                 allowed_dirs=(str(tmp_path_factory.getbasetemp()),))
    handle = start_coordinator(msgspec.structs.replace(cfg, coordinator_name="lora-test"))
    yield handle
    ray_session.get(handle.shutdown.remote())
    ray_session.kill(handle)


def greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0, lora=lora)


def test_a_burst_of_4_adapters_over_2_slots_equals_hf_peft(ray_session, coord, expected):
    base = ray_session.get(coord.generate.remote([SHARED], greedy(None)))  # cached blocks
    assert base[0].token_ids == expected[None][0]
    calls = {name: coord.generate.remote(PROMPTS[name], greedy(name)) for name in PROMPTS}
    got = {name: [r.token_ids for r in ray_session.get(ref)] for name, ref in calls.items()}
    assert got == expected
    # the shared prompt under each adapter: its own tokens, never the base model's blocks'
    assert len({tuple(expected[n][0]) for n in PROMPTS}) > 1
    lora = ray_session.get(coord.stats.remote())["lora"]
    assert lora["misses"] >= 4 and lora["requests"] == {n: 2 for n in NAMES}
    assert lora["pinned"] == 0 and sum(n for f, t, n in lora["moves"] if t == "hot") >= 4


def test_unknown_adapter_is_refused(ray_session, coord):
    with pytest.raises(Exception, match="'nope' does not exist"):
        ray_session.get(coord.generate.remote([[5, 6]], greedy("nope")))


def test_a_failing_cold_load_fails_only_its_requests(ray_session, coord, adapters, expected,
                                                    tmp_path):
    """An adapter whose files went away after registration: its requests end with one
    line; the requests in the same steps, base and adapters, complete; its slot is free."""
    shutil.copytree(adapters[0], tmp_path / "gone")
    ray_session.get(coord.load_lora_adapter.remote("gone", str(tmp_path / "gone")))
    shutil.rmtree(tmp_path / "gone")
    calls = {name: coord.generate.remote(PROMPTS[prompts], greedy(name))
             for name, prompts in ((None, None), ("gone", "attn8"), ("mlp16", "mlp16"))}
    with pytest.raises(Exception, match="loading LoRA adapter 'gone' failed: rank 0: .*"
                                        "adapter_model.safetensors"):
        ray_session.get(calls.pop("gone"))
    assert {n: [r.token_ids for r in ray_session.get(ref)] for n, ref in calls.items()} == {
        n: expected[n] for n in calls}
    lora = ray_session.get(coord.stats.remote())["lora"]
    assert lora["pinned"] == 0 and lora["requests"]["gone"] == 2
    ray_session.get(coord.unload_lora_adapter.remote("gone"))  # no request holds it


def test_load_and_unload_at_run_time(ray_session, coord, adapters, expected, tmp_path):
    info = ray_session.get(coord.load_lora_adapter.remote("late", str(adapters[1])))
    assert info["rank"] == 16 and info["adapter_id"] > len(NAMES)
    r = ray_session.get(coord.generate.remote(PROMPTS["mlp16"], greedy("late")))
    assert [x.token_ids for x in r] == expected["mlp16"]
    names = [a["name"] for a in ray_session.get(coord.list_lora_adapters.remote())]
    assert "late" in names
    ray_session.get(coord.unload_lora_adapter.remote("late"))
    with pytest.raises(Exception, match="'late' does not exist"):
        ray_session.get(coord.generate.remote([[5, 6]], greedy("late")))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text('{"r": "SECRET"}')
    with pytest.raises(Exception, match="'bad' cannot be loaded") as e:
        ray_session.get(coord.load_lora_adapter.remote("bad", str(tmp_path / "bad")))
    assert "SECRET" not in str(e.value) and str(tmp_path) not in str(e.value)


@pytest.mark.parametrize("path", ["/etc", "/no/such/dir", "{tmp}/../../../etc"])
def test_run_time_loads_only_from_the_allowed_dirs_and_say_nothing_of_other_paths(
        ray_session, coord, tmp_path, path):
    with pytest.raises(Exception, match="limited to the directories named by "
                                        "--lora-allowed-dir") as e:
        ray_session.get(coord.load_lora_adapter.remote("x", path.format(tmp=tmp_path)))
    assert "exist" not in str(e.value) and "not a directory" not in str(e.value)


def test_the_registry_is_capped_and_untrusted_paths_are_checked_before_reading(tmp_path):
    reads = []
    r = LoRARegistry(2, lambda p: reads.append(p) or 8, max_adapters=2)
    r.register("a", "/adapters/a")
    r.register_untrusted("b", str(tmp_path / "b"), (str(tmp_path),))
    with pytest.raises(LoRAError, match="2 LoRA adapters are registered"):
        r.register_untrusted("c", str(tmp_path / "c"), (str(tmp_path),))
    r.unregister("a")
    with pytest.raises(LoRAError, match="run-time LoRA loading is off"):
        r.register_untrusted("d", str(tmp_path / "d"), ())
    with pytest.raises(LoRAError, match="limited to the directories"):
        r.register_untrusted("e", str(tmp_path / ".." / "e"), (str(tmp_path),))
    assert reads == ["/adapters/a", str(tmp_path / "b")]  # refused paths were never read
# ---- HTTP ---------------------------------------------------------------------------------

def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_model_field_models_list_and_routes(coord, adapters, expected):
    _, url = start_http(HttpConfig(port=0, enable_lora_updates=True), "lora-test",
                        "raygraph")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="attn8", prompt=PROMPTS["attn8"][1],
                                        max_tokens=MAX_TOKENS, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert out.model == "attn8"
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        assert e.value.body["code"] == "model_not_found"
        models = {m.id: m for m in client.models.list().data}
        base = MODEL.name
        assert set(models) == {base, *NAMES} and models["attn8"].parent == base
        assert models["attn8"].root == "attn8"  # its name, not a path on the server
        status, body = post(url + "/v1/load_lora_adapter",
                            {"lora_name": "extra", "lora_path": str(adapters[0])})
        assert status == 200
        assert "extra" in {m.id for m in client.models.list().data}
        status, body = post(url + "/v1/load_lora_adapter",
                            {"lora_name": "bad", "lora_path": "/no/such/dir"})
        assert status == 400 and "--lora-allowed-dir" in body["error"]["message"]
        assert post(url + "/v1/unload_lora_adapter", {"lora_name": "extra"})[0] == 200
        assert post(url + "/v1/unload_lora_adapter", {"lora_name": "extra"})[0] == 404
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            metrics = r.read().decode()
        for line in ('raygraph:lora_requests_total{adapter="attn8",model_name=',
                     'raygraph:lora_promotions_total{from="cold",model_name=',
                     "raygraph:lora_load_seconds_bucket{", "raygraph:lora_hot_hit_rate{"):
            assert line in metrics, line
    finally:
        stop_http("lora-test", "raygraph")
