"""Speculative decoding through the served loop's logic on the built-in model: greedy tokens
with n-gram, draft-model and EAGLE-3 drafts equal those without; drafters sleep and wake
with their worker; drafts that cannot work with the target are refused before any worker.
`served` and `spec_config` are shared with test_speculative_steps.py and the GPU tests."""

from __future__ import annotations

import sys

import pytest
import torch

from raygraph.engine.drafts import ModelDrafts
from raygraph.engine.ngram import NgramIndex

TEXTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
         "The list of colors: red, green, blue, red, green, blue, red,",
         "x = 1\ny = 2\nx = 1\ny =", "Hello world. Hello world. Hello"]


def spec_config(spec: bool | str, mode: str = "graph", blocks: int = 128, device: str = "cpu",
                draft: str = "", max_num_seqs: int = 8, capture: str = "auto"):
    """The built-in model's ServeConfig for `served`, speculation off, n-gram (True), or by
    the draft model or EAGLE-3 head at `draft` ("draft", "eagle3")."""
    from raygraph.config import (
        CacheConfig,
        GraphConfig,
        SchedulerConfig,
        ServeConfig,
        SpeculativeConfig,
    )

    method = {False: "", True: "ngram"}.get(spec, spec)
    return ServeConfig(device=device, dtype="float32",
                       cache=CacheConfig(block_size=16, num_blocks=blocks),
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=64),
                       graph=GraphConfig(mode=mode, capture=capture),
                       speculative=SpeculativeConfig(method=method, model=draft))


def served(spec: bool | str, mode: str = "graph", blocks: int = 128, ignore_eos: bool = True,
           temperature: float = 0.0, device: str = "cpu", draft: str = "",
           record: dict | None = None, texts: list[str] | None = None,
           max_num_seqs: int = 8, worker=None, capture: str = "auto"):
    """The built-in model through the served loop's logic (EngineCore over an in-process
    worker: tokens fed on the device, replies a step late), configured by `spec_config`.
    `record`: gets the worker, the steps sent and every proposal with the sequence's tokens
    it followed. `texts`: the prompts (TEXTS). `worker`: one a call before built (and left
    awake). `capture`: GraphConfig.capture ("background": the worker captures nothing at
    start)."""
    from raygraph.config import DEFAULT_MODEL
    from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion
    from raygraph.engine.sequence import Sequence
    from raygraph.protocol import SamplingParams
    from raygraph.tokenizer import load_tokenizer
    from tests.conftest import loaded_worker

    cfg = spec_config(spec, mode, blocks, device, draft, max_num_seqs, capture)
    method = cfg.speculative.method
    tok = load_tokenizer(DEFAULT_MODEL)
    worker = worker or loaded_worker(cfg, blocks, capture=capture != "background")
    core = EngineCore.from_config(cfg, worker.model_cfg, blocks)
    seqs = []
    for i, text in enumerate(texts or TEXTS):
        prompt = tok.encode(text)
        sp = SamplingParams(max_tokens=40, temperature=temperature, seed=i if temperature else None,
                            ignore_eos=ignore_eos).resolved()
        seq = Sequence(i, prompt, sp)
        if method == "ngram":
            seq.proposer = NgramIndex(1, 4)
            seq.proposer.extend(prompt)
        elif method:
            seq.proposer = ModelDrafts() if record is None else RecordedDrafts(seq, record)
        core.schedulers[0].add(seq)
        seqs.append(seq)
    run_to_completion(core, local_dispatch(worker))
    if record is not None:
        record["worker"], record["steps"] = worker, core.step_id
    return seqs, core.schedulers[0]


class RecordedDrafts(ModelDrafts):
    """ModelDrafts that keeps each proposal and the tokens it followed in record["proposals"]."""

    def __init__(self, seq, record: dict) -> None:
        super().__init__()
        self.seq, self.record = seq, record

    def offer(self, drafts: list[int]) -> None:
        self.record.setdefault("proposals", []).append((list(self.seq.token_ids), drafts))
        super().offer(drafts)


@pytest.mark.parametrize("mode,blocks,ignore_eos", [("graph", 128, True), ("eager", 128, False),
                                                    ("graph", 12, True)])
def test_ngram_speculation_keeps_greedy_tokens(mode, blocks, ignore_eos):
    """Greedy tokens and finish reasons with drafts verified equal those without; drafts
    were proposed and some kept; with 12 blocks sequences are preempted on the way."""
    plain, _ = served(False, mode, blocks, ignore_eos)
    spec, sched = served(True, mode, blocks, ignore_eos)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert [s.finish_reason for s in spec] == [s.finish_reason for s in plain]
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens > 0
    if blocks == 12:
        assert sum(s.num_preemptions for s in spec) > 0


@pytest.mark.parametrize("blocks", [128, 12])
def test_seeded_sampled_speculation_emits_the_tokens_of_decoding_without_drafts(blocks):
    """A seeded sampled request draws each output from its (seed, output index) stream
    with or without drafts: n-gram drafts kept or refused, steps cut anywhere, sequences
    preempted (12 blocks) and recomputed, its tokens are those of plain decoding."""
    plain, _ = served(False, "eager", blocks, temperature=0.3)
    spec, sched = served(True, "eager", blocks, temperature=0.3)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens > 0
    if blocks == 12:
        assert sum(s.num_preemptions for s in spec) > 0


@pytest.mark.parametrize("mode,blocks,ignore_eos", [("eager", 128, False), ("graph", 12, True)])
def test_draft_model_speculation_keeps_greedy_tokens(random_draft, mode, blocks, ignore_eos):
    """A random draft model's proposals verified: greedy tokens and finish reasons equal
    those without speculation; with 12 blocks sequences are preempted on the way."""
    plain, _ = served(False, mode, blocks, ignore_eos)
    spec, sched = served("draft", mode, blocks, ignore_eos, draft=random_draft)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert [s.finish_reason for s in spec] == [s.finish_reason for s in plain]
    assert sched.num_draft_tokens > 0
    if blocks == 12:
        assert sum(s.num_preemptions for s in spec) > 0


def test_no_row_for_a_draft_means_decoding_as_usual(random_draft):
    """With as many sequences running as max_num_seqs no draft has a logits row: the
    sequences decode as usual, never sitting out steps to wait for drafts (as many steps
    as without speculation), and ask the draft model for a proposal at most while they
    are admitted; tokens as without speculation."""
    plain_record: dict = {}
    record: dict = {}
    plain, _ = served(False, max_num_seqs=4, record=plain_record)
    spec, sched = served("draft", draft=random_draft, record=record, max_num_seqs=4)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert sched.num_draft_tokens == 0 and record["steps"] == plain_record["steps"]
    assert len(record.get("proposals", [])) <= len(TEXTS)


def test_a_model_drafting_for_itself_keeps_nearly_every_draft():
    """The built-in model as its own draft model proposes the target's greedy tokens, so
    nearly every draft is kept: only if the draft model's cache holds the target's tokens at
    their positions (prompts, kept drafts, prefix hits, recomputes after preemption) and each
    proposal starts from the newest token after the kept drafts (an off-by-one anywhere
    leaves next to nothing kept). Greedy tokens equal those without speculation; 10 blocks:
    sequences are preempted on the way."""
    from raygraph.config import DEFAULT_MODEL

    plain, _ = served(False, blocks=10)
    spec, sched = served("draft", blocks=10, draft=DEFAULT_MODEL)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert sched.num_draft_tokens >= len(TEXTS) * 40 // 2  # most tokens came as drafts
    assert sched.num_accepted_tokens >= 0.9 * sched.num_draft_tokens
    assert sum(s.num_preemptions for s in spec) > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux")
def test_a_drafting_worker_sleeps_with_its_draft_model_and_drafts_as_well_after_wake():
    """Sleep (level 2) releases the draft model's KV cache and weights with the target's:
    their memfd files shrink to nothing. After wake the greedy tokens equal those before,
    and the draft model, drafting for itself, still has nearly every draft kept: its weights
    came back as they were."""
    from raygraph.config import DEFAULT_MODEL

    record: dict = {}
    before, _ = served("draft", draft=DEFAULT_MODEL, record=record)
    worker = record["worker"]
    mem, drafter = worker.sleep_memory, worker.drafter
    stats = worker.sleep(2)
    assert stats.kv_cache_bytes >= worker.kv_cache_bytes  # the target's and the drafter's
    assert stats.weight_bytes >= worker.weight_bytes + drafter.weight_bytes
    assert mem.draft_kv.pool.backend.file_bytes() == 0
    assert mem.draft_weights.pool.backend.file_bytes() == 0
    kv = drafter.model.attention_layers()[0].k_cache
    assert mem.draft_kv.base <= kv.data_ptr() < mem.draft_kv.base + mem.draft_kv.used_bytes
    woke = worker.wake_up()
    assert woke.weight_bytes >= worker.weight_bytes + drafter.weight_bytes
    after, sched = served("draft", draft=DEFAULT_MODEL, worker=worker)
    assert [s.output_token_ids for s in after] == [s.output_token_ids for s in before]
    assert sched.num_draft_tokens >= len(TEXTS) * 40 // 2
    assert sched.num_accepted_tokens >= 0.9 * sched.num_draft_tokens


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux")
def test_an_eagle3_head_sleeps_in_its_own_arena_and_the_embedding_it_shares_in_the_targets(
        eagle3_head):
    """The head reads the target's embedding (TP = 1): that stays in the target's weight
    arena (one copy); the head's own weights are in its arena, and come back at wake."""
    record: dict = {}
    before, _ = served("eagle3", draft=eagle3_head, record=record)
    worker = record["worker"]
    mem, head = worker.sleep_memory, worker.drafter.model

    def held(arena, t: torch.Tensor) -> bool:
        return arena.base <= t.data_ptr() < arena.base + arena.used_bytes

    assert head.embed_tokens is worker.model.model.embed_tokens
    assert held(mem.weights, head.embed_tokens.weight)
    assert held(mem.draft_weights, head.fc.weight) and not held(mem.weights, head.fc.weight)
    fc = head.fc.weight.clone()
    worker.sleep(2)
    assert mem.draft_weights.pool.backend.file_bytes() == 0
    worker.wake_up()
    assert torch.equal(head.fc.weight, fc)
    after, _ = served("eagle3", draft=eagle3_head, worker=worker)
    assert [s.output_token_ids for s in after] == [s.output_token_ids for s in before]


@pytest.mark.parametrize("mode,blocks", [("eager", 128), ("graph", 12)])
def test_eagle3_speculation_keeps_greedy_tokens(eagle3_head, mode, blocks):
    """A random EAGLE-3 head's proposals verified: greedy tokens equal those without
    speculation; with 12 blocks sequences are preempted on the way."""
    plain, _ = served(False, mode, blocks)
    spec, sched = served("eagle3", mode, blocks, draft=eagle3_head)
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert sched.num_draft_tokens > 0
    if blocks == 12:
        assert sum(s.num_preemptions for s in spec) > 0


# TEXTS and one prompt longer than a step's 64 tokens: prefilled over two steps
LONG_TEXTS = TEXTS[:3] + [" ".join(["The list of colors: red, green, blue."] * 5)]


def eagle3_reference(worker, tokens: list[int], k: int) -> list[int]:
    """The head's k drafts after `tokens`, from scratch: one prefill of the target over them
    (its hidden states), the head over positions 0..n-2 with the token after each, its
    last row's greedy token, then k - 1 steps from its own hidden state. In the first
    blocks of the caches (free once the run is over)."""
    from raygraph.graph.executor import EagerExecutor
    from raygraph.graph.inputs import batch_from, host_inputs
    from raygraph.model.context import forward_context
    from raygraph.protocol import SeqChunk, StepPlan

    target, head, bs = worker.model, worker.drafter.model, 16
    blocks = list(range(-(-(len(tokens) + k) // bs)))

    def batch(ids: list[int], start: int):
        chunk = SeqChunk(0, ids, start, blocks, True)
        return batch_from(host_inputs(StepPlan(0, [chunk]), bs), worker.device)

    n, served_aux = len(tokens), target.model.aux  # the whole sequence in one forward
    target.model.aux = served_aux.new_zeros(n, served_aux.shape[1])
    with torch.inference_mode():
        try:
            EagerExecutor(target, bs).run(host_inputs(StepPlan(0, [SeqChunk(
                0, tokens, 0, blocks, True)]), bs))
            hidden = head.combine(target.model.aux[: n - 1])
        finally:
            target.model.aux = served_aux
        b = batch(tokens[1:], 0)
        with forward_context(b.ctx):
            normed, hidden = head(b.input_ids, b.positions, hidden)
        x, hidden, out = head.greedy(normed[-1:]), hidden[-1:], []
        out.append(int(x))
        for step in range(1, k):
            b = batch([out[-1]], n + step - 2)
            with forward_context(b.ctx):
                normed, hidden = head(b.input_ids, b.positions, hidden)
            out.append(int(head.greedy(normed)))
    return out


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_eagle3_proposals_follow_the_heads_math(request, layout):
    """Every proposal the served loop's EAGLE-3 drafter returned (graph mode, preemption
    on the way) equals the head's math run from scratch over the sequence's tokens at that
    moment (`eagle3_reference`): the rows shifted by one token, the anchor row, the loop's
    positions and hidden states and the head's cache through shared and lookahead blocks
    all agree with it; an off-by-one anywhere leaves next to none equal. Different shapes
    round differently, so a near tie may flip a draft: 90% must be equal. Heads in the
    EAGLE authors' layout and in the `speculators` one (tokens equal plain's there too)."""
    head = request.getfixturevalue(
        "eagle3_head" if layout == "eagle" else "eagle3_speculators_head")
    record: dict = {}
    spec, _ = served("eagle3", "graph", 12, draft=head, record=record, texts=LONG_TEXTS)
    if layout == "speculators":
        plain, _ = served(False, "graph", 12, texts=LONG_TEXTS)
        assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    proposals, worker = record["proposals"], record["worker"]
    equal = sum(drafts == eagle3_reference(worker, tokens, len(drafts))
                for tokens, drafts in proposals)
    assert len(proposals) >= 20 and equal >= 0.9 * len(proposals), (equal, len(proposals))


def test_a_draft_model_that_cannot_draft_for_the_target_is_refused(random_draft, eagle3_head,
                                                                  tmp_path):
    """One line each: another vocabulary, too few positions for the served context, a head
    under method "draft" or a model under "eagle3", a head of another width, a draft model
    without method "draft" or the method without one."""
    from raygraph.config import ConfigError, ServeConfig, SpeculativeConfig
    from tests.conftest import make_checkpoint, make_eagle3_head

    def resolve(model: str, **kw) -> None:
        ServeConfig(speculative=SpeculativeConfig(method="draft", model=model), **kw).resolved(0)

    other = str(make_checkpoint(tmp_path / "v256", "LlamaForCausalLM", num_hidden_layers=1))
    with pytest.raises(ConfigError, match="vocabulary of 256, the target 4096"):
        resolve(other)
    short = str(make_checkpoint(tmp_path / "p128", "LlamaForCausalLM", num_hidden_layers=1,
                                vocab_size=4096, max_position_embeddings=128))
    with pytest.raises(ConfigError, match="holds 128 positions, the served context 512"):
        resolve(short)
    from raygraph.config import SchedulerConfig

    resolve(short, scheduler=SchedulerConfig(max_model_len=128))  # as the message says
    resolve(random_draft)
    with pytest.raises(ConfigError, match="is a LlamaForCausalLMEagle3: method 'eagle3' takes"):
        resolve(eagle3_head)
    with pytest.raises(ConfigError, match="method 'eagle3' takes EAGLE-3 heads, method "):
        ServeConfig(speculative=SpeculativeConfig(method="eagle3", model=random_draft)
                    ).resolved(0)
    narrow = make_eagle3_head(tmp_path / "h128", str(make_checkpoint(
        tmp_path / "t128", "LlamaForCausalLM", vocab_size=4096, hidden_size=128)), 256)
    with pytest.raises(ConfigError, match=r"of 128, reading layers \[2, 2, 1\], drafting "
                       r"256 tokens\) does not fit the target \(LlamaForCausalLM, 4 layers of 256"):
        ServeConfig(speculative=SpeculativeConfig(method="eagle3", model=narrow)).resolved(0)
    from raygraph.config import OffloadConfig

    with pytest.raises(ConfigError, match="draft model and weight offload"):
        ServeConfig(speculative=SpeculativeConfig(method="draft", model=random_draft),
                    offload=OffloadConfig(budget_bytes=1 << 30))
    for method, model in (("ngram", random_draft), ("draft", "")):
        with pytest.raises(ConfigError, match="goes with methods 'draft' and 'eagle3'"):
            SpeculativeConfig(method=method, model=model)


def test_a_damaged_draft_checkpoint_is_refused_before_any_worker(eagle3_head, random_draft,
                                                                 tmp_path):
    """The draft model's and the head's files are checked at start-up, tensor by tensor, as
    the target's: a head without `fc` or a draft model with a misshapen projection fails in
    the driver, naming the file and the tensor, not as a worker that died loading it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from raygraph.client.connect import check_startup
    from raygraph.config import ServeConfig, SpeculativeConfig
    from raygraph.model.checkpoint import CheckpointError

    def start(method: str, model: str) -> None:
        check_startup(ServeConfig(speculative=SpeculativeConfig(method=method, model=model)))

    start("eagle3", eagle3_head)
    start("draft", random_draft)
    for method, source, damage, says in [
            ("eagle3", eagle3_head, lambda t: t.pop("fc.weight"),
             r"lacks tensors: \['fc.weight'\]"),
            ("draft", random_draft,
             lambda t: t.update({k: t[k][:-1] for k in t if k.endswith("o_proj.weight")}),
             "o_proj.weight")]:
        broken = tmp_path / method
        shutil.copytree(source, broken)
        for f in broken.glob("*.safetensors"):
            tensors = load_file(f)
            damage(tensors)
            save_file(tensors, f)
        with pytest.raises(CheckpointError, match=says):
            start(method, str(broken))
