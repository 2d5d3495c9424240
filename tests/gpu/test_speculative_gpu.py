"""GPU: speculative decoding on the built-in model in float32, verify steps as decode rows
in the captured decode graphs: greedy tokens equal those without speculation, and seeded
sampled requests draw the same tokens again (rejection sampling on the device). The draft
model's proposal loop runs in its own graphs (graph mode) or eagerly."""

from __future__ import annotations

import pytest

from tests.test_speculative_served import served, spec_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_greedy_tokens_with_speculation_equal_without(mode):
    plain, _ = served(False, mode, device="cuda")
    spec, sched = served(True, mode, device="cuda")
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens > 0


@pytest.mark.parametrize("mode,blocks", [("graph", 128), ("eager", 128), ("graph", 12)])
def test_a_draft_model_keeps_greedy_tokens(mode, blocks, random_draft):
    """A random draft model: the same greedy tokens as without (12 blocks: preemption)."""
    plain, _ = served(False, mode, blocks, device="cuda")
    spec, sched = served("draft", mode, blocks, device="cuda", draft=random_draft)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert sched.num_draft_tokens > 0


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_model_drafting_for_itself_keeps_nearly_every_draft(mode):
    """The built-in model as its own draft model (its proposal loop in graphs, or eager)
    proposes the target's greedy tokens: nearly every draft kept, tokens as without."""
    from raygraph.config import DEFAULT_MODEL

    plain, _ = served(False, mode, device="cuda")
    spec, sched = served("draft", mode, device="cuda", draft=DEFAULT_MODEL)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert sched.num_draft_tokens >= 80
    assert sched.num_accepted_tokens >= 0.9 * sched.num_draft_tokens


def test_a_drafting_worker_sleeps_and_captures_its_drafters_graphs_again():
    """Sleep drops the draft model's graphs (their torch pool's memory goes back); wake
    captures as many again; tokens as before sleep, nearly every draft still kept."""
    from raygraph.config import DEFAULT_MODEL

    record: dict = {}
    before, _ = served("draft", device="cuda", draft=DEFAULT_MODEL, record=record)
    worker = record["worker"]
    drafter = worker.drafter
    graphs = len(drafter.graphs) + len(drafter.pass_graphs)
    assert graphs > 0
    stats = worker.sleep(1)
    assert not drafter.graphs and not drafter.pass_graphs and stats.graph_bytes > 0
    woke = worker.wake_up()
    assert len(drafter.graphs) + len(drafter.pass_graphs) == graphs and woke.graph_bytes > 0
    after, sched = served("draft", device="cuda", draft=DEFAULT_MODEL, worker=worker)
    assert [s.output_token_ids for s in after] == [s.output_token_ids for s in before]
    assert sched.num_accepted_tokens >= 0.9 * sched.num_draft_tokens > 0


def test_in_background_capture_the_drafter_runs_eagerly_until_the_decode_keys_bring_its_graphs():
    """Background capture: a drafting worker serves at once, its drafter eagerly (no graph
    captured on use); capturing the decode keys captures the drafter's graphs, as many as
    at start-up capture; tokens the same all along, nearly every draft kept."""
    from raygraph.config import DEFAULT_MODEL
    from tests.conftest import loaded_worker

    record: dict = {}
    reference, _ = served("draft", device="cuda", draft=DEFAULT_MODEL, record=record)
    at_start = record["worker"].drafter
    graphs = (len(at_start.graphs), len(at_start.pass_graphs))
    assert graphs[0] > 0

    def background_worker():
        cfg = spec_config("draft", device="cuda", draft=DEFAULT_MODEL, capture="background")
        return loaded_worker(cfg, 128)

    worker = background_worker()
    worker.executor.capture_all()  # the target's keys only, as if captured before the drafter
    eager, _ = served("draft", device="cuda", draft=DEFAULT_MODEL, worker=worker)
    drafter = worker.drafter
    assert not drafter.graphs and not drafter.pass_graphs  # nothing captured on use
    assert [s.output_token_ids for s in eager] == [s.output_token_ids for s in reference]
    # captured after serving (its buffers and table mirrors hold a served step's), then
    # serving again from its graphs
    drafter.capture_upto(drafter.max_seqs, worker.executor.prev_tokens)
    assert (len(drafter.graphs), len(drafter.pass_graphs)) == graphs
    again, _ = served("draft", device="cuda", draft=DEFAULT_MODEL, worker=worker)
    assert [s.output_token_ids for s in again] == [s.output_token_ids for s in reference]

    worker = background_worker()
    for key in worker.executor.schedule():
        worker.capture(key)
    drafter = worker.drafter
    assert (len(drafter.graphs), len(drafter.pass_graphs)) == graphs
    after, sched = served("draft", device="cuda", draft=DEFAULT_MODEL, worker=worker)
    assert [s.output_token_ids for s in after] == [s.output_token_ids for s in reference]
    assert sched.num_accepted_tokens >= 0.9 * sched.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_requests_speculate_reproducibly(method):
    from raygraph.config import DEFAULT_MODEL

    spec, draft = (True, "") if method == "ngram" else ("draft", DEFAULT_MODEL)
    (first, sched), (again, _) = (served(spec, temperature=0.8, device="cuda", draft=draft)
                                  for _ in range(2))
    assert sched.num_draft_tokens > 0
    assert all(len(s.output_token_ids) == 40 for s in first)
    assert [s.output_token_ids for s in first] == [s.output_token_ids for s in again]


@pytest.mark.parametrize("mode,blocks", [("graph", 12), ("eager", 128)])
def test_an_eagle3_head_keeps_greedy_tokens(mode, blocks, eagle3_head):
    """A random EAGLE-3 head (its passes in graphs, or eager): tokens as without."""
    plain, _ = served(False, mode, blocks, device="cuda")
    spec, sched = served("eagle3", mode, blocks, device="cuda", draft=eagle3_head)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert sched.num_draft_tokens > 0


def test_eagle3_proposals_follow_the_heads_math_on_gpu(eagle3_head):
    """The proposals of the graphs (decode kernel, Triton GEMMs) against the head's math from
    scratch on the same GPU: 90% equal (different kernels round differently)."""
    from tests.test_speculative_served import eagle3_reference

    record: dict = {}
    served("eagle3", "graph", 12, device="cuda", draft=eagle3_head, record=record)
    proposals, worker = record["proposals"], record["worker"]
    equal = sum(drafts == eagle3_reference(worker, tokens, len(drafts))
                for tokens, drafts in proposals)
    assert len(proposals) >= 20 and equal >= 0.9 * len(proposals), (equal, len(proposals))
