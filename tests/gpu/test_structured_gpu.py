"""GPU: JSON-schema constrained decoding through the captured graphs and the overlapped
loop (free and constrained rows in one batch) gives valid output and the eager path's
tokens, on the built-in model."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.structured import schemas
from raygraph.config import DEFAULT_MODEL, CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.engine.sequence import Sequence
from raygraph.grammar import Grammars
from raygraph.protocol import SamplingParams, StructuredOutputs
from raygraph.tokenizer import load_tokenizer
from tests.conftest import loaded_worker, serve_in_process

pytestmark = pytest.mark.gpu


def run(mode: str, grammars: Grammars, tok) -> list[Sequence]:
    """The 50 schemas' requests plus as many free ones, greedy, in one engine."""
    blocks = 1024
    cfg = ServeConfig(model=DEFAULT_MODEL, device="cuda", dtype="float32",
                      cache=CacheConfig(block_size=16, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=1024),
                      graph=GraphConfig(mode=mode))
    worker = loaded_worker(cfg, blocks, capture=True)
    seqs = []
    for i, s in enumerate(schemas()):
        for guided in (True, False):
            spec = StructuredOutputs("json", json.dumps(s)) if guided else None
            sp = SamplingParams(max_tokens=96, temperature=0.0, structured=spec).resolved()
            seq = Sequence(len(seqs), tok.encode(f"Record {i} as JSON:"), sp)
            seq.guide = grammars.guide(spec) if guided else None
            seqs.append(seq)
    return serve_in_process(cfg, worker, seqs, blocks)


def test_constrained_rows_through_graphs_validate_and_equal_eager():
    tok = load_tokenizer(DEFAULT_MODEL)
    grammars = Grammars(tok.hf)
    graph, eager = run("graph", grammars, tok), run("eager", grammars, tok)
    for i, s in enumerate(schemas()):
        g = graph[2 * i]
        assert g.finish_reason == "stop", (s, tok.decode(g.output_token_ids))
        jsonschema.validate(json.loads(tok.decode(g.output_token_ids)), s)
    assert [s.output_token_ids for s in graph] == [s.output_token_ids for s in eager]
