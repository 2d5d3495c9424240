"""Replicas on a real multi-node Ray cluster (Ray's own `cluster_utils.Cluster`: a head and
two more nodes, each with its own raylet and resources, on this machine): one replica per
node, each one's greedy tokens equal to HF's; the official OpenAI client streams through
the engines; a node lost under load ends no request on the other replicas and sends the lost
replica's plain requests elsewhere; the replica comes back when a node joins."""

from __future__ import annotations

import time

import pytest

from raygraph.client.connect import start_coordinator
from raygraph.config import DEFAULT_MODEL, CacheConfig, ReplicaConfig, ServeConfig
from raygraph.protocol import SamplingParams
from raygraph.tokenizer import load_tokenizer
from tests.hf_ref import hf_greedy

pytestmark = pytest.mark.own_ray

PROMPTS = ["The import statement", "A class definition", "Exceptions can be raised"]
MAX_TOKENS = 8


# the GCS declares a node dead after 3 failed health checks 1 s apart (Ray's defaults: 5, 3 s
# apart), so the lost node's replica is noticed in seconds
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster(shared_stopper):
    """A cluster of three one-CPU nodes in place of the suite's Ray, which does not come back:
    own_ray modules run last (conftest)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        shared_stopper()
        ray.shutdown()
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 1, "_system_config": HEALTH_CHECKS})
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="raygraph-tests", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def serving(coord) -> list:
    import ray

    return [s for s in ray.get(coord.replica_states.remote()) if s.state == "serving"]


def test_replicas_spread_fail_alone_and_come_back(cluster):
    import openai
    import ray

    from raygraph.api.front import HttpConfig
    from raygraph.api.server import start_http, stop_http

    cfg = ServeConfig(model=DEFAULT_MODEL, device="cpu", cache=CacheConfig(num_blocks=64),
                      replica=ReplicaConfig(replicas=3), coordinator_name="replicas-test",
                      step_timeout_s=30)
    coord = start_coordinator(cfg)
    try:
        states = ray.get(coord.replica_states.remote())
        assert [s.state for s in states] == ["serving"] * 3
        nodes = [s.node_id for s in states]
        assert len(set(nodes)) == 3, nodes  # one replica per node
        assert set(nodes) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}

        # each replica computes what HF computes
        tok = load_tokenizer(DEFAULT_MODEL)
        ids = [tok.encode(p) for p in PROMPTS]
        want = hf_greedy(DEFAULT_MODEL, ids, MAX_TOKENS)
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for s in states:
            got = ray.get(s.engine.generate.remote(ids, greedy))
            assert [r.token_ids for r in got] == want, f"replica {s.replica}"
            assert {r.request_id >> 48 for r in got} == {s.replica}

        # the OpenAI client, streaming through the engines (one subscription each)
        servers, url = start_http(HttpConfig(port=0), cfg.coordinator_name, cfg.namespace)
        client = openai.OpenAI(base_url=url.split("/v1")[0] + "/v1", api_key="none")
        model = client.models.list().data[0].id
        for prompt in PROMPTS * 2:
            stream = client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                               temperature=0.0, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices)
        stop_http(cfg.coordinator_name, cfg.namespace)
        del servers

        # lose a node (not the head's) under a stream of plain requests
        head = ray.get_runtime_context().get_node_id()
        lost = next(s for s in states if s.node_id != head)
        node = next(n for n in cluster.list_all_nodes() if n.node_id == lost.node_id)
        long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        refs = [coord.generate.remote([p], long) for p in PROMPTS * 4]
        time.sleep(0.5)
        cluster.remove_node(node, allow_graceful=False)
        results = [r for ref in refs for r in ray.get(ref, timeout=120)]
        assert all(r.finish_reason == "length" and len(r.token_ids) == 24 for r in results)
        assert ray.get(coord.stats.remote())["healthy"]
        t0 = time.monotonic()  # Ray may take a few seconds to declare the node dead
        while lost.replica in [s.replica for s in serving(coord)]:
            assert time.monotonic() - t0 < 60, ray.get(coord.replica_states.remote())
            time.sleep(0.5)
        assert len(serving(coord)) == 2  # no room for it anywhere: it waits

        # a node joins: the lost replica starts there and serves
        cluster.add_node(num_cpus=1)
        t0 = time.monotonic()
        while len(serving(coord)) < 3:
            assert time.monotonic() - t0 < 120, ray.get(coord.replica_states.remote())
            time.sleep(1)
        back = ray.get(coord.replica_states.remote())[lost.replica]
        assert back.node_id not in nodes  # the new node
        got = ray.get(back.engine.generate.remote(ids, greedy))
        assert [r.token_ids for r in got] == want
        assert ray.get(coord.stats.remote())["replica_restarts"] == 1
    finally:
        ray.get(coord.shutdown.remote())
        ray.kill(coord)
