"""Two GPUs, NCCL: DP=2 x EP=2 with graphs (keys carry the dispatch size) generates the
eager tokens for an unbalanced workload, and the ranks' capture records agree."""

from __future__ import annotations

import msgspec
import pytest

from raygraph.client.connect import start_coordinator
from raygraph.protocol import SamplingParams
from tests.conftest import make_checkpoint
from tests.multirank.test_dp_ep import ARCHS, MAX_TOKENS, PROMPTS, config

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    # wider random weights than HF's 0.02: a tiny random model's logits are otherwise so flat
    # that fp32 kernel differences (padded bucket vs exact batch) flip near-tied argmaxes
    return {name: make_checkpoint(tmp_path_factory.mktemp(name), arch, initializer_range=0.2,
                                  **kw) for name, (arch, kw) in ARCHS.items()}


LAYOUTS = [("mixtral", 1, 2, 2), ("qwen2_moe", 1, 2, 2),
           pytest.param("mixtral", 2, 2, 4, marks=pytest.mark.gpu4)]


@pytest.mark.parametrize("arch,tp,dp,ep", LAYOUTS)
def test_dp_ep_graphs_generate_the_eager_tokens(ray_session, ckpts, arch, tp, dp, ep):
    outs = {}
    for mode in ("graph", "eager"):
        cfg = config(ckpts[arch], f"gpu-moe-{arch}-{tp}{dp}{ep}-{mode}", tp, dp, ep)
        cfg = msgspec.structs.replace(cfg, device="cuda", dtype="float32",
                                      graph=msgspec.structs.replace(cfg.graph, mode=mode))
        coord = start_coordinator(cfg)
        try:
            refs = [coord.generate.remote(p, SamplingParams(max_tokens=n, ignore_eos=True))
                    for p, n in zip(PROMPTS * 3, MAX_TOKENS * 3)]
            outs[mode] = [ray_session.get(r)[0].token_ids for r in refs]
            if mode == "graph":
                reports = ray_session.get(coord.capture_report.remote())
                assert reports and all(r.agree and r.nodes for r in reports)
                assert any(r.key.num_comm_tokens > r.key.num_tokens for r in reports)
        finally:
            ray_session.get(coord.shutdown.remote())
            ray_session.kill(coord)
    assert outs["graph"] == outs["eager"]

