"""Structured outputs: 50 JSON schemas, regexes, choices and a grammar through a real
coordinator with the default model, greedy and sampled, every output validated; the
scheduler's rule for constrained sequences (never fed, sent with their mask once their last
token is known) and the sampler's masking, each against the real llguidance matcher."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest
import torch

from bench.structured import ENDLESS, INT, NAME, obj, schemas
from raygraph.config import DEFAULT_MODEL, SchedulerConfig, ServeConfig
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler, SchedulerOutput
from raygraph.engine.sequence import Sequence
from raygraph.errors import BadRequest
from raygraph.grammar import Grammars, structured_of
from raygraph.protocol import NewSeq, SamplingParams, SeqChunk, StepDelta, StructuredOutputs
from raygraph.tokenizer import load_tokenizer
from raygraph.worker.guides import Guides
from raygraph.worker.sampler import sample_tokens


@pytest.fixture(scope="module")
def coord(default_model_coord):
    return default_model_coord  # the session's (conftest): 64 sequences, 1,024-token steps


def run_all(ray, coord, jobs: list[tuple[str, SamplingParams]]) -> list:
    """Every (prompt, params) at once; the results in order."""
    return [ray.get(r)[0] for r in [coord.generate.remote(p, sp) for p, sp in jobs]]


def constrained(kind: str, value: str, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=160, structured=StructuredOutputs(kind, value), **kw)


@pytest.mark.parametrize("sampled", [False, True])
def test_fifty_json_schemas_always_validate(ray_session, coord, sampled):
    """Greedy and seeded sampling: every output parses and validates (jsonschema)."""
    kw = {"temperature": 1.0, "seed": 7} if sampled else {"temperature": 0.0}
    all_schemas = schemas()
    jobs = [(f"Record {i} as JSON:", constrained("json", json.dumps(s), **kw))
            for i, s in enumerate(all_schemas)]
    for s, r in zip(all_schemas, run_all(ray_session, coord, jobs)):
        assert r.finish_reason == "stop", (s, r.text)
        jsonschema.validate(json.loads(r.text), s)


def test_regex_choice_and_grammar_outputs_match(ray_session, coord):
    regexes = [r"[0-9]{3}-[a-z]{2}", r"(yes|no), because [a-z]{1,8}\.",
               r"[A-Z][a-z]{2,6} [0-9]{1,2}", r"0x[0-9a-f]{4}"]
    choices = [["apple", "banana", "cherry"], ["positive", "negative"]]
    grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [0-9] | [1-9] [0-9]\nop ::= "+" | "*"'
    jobs = [(f"Item {i}:", constrained("regex", rx, temperature=t, seed=i))
            for i, rx in enumerate(regexes) for t in (0.0, 1.0)]
    jobs += [("Pick one:", constrained("choice", json.dumps(c), temperature=t, seed=1))
             for c in choices for t in (0.0, 1.0)]
    jobs += [("Sum:", constrained("grammar", grammar, temperature=t, seed=2)) for t in (0.0, 1.0)]
    out = run_all(ray_session, coord, jobs)
    for (_, sp), r in zip(jobs, out):
        spec = sp.structured
        assert r.finish_reason == "stop", (spec, r.text)
        if spec.kind == "regex":
            assert re.fullmatch(spec.value, r.text), (spec.value, r.text)
        elif spec.kind == "choice":
            assert r.text in json.loads(spec.value)
        else:
            assert re.fullmatch(r"\((\d|[1-9]\d) [+*] (\d|[1-9]\d)\)", r.text), r.text


def test_constrained_and_free_requests_share_steps(ray_session, coord):
    """A free request batched with constrained ones gets the tokens it gets alone."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = ray_session.get(coord.generate.remote("Once upon a time", free))[0].token_ids
    jobs = [("Once upon a time", free)] + [
        (f"Record {i}:", constrained("json", json.dumps(obj({"n": INT}))))
        for i in range(6)]
    out = run_all(ray_session, coord, jobs)
    assert out[0].token_ids == alone
    assert all(json.loads(r.text)["n"] in range(-5, 100) for r in out[1:])


def test_constrained_rows_at_tp2(ray_session, default_model_tp2_coord):
    """Both ranks of a TP=2 group keep matchers and fill masks (each samples the tokens it
    feeds itself): constrained outputs match, free requests share their steps, nothing
    hangs."""
    schema = obj({"name": NAME, "age": INT})
    jobs = [(f"Person {i} as JSON:", constrained("json", json.dumps(schema), temperature=0.0))
            for i in range(3)]
    jobs += [("A list of three colors: ", constrained("regex", r"(red|green|blue), "
                                                      r"(red|green|blue), (red|green|blue)"))]
    jobs += [(f"Free text {i}", SamplingParams(max_tokens=24)) for i in range(2)]
    results = run_all(ray_session, default_model_tp2_coord, jobs)
    for r in results[:3]:
        jsonschema.validate(json.loads(r.text), schema)
    assert re.fullmatch(r"(red|green|blue), (red|green|blue), (red|green|blue)", results[3].text)
    assert all(len(r.token_ids) == 24 or r.finish_reason == "stop" for r in results[4:])


def test_a_bad_grammar_is_refused_before_anything_runs(ray_session, coord):
    before = ray_session.get(coord.stats.remote())["requests_started"]
    for kind, value, words in [("json", '{"type": "bogus"}', "bogus"),
                               ("json", "{not json", "json"),
                               ("regex", "a(b", "regex"), ("choice", "[]", "choice"),
                               ("grammar", "root ::= missing_rule", "grammar")]:
        with pytest.raises(BadRequest, match=words):
            ray_session.get(coord.generate.remote("x", constrained(kind, value)))
    assert ray_session.get(coord.stats.remote())["requests_started"] == before


def test_a_grammar_that_fails_mid_answer_fails_its_request_alone(ray_session, coord):
    """Past 2000 alternatives in one parser row llguidance's matcher fails on the first
    token: the request fails with the parser's words (it is not a finished answer), and the
    next request is served."""
    alts = " | ".join(f'"option_{i}_end"' for i in range(2100))
    with pytest.raises(BadRequest, match="failed mid-answer.*max is 2000"):
        ray_session.get(coord.generate.remote("x", constrained("grammar", f"start: {alts}")))
    (ok,) = ray_session.get(coord.generate.remote("x", constrained("choice", '["yes", "no"]')))
    assert ok.text in ("yes", "no") and ok.finish_reason == "stop"


@pytest.fixture(scope="module")
def grammars():
    return Grammars(load_tokenizer(str(DEFAULT_MODEL)).hf)


def test_a_constrained_sequence_is_fed_and_its_workers_get_its_grammar(grammars):
    """In the overlapped loop a constrained decode is fed like a free one (its token in
    flight): the workers fill its mask. They learn its grammar when it is first tracked,
    and on readmission after preemption its outputs so far, to replay."""
    sched = Scheduler(PagePool(64, 4), 8, 64, 128)
    free = Sequence(0, [5, 6, 7], SamplingParams(max_tokens=8).resolved())
    spec = StructuredOutputs("choice", json.dumps(["yes", "no"]))
    guided = Sequence(1, [5, 6, 8], SamplingParams(max_tokens=8, structured=spec).resolved())
    guided.guide = grammars.guide(spec)
    sched.add(free)
    sched.add(guided)
    first = sched.schedule()
    assert [(n.seq_id, n.structured, n.replay) for n in first.new] == [(0, None, []),
                                                                       (1, spec, [])]
    second = sched.schedule()  # tokens of the first step still in flight: both fed
    assert second.feed == [free, guided] and not second.chunks
    yes = [t for t in range(grammars.vocab) if allowed(guided.guide.mask(), t)][0]
    sched.update(first, [9, yes])
    out = SchedulerOutput([], [], [], [], [], [], 0)
    sched.running.remove(guided)
    sched._preempt(guided, out)
    guided.num_pending = 0  # its second token was discarded with the step
    third = sched.schedule()
    assert [(n.seq_id, n.replay) for n in third.new] == [(1, [yes])]


def test_worker_guides_mask_rows_and_follow_their_tokens(grammars):
    """The worker's matchers: a constrained row's mask is its grammar's, moves on with the
    token it got, a readmitted sequence replays its outputs, free rows have none, and a
    grammar that cannot build allows only EOS."""
    spec = StructuredOutputs("choice", json.dumps(["yes", "no"]))
    guides = Guides(str(DEFAULT_MODEL), 8, torch.device("cpu"))
    ref = grammars.guide(spec)
    start = ref.mask()
    yes = [t for t in range(grammars.vocab) if allowed(start, t)][0]
    guides.apply(StepDelta(0, new=[NewSeq(1, structured=spec), NewSeq(2),
                                   NewSeq(3, structured=spec, replay=[yes]),
                                   NewSeq(4, structured=StructuredOutputs("regex", "a("))]))
    chunks = [SeqChunk(i, [5], 0, [0], True) for i in (2, 1, 3, 4)]
    rows = guides.rows(chunks)
    assert rows == [(1, 1), (2, 3), (3, 4)]
    vocab = 5000  # the model's vocabulary may be larger than the grammar's
    sel, masks = guides.masks(rows, vocab)
    assert sel.tolist() == [1, 2, 3]
    ref.accept(yes)
    eos_only = torch.zeros(vocab, dtype=torch.bool)
    eos_only[grammars.eos] = True
    assert torch.equal(masks[0], unpacked(start, vocab))
    assert torch.equal(masks[1], unpacked(ref.mask(), vocab))
    assert torch.equal(masks[2], eos_only)
    guides.accept(rows, [0, yes, 0, 0])
    assert torch.equal(guides.masks(rows[:1], vocab)[1][0], unpacked(ref.mask(), vocab))
    guides.apply(StepDelta(1, drop=[1, 3, 4]))
    assert guides.rows(chunks) == []


def unpacked(mask: bytes, vocab: int) -> torch.Tensor:
    return torch.tensor([allowed(mask, t) if t < 8 * len(mask) else False
                         for t in range(vocab)])


def test_constrained_rows_sample_every_step(grammars):
    """A mixed batch in the served loop's logic: constrained rows get a token in every step
    the free rows do (the mask is filled on the worker while the step runs)."""
    from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion
    from tests.conftest import loaded_worker

    cfg = ServeConfig(device="cpu", scheduler=SchedulerConfig(max_num_seqs=8,
                                                              max_num_batched_tokens=64))
    worker = loaded_worker(cfg, 64)
    sched = Scheduler(PagePool(64, 16), 8, 64, 512)
    spec = StructuredOutputs("grammar", ENDLESS)
    seqs = []
    for i in range(8):
        guided = i < 4
        sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                            structured=spec if guided else None).resolved()
        seq = Sequence(i, [5 + i, 6, 7], sp)
        seq.guide = grammars.guide(spec) if guided else None
        sched.add(seq)
        seqs.append(seq)
    steps = run_to_completion(EngineCore([sched], None, ep=False), local_dispatch(worker))
    assert all(len(s.output_token_ids) == 24 for s in seqs[4:])
    assert steps <= 24 + 2  # a step behind at the end; constrained rows never sat one out
    tok = load_tokenizer(str(DEFAULT_MODEL))
    for s in seqs[:4]:
        text = tok.decode(s.output_token_ids)
        assert re.fullmatch(r"[a-z ]+(END)?", text), text
        assert len(s.output_token_ids) == 24 or (s.finish_reason, text[-3:]) == ("stop", "END")


def test_constrained_sequences_through_chunking_and_preemption(grammars):
    """The served loop's logic in one process (tokens fed on the device, replies a step
    late) with chunked prefill and, with few blocks, preemption: constrained outputs stay
    valid and equal to those of the unpressed run; free ones are unchanged."""
    from raygraph.config import CacheConfig
    from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion
    from tests.conftest import loaded_worker

    cfg = ServeConfig(device="cpu", cache=CacheConfig(block_size=4, num_blocks=96),
                      scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=12))
    worker = loaded_worker(cfg, 96)
    tok = load_tokenizer(str(DEFAULT_MODEL))
    spec = StructuredOutputs("json", json.dumps(obj({"name": NAME, "n": INT})))
    outs = {}
    for blocks in (96, 24):  # 24: sequences are preempted
        sched = Scheduler(PagePool(blocks, 4), 6, 12, 512, (1,))
        seqs = []
        for i in range(6):
            prompt = tok.encode(f"Record number {i} of the list, as JSON:")
            guided = i % 2 == 0
            sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=not guided,
                                structured=spec if guided else None).resolved()
            seq = Sequence(i, prompt, sp)
            seq.guide = grammars.guide(spec) if guided else None
            sched.add(seq)
            seqs.append(seq)
        run_to_completion(EngineCore([sched], None, ep=False), local_dispatch(worker))
        outs[blocks] = [s.output_token_ids for s in seqs]
        for s in seqs[::2]:
            assert s.finish_reason == "stop"
            jsonschema.validate(json.loads(tok.decode(s.output_token_ids)),
                                json.loads(spec.value))
        if blocks == 24:
            assert sum(s.num_preemptions for s in seqs) > 0
    assert outs[24] == outs[96]


def test_guides_of_one_spec_are_independent_and_failures_are_cached(grammars):
    """A sequence's matcher is a copy of the compiled one: advancing it leaves the next
    sequence's at the start; a bad spec raises on every try (its error is cached too)."""
    spec = StructuredOutputs("choice", json.dumps(["yes", "no"]))
    a, b = grammars.guide(spec), grammars.guide(spec)
    start = b.mask()
    a.accept([t for t in range(grammars.vocab) if allowed(start, t)][0])
    assert a.mask() != start and b.mask() == start == grammars.guide(spec).mask()
    bad = StructuredOutputs("regex", "a(b")
    for _ in range(2):
        with pytest.raises(BadRequest, match="regex"):
            grammars.compile(bad)


def allowed(mask: bytes, token: int) -> bool:
    return bool(mask[token // 8] >> (token % 8) & 1)


def test_the_sampler_takes_the_best_allowed_token(grammars):
    """Masked rows: greedy takes the highest allowed logit, sampling draws only allowed
    tokens; a row without a mask is untouched."""
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    ok = {3, 17, 40}
    mask = bytearray(vocab // 8)
    for t in ok:
        mask[t // 8] |= 1 << (t % 8)

    def chunk(i: int, temperature: float) -> SeqChunk:
        return SeqChunk(i, [0], 0, [0], True, temperature, 0, 1.0, None, 0)

    chunks = [chunk(0, 0.0), chunk(1, 0.0), chunk(2, 1.0)]
    masks = torch.tensor([0, 2]), unpacked(bytes(mask), vocab).expand(2, vocab)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        out = sample_tokens(logits, chunks, gen, masks=masks).tolist()
        assert out[0] == max(ok, key=lambda t: logits[0, t].item())
        assert out[1] == int(logits[1].argmax())
        assert out[2] in ok


def test_sampling_params_carry_the_spec_across_msgpack():
    sp = constrained("regex", "a+")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert back.structured == StructuredOutputs("regex", "a+")
    # the engine compiles a request's grammar before it registers, from params as sent
    assert structured_of(sp) == structured_of(msgspec.structs.asdict(sp)) == back.structured
    assert structured_of({"structured": {"kind": "bogus", "value": ""}}) is None
    assert structured_of(None) is None and structured_of({}) is None
