"""Speculative decoding's parts: n-gram prompt lookup (engine/ngram.py) and acceptance
(worker/speculative.py): greedy keeps exactly the target's tokens; rejection sampling
emits tokens distributed as the target's own samples (chi-square, small vocabulary)."""

from __future__ import annotations

import random
import sys

import msgspec
import pytest
import torch

from raygraph.engine.drafts import ModelDrafts
from raygraph.engine.ngram import NgramIndex
from raygraph.worker.speculative import accept_greedy, accept_sampled


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix n-gram with an earlier occurrence (the latest one): what followed."""
    end = len(tokens) - 1
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[end - n + 1:]
        for start in range(end - n, -1, -1):  # latest earlier occurrence first
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_ngram_proposals():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 8, 9, 5, 6, 7])
    assert index.propose(3) == [8, 9, 5]  # "5 6 7" seen at 0..2
    index.extend([1])
    assert index.propose(2) == []  # "1" never seen before
    index.extend([5, 6])
    assert index.propose(4) == [7, 1, 5, 6]  # the latest "5 6" is at 5..6
    index.extend([2, 6])
    assert index.propose(2) == [2, 6]  # only "6" matches: its latest earlier one, at 10
    assert index.propose(0) == []
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


@pytest.mark.parametrize("seed", range(5))
def test_ngram_index_equals_a_full_search(seed):
    rng = random.Random(seed)
    index, tokens = NgramIndex(2, 4), []
    for _ in range(300):
        chunk = [rng.randrange(6) for _ in range(rng.randint(1, 3))]
        index.extend(chunk)
        tokens += chunk
        assert index.propose(3) == brute_force(tokens, 3, 2, 4)


def test_greedy_keeps_leading_matches_only():
    target = torch.tensor([[4, 5, 6, 7], [4, 9, 6, 7], [1, 2, 3, 4], [4, 5, 6, 7]])
    drafts = torch.tensor([[4, 5, 6], [4, 5, 6], [9, 2, 3], [4, 5, 6]])
    kept, tokens = accept_greedy(target, drafts, torch.tensor([3, 3, 3, 1]))
    assert kept.tolist() == [3, 1, 0, 1]  # the last row proposed one draft: one at most
    emitted = [tokens[i, : n + 1].tolist() for i, n in enumerate(kept.tolist())]
    assert emitted == [[4, 5, 6, 7], [4, 9], [1], [4, 5]]


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical value, 4 degrees of freedom, p = 0.001 (a 1-in-1000 false alarm)
CRITICAL_DF4 = 18.47


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_rejection_sampling_emits_the_targets_distribution(proposer):
    """V = 5, two drafts a row, the target's distribution fixed per position: the first
    emitted token follows p_0 and, where the first draft was kept, the second follows p_1,
    whatever the drafts were. 40,000 rows; an n-gram proposer (one-hot q, fixed drafts) and
    a draft model (drafts drawn from its own q)."""
    gen = torch.Generator().manual_seed(0)
    n, v = 40_000, 5
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.2, 0.25, 0.4],
                      [0.2, 0.2, 0.2, 0.2, 0.2]])
    probs = p.expand(n, 3, v)
    if proposer == "ngram":
        drafts, q = torch.tensor([[1, 4]]).expand(n, 2).contiguous(), None
    else:
        q_rows = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])
        q = q_rows.expand(n, 2, v)
        drafts = torch.stack([torch.multinomial(q_rows[i], n, replacement=True, generator=gen)
                              for i in range(2)], dim=1)
    kept, tokens = accept_sampled(probs, drafts, torch.full((n,), 2), q, gen)
    assert chi_square(tokens[:, 0], p[0]) < CRITICAL_DF4
    second = tokens[kept >= 1, 1]
    assert second.numel() > 1000 and chi_square(second, p[1]) < CRITICAL_DF4
    # a proposer that matches the target is always kept
    kept_all, _ = accept_sampled(probs, drafts, torch.full((n,), 2),
                                 p[:2].expand(n, 2, v), gen)
    assert proposer == "ngram" or bool((kept_all == 2).all())


def test_rejection_sampling_never_keeps_padding_or_impossible_drafts():
    probs = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]]).expand(64, 3, 3)
    drafts = torch.tensor([[1, 2]]).expand(64, 2)
    kept, tokens = accept_sampled(probs, drafts, torch.full((64,), 2), None,
                                  torch.Generator().manual_seed(1))
    assert (kept == 1).all()  # 1 is certain; 2 has probability 0 under the target
    assert set(tokens[:, 1].tolist()) <= {0, 1}  # drawn from p_1 without the refused 2
    kept, _ = accept_sampled(probs, drafts, torch.zeros(64, dtype=torch.long), None)
    assert (kept == 0).all()  # no real drafts: only the target's own token


# ---- n-gram speculation in the served loop --------------------------------------------

TEXTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
         "The list of colors: red, green, blue, red, green, blue, red,",
         "x = 1\ny = 2\nx = 1\ny =", "Hello world. Hello world. Hello"]


def test_sampled_verify_rows_emit_the_targets_distribution():
    """sampled_targets, then emitted, as a worker runs them: 3,000 sampled chunks verify two
    drafts over 5 tokens at temperature 1. The first token emitted follows the target's p_0
    and, where the first draft was kept, the second follows p_1; a seeded chunk draws the
    same again; a greedy chunk beside them keeps its argmax rows."""
    from raygraph.protocol import SeqChunk
    from raygraph.worker.speculative import emitted, sampled_targets, verify_rows

    n = 3000
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.2, 0.25, 0.4], [0.2] * 5])
    chunks = [SeqChunk(i, [0, 1, 4], 10, [0], True, temperature=1.0, verify=2)
              for i in range(n)]
    chunks.append(SeqChunk(n, [0, 3, 3], 10, [0], True, verify=2))  # greedy
    logits = p.log().repeat(n + 1, 1)
    greedy = logits.argmax(-1)
    staging = torch.zeros(2 * n + 2, dtype=torch.long)
    targets = sampled_targets(chunks, logits, greedy, staging,
                              torch.Generator().manual_seed(0))
    assert torch.equal(targets[-3:], greedy[-3:]) and torch.equal(greedy, logits.argmax(-1))
    flat, counts = emitted([0] * (n + 1), targets.tolist(), verify_rows(chunks))
    per_chunk, at = [], 0
    for c in counts:
        per_chunk.append(flat[at: at + c])
        at += c
    assert per_chunk[-1] == [0]  # greedy: its first draft (3) is not the argmax
    first = torch.tensor([t[0] for t in per_chunk[:n]])
    assert chi_square(first, p[0]) < CRITICAL_DF4
    second = torch.tensor([t[1] for t in per_chunk[:n] if len(t) > 1])
    assert second.numel() > 300 and chi_square(second, p[1]) < CRITICAL_DF4
    seeded = [SeqChunk(0, [0, 1, 4], 10, [0], True, temperature=1.0, seed=7, verify=2)]
    draws = [sampled_targets(seeded, logits[:3], greedy[:3], staging, torch.Generator())
             for _ in range(2)]
    assert torch.equal(*draws)


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


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_requests_speculate_reproducibly(method):
    """Seeded sampled requests with drafts (rejection sampling on the workers): drafts
    proposed and verified, max_tokens exact, and the same seeds give the same tokens again
    (the draft model: the built-in model drafting for itself)."""
    from raygraph.config import DEFAULT_MODEL

    spec = True if method == "ngram" else method
    draft = DEFAULT_MODEL if method == "draft" else ""
    runs = [served(spec, temperature=0.8, draft=draft) for _ in range(2)]
    (first, sched), (again, _) = runs
    assert sched.num_draft_tokens > 0
    assert all(len(s.output_token_ids) == 40 for s in first)
    assert [s.output_token_ids for s in first] == [s.output_token_ids for s in again]


PLAIN_TP2: list = []  # the plain coordinator's results, computed once for every method


# n-gram drafts take the same TP=2 verify path as the drafting models, with no drafter
@pytest.mark.parametrize("method", [pytest.param("ngram", marks=pytest.mark.slow), "draft",
                                    "eagle3"])
def test_speculation_through_coordinators_at_tp2(ray_session, default_model_tp2_coord, method,
                                                 eagle3_head):
    """Requests served with speculation at TP=2 (both ranks verify alike; the draft model,
    the built-in one drafting for itself, or a random EAGLE-3 head, whose embedding is then
    read whole from the target's checkpoint, on the rank that samples): the same texts,
    token ids and finish reasons as without (the session's TP=2 coordinator; stop strings
    and max_tokens included); the drafts counted in the engine's stats. TP=1 is the
    in-process test above."""
    import msgspec

    from raygraph.config import DEFAULT_MODEL, SpeculativeConfig
    from raygraph.protocol import SamplingParams
    from tests.conftest import default_model_tp2_config, start_coordinators, stop_coordinators

    model = {"draft": DEFAULT_MODEL, "eagle3": eagle3_head}.get(method, "")
    spec_cfg = SpeculativeConfig(method=method, model=model)
    cfg = msgspec.structs.replace(default_model_tp2_config(), speculative=spec_cfg,
                                  coordinator_name=f"speculative-tp2-{method}")
    jobs = [(text, SamplingParams(max_tokens=32, temperature=0.0)) for text in TEXTS]
    jobs += [(TEXTS[1], SamplingParams(max_tokens=32, temperature=0.0, stop=[" blue"])),
             (TEXTS[0], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))]
    (spec,) = start_coordinators([cfg])
    coords = [spec] + ([] if PLAIN_TP2 else [default_model_tp2_coord])
    try:
        out = [ray_session.get([c.generate.remote(p, sp) for p, sp in jobs]) for c in coords]
        stats = ray_session.get(spec.stats.remote())
    finally:
        stop_coordinators([spec])
    PLAIN_TP2.extend(out[1:])
    spec, plain = [[(r[0].text, r[0].token_ids, r[0].finish_reason) for r in o]
                   for o in (out[0], PLAIN_TP2[0])]
    assert spec == plain
    assert plain[-1][2] == "length" and len(plain[-1][1]) == 7
    engine = stats if "spec_decode_num_draft_tokens" in stats else stats["replicas"][0]
    assert engine["spec_decode_num_draft_tokens"] > 0
    per_pos = engine["spec_decode_num_accepted_tokens_per_pos"]
    assert engine["spec_decode_num_drafts"] > 0 and len(per_pos) == 4
    assert sum(per_pos) == engine["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # a draft is kept only after the ones before
    # the time of the steps that verified: part of all steps' time; the drafter's: its own
    steps_s = engine["worker_step_ms"] * engine["steps"] / 1e3
    assert 0 < engine["spec_decode_verify_s"] <= steps_s + 1e-3
    assert (engine["spec_decode_draft_s"] > 0) == (method != "ngram")
    if "replicas" in stats:  # as /metrics shows them
        from prometheus_client.parser import text_string_to_metric_families

        from raygraph.api.metrics import Metrics

        text = Metrics("m").render(stats).decode()
        samples = {(x.name, x.labels.get("position")): x.value
                   for f in text_string_to_metric_families(text) for x in f.samples}
        assert (samples["raygraph:spec_decode_num_drafts_total", None]
                == engine["spec_decode_num_drafts"])
        assert [samples["raygraph:spec_decode_num_accepted_tokens_per_pos_total", str(i)]
                for i in range(4)] == per_pos
        assert (samples["raygraph:spec_decode_draft_time_seconds_total", None]
                == engine["spec_decode_draft_s"])
    if method == "draft":  # the model's own greedy tokens: nearly all kept
        assert (engine["spec_decode_num_accepted_tokens"]
                >= 0.9 * engine["spec_decode_num_draft_tokens"])


def test_oracle_drafts_hold_and_keep_greedy_tokens():
    """bench.speculative's oracle drafts the plain run's next tokens while the sequence's
    tokens equal them: every draft is kept (up to k a step, the full-accept path) and the
    tokens equal the plain run's, in fewer steps."""
    from bench.speculative import OracleProposer, oracles, run, speculating
    from raygraph.config import CacheConfig, SchedulerConfig, ServeConfig
    from tests.conftest import loaded_worker

    oracle = OracleProposer(3, [7, 8, 9, 10])
    oracle.extend([1, 2, 3])
    assert oracle.propose(2) == [7, 8]
    oracle.extend((7,))
    assert oracle.propose(5) == [8, 9, 10] and oracle.propose(0) == []
    oracle.extend((8, 5))  # 5, not the recorded 9: what follows is not recorded
    assert oracle.propose(2) == [] and oracle.diverged

    blocks = 64
    cfg = ServeConfig(device="cpu", cache=CacheConfig(block_size=16, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=64))
    worker = loaded_worker(speculating(cfg, 4), blocks, capture=True)
    rng = random.Random(0)
    ids = [[rng.randrange(3, 4096) for _ in range(n)] for n in (5, 12, 30, 17)]
    plain = run(cfg, worker, ids, 24, blocks)
    spec = run(speculating(cfg, 4), worker, ids, 24, blocks, oracles(plain["tokens"]))
    assert spec["tokens"] == plain["tokens"]
    assert spec["kept"] == spec["drafts"] > 0 and spec["steps"] < plain["steps"]


def test_speculating_sequences_verify_together_once_their_prompts_are_done():
    """Sequences whose prompts end in different steps would take turns (each sits out the
    step after its verify step, waiting for the tokens kept); the loop collects the step in
    flight first when half the batch waits on it, so at 100% acceptance each verify step
    carries every sequence: about max_tokens / (k + 1) steps after the prompts."""
    from bench.speculative import oracles, run, speculating
    from raygraph.config import CacheConfig, SchedulerConfig, ServeConfig
    from tests.conftest import loaded_worker

    blocks, budget, k, max_tokens = 64, 32, 4, 40
    cfg = ServeConfig(device="cpu", cache=CacheConfig(block_size=16, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=budget))
    worker = loaded_worker(speculating(cfg, k), blocks, capture=True)
    rng = random.Random(0)
    ids = [[rng.randrange(3, 4096) for _ in range(n)] for n in (5, 12, 30, 17)]
    plain = run(cfg, worker, ids, max_tokens, blocks)
    spec = run(speculating(cfg, k), worker, ids, max_tokens, blocks, oracles(plain["tokens"]))
    assert spec["tokens"] == plain["tokens"] and spec["kept"] == spec["drafts"]
    # on a CPU the device never idles: every stall is waited out, each wait's next step
    # measured as a turnaround
    assert spec["waits"] > 0 and spec["declined"] == 0 and spec["turnarounds"] > 0
    prompt_steps = -(-sum(map(len, ids)) // budget)
    assert spec["steps"] <= prompt_steps + max_tokens // (k + 1) + 1
    # max_num_seqs running: no logits row for a draft, every sequence decodes as usual and
    # none waits on the step in flight
    full = msgspec.structs.replace(cfg, scheduler=msgspec.structs.replace(
        cfg.scheduler, max_num_seqs=len(ids)))
    spec = run(speculating(full, k), worker, ids, max_tokens, blocks, oracles(plain["tokens"]))
    assert spec["tokens"] == plain["tokens"] and spec["drafts"] == 0 and spec["waits"] == 0


def test_the_loop_waits_for_a_verify_step_only_while_a_turnaround_is_cheap():
    """Waiting pays until three turnarounds are measured (and on a CPU, where the device is
    the host, none is ever idle). Steps of 0.4 ms with 1.5 ms idle after each wait: it declines,
    probing again every PROBE declines. Steps of 10 ms with 1 ms turnarounds: it pays, and
    one capture-sized idle among the last five does not change that; the idle of a step not
    sent right after a wait is no turnaround."""
    from raygraph.engine.core import Turnaround
    from raygraph.protocol import StepOutput

    t = Turnaround()
    assert t.pays()

    def step(i: int, forward_s: float, idle_s: float, probe: bool = True) -> None:
        if probe:
            t.probe_step = i
        t.note(StepOutput(i, [], forward_s, idle_s))

    step(0, 4e-4, 9.0)
    assert t.pays()  # one turnaround measured decides nothing yet
    for i in range(1, 20):
        step(i, 4e-4, 1.5e-3)
    assert [t.pays() for _ in range(Turnaround.PROBE)] == [False] * (Turnaround.PROBE - 1) + [True]
    assert (t.waits, t.declined) == (3, Turnaround.PROBE)
    for i in range(20, 40):
        step(i, 1e-2, 1e-3)
    assert t.pays()
    step(40, 1e-2, 5.0)  # a capture landed in it
    assert t.pays()
    for i in range(41, 60):
        step(i, 1e-2, 9e-3, probe=False)
    assert t.pays()


def test_keep_every_draft_emits_the_drafts_then_the_target_after_them() -> None:
    """bench.speculative --keep-drafts: a verifying chunk emits its drafts, kept whatever the
    targets say, then the target's token after the last draft; other chunks their token."""
    from bench.speculative import keep_every_draft

    tokens, counts = keep_every_draft([70, 80], [1, 2, 3, 4, 90], [(0, 0, [5, 6, 7])])
    assert tokens == [5, 6, 7, 4, 80] and counts == [4, 1]


def test_verify_chunks_run_as_decode_rows_in_decode_buckets():
    """A step of plain decode rows and verify chunks (a token and its drafts) runs under a
    decode key with a row per token, each row a query at its own position: its logits equal
    those of the same chunks run prefill-shaped (a two-token prompt chunk in the batch makes
    it so), within float32 rounding; the keys say which path ran."""
    from raygraph.config import CacheConfig, SchedulerConfig, ServeConfig, SpeculativeConfig
    from raygraph.protocol import SeqChunk, StepPlan
    from tests.conftest import loaded_worker

    blocks, bs = 32, 16
    cfg = ServeConfig(device="cpu", cache=CacheConfig(block_size=bs, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
                      speculative=SpeculativeConfig(method="ngram"))
    worker = loaded_worker(cfg, blocks, capture=True)
    rng = random.Random(1)
    ids = [rng.randrange(3, 4096) for _ in range(60)]
    # sequences with their prompts cached: 30, 17 and 40 tokens, on blocks of their own
    tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
    prompts = [ids[:30], ids[10:27], ids[20:60]]
    worker.execute(StepPlan(1, [SeqChunk(i, p, 0, t, False)
                                for i, (p, t) in enumerate(zip(prompts, tables))]))
    chunks = [SeqChunk(0, [5, 6, 7, 8, 9], 30, tables[0], True, verify=4),
              SeqChunk(1, [11], 17, tables[1], True),
              SeqChunk(2, [12, 13, 14], 40, tables[2], True, verify=2)]
    rows = worker.logits(StepPlan(2, chunks))
    assert worker.executor.last_key.phase == "decode"
    assert worker.executor.last_key.num_tokens >= len(rows) == 9
    prompt_chunk = SeqChunk(3, [1, 2], 0, [8], False)  # two tokens: the step is prefill-shaped
    again = worker.logits(StepPlan(3, [*chunks, prompt_chunk]))
    assert worker.executor.last_key.phase == "prefill"
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(rows, again, atol=1e3 * eps, rtol=1e3 * eps)


def test_verify_chunks_past_the_decode_buckets_run_prefill_shaped():
    """Drafts whose rows would pass the largest decode bucket run as a prefill-shaped step,
    keyed so by the coordinator's BucketPlan and the worker's inputs alike; within it, as
    decode rows."""
    from raygraph.graph.buckets import BucketPlan
    from raygraph.graph.inputs import host_inputs
    from raygraph.protocol import SeqChunk, StepPlan

    buckets = BucketPlan((1, 2, 4, 8), (16, 64), 8, verify=True)
    chunks = [SeqChunk(i, [1, 2, 3], 10, [0], True, verify=2) for i in range(3)]  # 9 rows
    h = host_inputs(StepPlan(0, chunks), 16, max_rows=buckets.max_verify_rows)
    assert not h.decode and buckets.key(9, 3, True).phase == "prefill"
    h = host_inputs(StepPlan(0, chunks[:2]), 16, max_rows=buckets.max_verify_rows)
    assert h.decode and h.num_seqs == 6 and buckets.key(6, 2, True).num_tokens == 8
    assert buckets.key(9, 9, True).phase == "eager"  # plain decode past them: as before
    # without speculation configured the decode graphs read no verify rows: prefill-shaped
    plain = BucketPlan((1, 2, 4, 8), (16, 64), 8)
    assert not host_inputs(StepPlan(0, chunks[:2]), 16, max_rows=plain.max_verify_rows).decode
    assert plain.key(6, 2, True).phase == "prefill"


def test_verify_rows_live_in_the_buffers_only_with_speculation():
    """Decode graphs read each row's verify_row only where speculation is configured: the
    buffers then hold the row (a plain step after a verify step writes it back to 0), and
    without it they have none, the upload being the plain layout's."""
    from raygraph.graph.inputs import InputBuffers, host_inputs
    from raygraph.protocol import SeqChunk, StepPlan

    cpu = torch.device("cpu")
    verify = StepPlan(0, [SeqChunk(0, [1, 2, 3], 10, [0], True, verify=2),
                          SeqChunk(1, [4], 5, [1], True)])
    plain = StepPlan(1, [SeqChunk(0, [1], 13, [0], True), SeqChunk(1, [4], 6, [1], True)])
    bufs = InputBuffers(16, 8, 4, cpu, verify=True)
    bufs.fill(host_inputs(verify, 16), 8, 8)
    assert bufs.verify_row[:4].tolist() == [0, 1, 2, 0]
    assert bufs.metadata(8, 8, 4, 1, 13, True).verify_row.tolist()[:4] == [0, 1, 2, 0]
    bufs.fill(host_inputs(plain, 16), 8, 8)
    assert bufs.verify_row[:4].tolist() == [0, 0, 0, 0]
    off = InputBuffers(16, 8, 4, cpu)
    assert off.verify_row is None and off.metadata(8, 8, 2, 1, 14, True).verify_row is None
    assert off.nbytes == bufs.nbytes - 16 * 8  # one int64 row of max_tokens fewer


def test_draft_spans_time_a_step_and_start_over_for_the_next():
    """The drafter's time in a step: its stretches summed, none of a previous step's."""
    import time

    from raygraph.worker.drafter import Spans

    spans = Spans(cuda=False)
    for _ in range(2):
        with spans.span():
            time.sleep(0.1)
    assert spans.seconds() >= 0.2
    assert spans.reset().seconds() == 0.0
    with spans.span():
        time.sleep(0.01)
    assert 0.01 <= spans.seconds() < 0.2


def test_a_drafters_graph_sizes_up_to_a_decode_keys_rows():
    """Background capture brings a drafter's graphs with each decode key: the sizes (powers
    of two, max_num_seqs at most) up to the key's rows, none captured twice."""
    from raygraph.config import DEFAULT_MODEL
    from tests.conftest import loaded_worker

    worker = loaded_worker(spec_config("draft", draft=DEFAULT_MODEL, max_num_seqs=6), 64)
    drafter = worker.drafter
    assert drafter.sizes_upto(1) == [1]
    assert drafter.sizes_upto(3) == [1, 2, 4]
    assert drafter.sizes_upto(100) == [1, 2, 4, 6]
    drafter.graphs.update({1: None, 2: None})  # as if captured: not again
    assert drafter.sizes_upto(5) == [4, 6]
    worker.shutdown()
