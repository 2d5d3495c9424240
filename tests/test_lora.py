"""Multi-LoRA below the coordinator, on CPU: PEFT adapters read and refused with one clear
line, the delta's torch reference, the LoRA input rows, and greedy tokens equal HF
transformers + PEFT for one mixed batch (4 adapters and base rows) through the served loop's
logic: eager and graph executors at TP=1, the graph executor at TP=2 (gloo). Over 500 lines
because the cases share the PEFT adapters built once per module."""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from raygraph.cli import add_serve_args, serve_config
from raygraph.config import (
    DEFAULT_MODEL,
    CacheConfig,
    ConfigError,
    GraphConfig,
    LoRAConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion
from raygraph.engine.lora import LoRAAdmission, LoRARegistry
from raygraph.engine.sequence import Sequence
from raygraph.errors import LoRAError
from raygraph.graph.inputs import InputBuffers, host_inputs
from raygraph.lora import LoRAAdapter, LoRASlots, read_adapter
from raygraph.lora.slots import TARGETS
from raygraph.model.context import ForwardContext, LoRAInputs, forward_context
from raygraph.model.lora_ops import EXT_MAX_TOKENS, LoRAWeights, lora_delta, lora_linear
from raygraph.protocol import SamplingParams, SeqChunk, StepOutput, StepPlan
from raygraph.worker.worker import Worker
from tests.conftest import loaded_worker, serve_in_process
from tests.hf_ref import hf_greedy

MODEL = Path(DEFAULT_MODEL)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# slot -> (name, target modules, rank, extra LoraConfig fields): every module set and rank
ADAPTERS = [("attn8", ATTN, 8, {}), ("mlp16", MLP, 16, {}), ("all64", ATTN + MLP, 64, {}),
            ("all16rs", ATTN + MLP, 16, {"use_rslora": True, "lora_alpha": 32})]
MAX_TOKENS = 8
NUM_BLOCKS = 64
rng = random.Random(20)
# lengths straddle the 16-token prefill buckets and the 4-token blocks
PROMPTS = [[rng.randrange(3, 4096) for _ in range(n)] for n in (3, 9, 17, 5, 12, 1, 21, 7)]
SLOTS = [0, 1, 2, 3, -1, 2, 0, -1]  # a mixed batch: 4 adapters and base rows


def make_adapter(path: Path, targets: list[str], rank: int, seed: int, base_model: Path = MODEL,
                 **kw) -> Path:
    """A PEFT adapter with random A and B (PEFT starts B at zero), seeded."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    cfg = peft.LoraConfig(**{"r": rank, "lora_alpha": rank, "target_modules": targets, **kw})
    torch.manual_seed(seed)  # PEFT draws A from the global generator
    model = peft.get_peft_model(base, cfg)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape) * 0.5 / rank**0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(root / name, targets, rank, seed, **kw)
            for seed, (name, targets, rank, kw) in enumerate(ADAPTERS)]


@pytest.fixture(scope="module")
def expected(adapters) -> list[list[int]]:
    """HF + PEFT greedy tokens of each prompt under its slot's adapter (or none)."""
    out: dict[int, list[int]] = {}
    for slot in sorted(set(SLOTS)):
        rows = [i for i, s in enumerate(SLOTS) if s == slot]
        refs = hf_greedy(MODEL, [PROMPTS[i] for i in rows], MAX_TOKENS,
                         adapters[slot] if slot >= 0 else None)
        out.update(zip(rows, refs))
    return [out[i] for i in range(len(PROMPTS))]


def config(mode: str = "graph", tp: int = 1, **lora) -> ServeConfig:
    return ServeConfig(
        model=str(MODEL), device="cpu", parallel=ParallelConfig(tp=tp),
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64),
        graph=GraphConfig(mode=mode, decode_sizes=[1, 2, 4, 8], prefill_sizes=[16, 32]),
        lora=LoRAConfig(**{"max_loras": 4, **lora}), step_timeout_s=60,
    )


def sequences(slots: list[int]) -> list[Sequence]:
    # adapter_id keys the prefix cache: blocks computed under one adapter are not another's
    return [Sequence(i, p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                     adapter_id=s + 1, lora_slot=s) for i, (p, s) in enumerate(zip(PROMPTS, slots))]


# --- the adapter reader ------------------------------------------------------------------

def _edit_config(**fields):
    return lambda conf, tensors: conf.update(fields)


def _rename(old: str, new: str):
    def edit(conf, tensors):
        for k in [k for k in tensors if old in k]:
            tensors[k.replace(old, new)] = tensors.pop(k)
    return edit


def _drop_b(conf, tensors):
    del tensors[next(k for k in tensors if "lora_B" in k)]


def _transpose_a(conf, tensors):
    k = next(k for k in tensors if "lora_A" in k)
    tensors[k] = tensors[k].T.contiguous()


@pytest.mark.parametrize("edit, message", [
    (_edit_config(use_dora=True), "use_dora=True is not supported"),
    (_edit_config(bias="all"), "bias='all' is not supported"),
    (_edit_config(modules_to_save=["lm_head"]), "modules_to_save=.* is not supported"),
    (_edit_config(target_modules=["q_proj", "embed_tokens"]),
     r"unsupported target modules \['embed_tokens'\]"),
    (_edit_config(peft_type="IA3"), "peft_type 'IA3' is not LORA"),
    (_rename("self_attn.q_proj", "self_attn.rotary"), "unsupported target module 'rotary'"),
    (_rename("layers.1.", "layers.4."), "layer 4 of .* is out of range .*4 layers"),
    (_drop_b, "layer 0 k_proj has lora_A without lora_B"),
    (_transpose_a, r".*k_proj.lora_A.weight has shape \(256, 8\).* needs \(8, 256\)"),
])
def test_bad_adapters_are_refused_with_the_reason(adapters, tmp_path, edit, message):
    bad = tmp_path / "bad"
    shutil.copytree(adapters[0], bad)
    conf = json.loads((bad / "adapter_config.json").read_text())
    tensors = load_file(bad / "adapter_model.safetensors")
    edit(conf, tensors)
    (bad / "adapter_config.json").write_text(json.dumps(conf))
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match=f"LoRA adapter '{bad}': {message}"):
        read_adapter(bad, ModelConfig.from_pretrained(str(MODEL)), 64)


def test_missing_files_rank_and_base_shape_are_refused(adapters, tmp_path):
    cfg = ModelConfig.from_pretrained(str(MODEL))
    with pytest.raises(LoRAError, match="not a directory"):
        read_adapter(tmp_path / "none", cfg, 64)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(LoRAError, match="missing adapter_model.safetensors"):
        read_adapter(tmp_path, cfg, 64)
    with pytest.raises(LoRAError, match="rank 64 is over max_lora_rank 32"):
        read_adapter(adapters[2], cfg, 32)
    wider = msgspec.structs.replace(cfg, intermediate_size=1024)  # another base model
    with pytest.raises(LoRAError, match=r"mlp.down_proj.lora_A.weight has shape \(16, 768\)"):
        read_adapter(adapters[1], wider, 64)
    a = read_adapter(adapters[3], cfg, 64)  # rsLoRA: alpha / sqrt(r)
    assert a.rank == 16 and a.modules == set(ATTN + MLP) and sorted(a.layers) == [0, 1, 2, 3]
    assert a.layers[0]["q_proj"].scaling == 32 / 4


def test_config_errors():
    with pytest.raises(ConfigError, match="max_loras must be >= 0"):
        LoRAConfig(max_loras=-1)
    with pytest.raises(ConfigError, match="max_lora_rank must be in"):
        LoRAConfig(max_lora_rank=0)
    assert LoRAConfig(max_lora_rank=8).padded_rank == 16 and not LoRAConfig().enabled
    with pytest.raises(ConfigError, match="cannot be combined"):
        ServeConfig(lora=LoRAConfig(max_loras=2), offload=OffloadConfig(budget_bytes=1 << 20))


# --- the delta and its inputs ------------------------------------------------------------

def test_lora_delta_reference_equals_a_per_token_loop():
    """Three merged parts (q|k|v-like, uneven), a rank padded with zeros, -1 rows zero.
    Small integers: every float32 sum is exact whatever the GEMMs' order, so equal bitwise."""
    torch.manual_seed(0)
    slots_n, r, k, parts = 3, 16, 48, (32, 16, 16)
    a = torch.randint(-3, 4, (slots_n, len(parts) * r, k)).float()
    b = torch.randint(-3, 4, (slots_n, sum(parts), r)).float()
    a[:, 5:r] = 0  # part 0 of rank 5 in a rank-16 slot
    x = torch.randint(-3, 4, (11, k)).float()
    slot = torch.tensor([0, -1, 2, 2, 1, -1, 0, 1, 2, -1, 0], dtype=torch.int32)
    want = torch.zeros(11, sum(parts))
    for t, s in enumerate(slot.tolist()):
        for p, start in enumerate((0, 32, 48)):
            if s >= 0:
                u = x[t] @ a[s, p * r: (p + 1) * r].T
                want[t, start: start + parts[p]] = u @ b[s, start: start + parts[p]].T
    assert torch.equal(lora_delta(x, a, b, slot, parts), want)
    # a single part: the plain formula
    assert torch.equal(lora_delta(x, a[:, :r], b[:, :32], slot), want[:, :32])


def test_lora_rows_in_the_input_buffers():
    """Each token's slot (padding -1) and the bucket's tokens sorted by slot, stably; no
    LoRA rows (the same bytes as before) when LoRA is off."""
    cpu = torch.device("cpu")
    plan = StepPlan(1, [SeqChunk(0, [5, 6, 7], 0, [0], True, lora_slot=2),
                        SeqChunk(1, [8], 0, [1], True),
                        SeqChunk(2, [9, 10], 0, [2], True, lora_slot=0)])
    h = host_inputs(plan, 4, lora=True)
    assert h.lora == [2, 2, 2, -1, 0, 0]
    bufs = InputBuffers(16, 4, 4, cpu, lora=True)
    bufs.fill(h, num_tokens=8, num_seqs=4)
    lora = bufs.lora_inputs(8)
    assert lora.token_slot.tolist() == [2, 2, 2, -1, 0, 0, -1, -1]
    assert lora.order.tolist() == [3, 6, 7, 4, 5, 0, 1, 2]
    assert lora.sorted_slot.tolist() == [-1, -1, -1, 0, 0, 2, 2, 2]
    bufs.fill(host_inputs(StepPlan(2, plan.seqs[1:2]), 4, lora=True), num_tokens=4,
              num_seqs=4)
    assert bufs.lora_inputs(4).token_slot.tolist() == [-1] * 4
    assert bufs.lora_inputs(4).order.tolist() == [0, 1, 2, 3]
    off = InputBuffers(16, 4, 4, cpu)
    assert off.lora is None and off.lora_inputs(8) is None
    assert bufs.nbytes - off.nbytes == 3 * 16 * 4
    assert host_inputs(StepPlan(3, plan.seqs[1:2]), 4, lora=True).lora is None
    assert host_inputs(plan, 4).lora is None  # a model without adapter slots reads none


# --- greedy tokens against HF + PEFT -----------------------------------------------------

@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_mixed_batch_greedy_equals_hf_peft(adapters, expected, mode):
    w = loaded_worker(config(mode), NUM_BLOCKS, capture=True)
    for slot, path in enumerate(adapters):
        w.load_lora(slot, str(path))
    seqs = serve_in_process(w.cfg, w, sequences(SLOTS), NUM_BLOCKS)
    got = [s.output_token_ids for s in seqs]
    assert got == expected
    base = hf_greedy(MODEL, PROMPTS[:3], MAX_TOKENS)
    assert all(got[i] != base[i] for i in range(3))  # each adapter changes its tokens
    if mode == "eager":
        return
    # slots are rewritten in place under the same graphs: a cleared slot computes the base
    # model; a slot given another adapter keeps nothing of the one before (all16rs had MLP
    # modules, attn8 has none)
    w.unload_lora(2)
    w.load_lora(3, str(adapters[0]))
    seqs = serve_in_process(w.cfg, w, sequences([2, 3, 3, -1, -1, -1, -1, -1]), NUM_BLOCKS)
    ref = hf_greedy(MODEL, PROMPTS[:3], MAX_TOKENS, adapters[0])
    assert [s.output_token_ids for s in seqs[:3]] == [base[0]] + ref[1:]
    with pytest.raises(LoRAError, match=r"slot 4 is out of range \[0, 4\)"):
        w.load_lora(4, str(adapters[0]))
    with pytest.raises(LoRAError, match="rank 64 is over max_lora_rank 16"):
        loaded_worker(config(max_lora_rank=16), 8).load_lora(0, str(adapters[2]))


# --- slot images and promotions on the step path ------------------------------------------

def expected_slot(adapter: LoRAAdapter, slots: LoRASlots) -> dict[str, list[torch.Tensor]]:
    """What one slot must hold at TP=1, straight from the PEFT tensors: each part's A rows
    and B rows (scaling folded), zeros elsewhere."""
    want = {path: [torch.zeros_like(slot_a(a, 0)), torch.zeros_like(b[:, 0])]
            for path, (a, b) in slots.stacks.items()}
    for i, modules in adapter.layers.items():
        for name, m in modules.items():
            path, part = TARGETS[name]
            a, b = want[path]
            r, rank = m.a.shape[0], slots.rank
            start = sum(slots.layers[i].get_submodule(path).lora.slices[:part])
            a[i, part * rank: part * rank + r] = m.a
            b[i, start: start + m.b.shape[0], :r] = m.b.float() * m.scaling
    return want


def slot_a(a_layers: list[torch.Tensor], slot: int) -> torch.Tensor:
    """One slot's A at every layer, [L, P*R, in]."""
    return torch.stack([a[slot] for a in a_layers])


def test_slot_images_rewrite_the_whole_slot(adapters):
    """The image's copies (A per layer, B stacked) write what the per-module writes did, at
    every layer's view; loaded over a previous occupant, nothing of it remains (projection
    kinds the new adapter lacks are zeroed); a warm load equals a cold one; the other slot
    is untouched."""
    w = loaded_worker(config(max_loras=2), 8)
    slots = w.lora_slots
    cfg = ModelConfig.from_pretrained(str(MODEL))
    read = {i: read_adapter(adapters[i], cfg, 64) for i in (0, 1, 2)}
    assert w.load_lora(1, str(adapters[2]))[0] == "cold"
    for i, tier in [(2, "warm"), (1, "cold"), (0, "cold"), (2, "warm")]:  # all, mlp, attn
        assert w.load_lora(0, str(adapters[i]))[0] == tier
        want, other = expected_slot(read[i], slots), expected_slot(read[2], slots)
        for path, (a, b) in slots.stacks.items():
            assert torch.equal(slot_a(a, 0), want[path][0])
            assert torch.equal(b[:, 0], want[path][1])
            assert torch.equal(slot_a(a, 1), other[path][0]), path
            lora = slots.layers[3].get_submodule(path).lora  # the kernels' view is the stack
            assert lora.a.data_ptr() == a[3].data_ptr() and lora.a.is_contiguous()
    w.unload_lora(0)
    assert all(not slot_a(a, 0).any() and not b[:, 0].any() for a, b in slots.stacks.values())


def test_a_level2_sleep_keeps_what_the_slots_hold(adapters):
    """The slots keep A in the weight's rows after W's (in the weights' arena, whose host
    copy is taken at the first sleep only): a slot loaded after that sleep still holds its
    adapter after the next one, and the other slot too."""
    w = loaded_worker(config(max_loras=2), 8)
    qkv = w.lora_slots.layers[0].self_attn.qkv_proj
    assert qkv.lora.a.untyped_storage().data_ptr() == qkv.weight.untyped_storage().data_ptr()
    w.load_lora(0, str(adapters[0]))
    w.sleep(2)
    w.wake_up()
    w.load_lora(0, str(adapters[2]))  # after the arena's host copy
    w.load_lora(1, str(adapters[0]))
    want = {path: (slot_a(a, 0).clone(), slot_a(a, 1).clone())
            for path, (a, _) in w.lora_slots.stacks.items()}
    assert any(a.any() for a, _ in want.values())
    w.sleep(2)
    w.wake_up()
    for path, (a, _) in w.lora_slots.stacks.items():
        assert torch.equal(slot_a(a, 0), want[path][0]), path
        assert torch.equal(slot_a(a, 1), want[path][1]), path
    w.shutdown()


def test_a_slot_emptied_after_the_first_sleep_stays_empty(adapters):
    """A slot loaded before the arena's host copy and unloaded after it: the next level-2
    wake must not bring its A rows back."""
    w = loaded_worker(config(max_loras=2), 8)
    w.load_lora(1, str(adapters[2]))
    w.sleep(2)
    w.wake_up()
    w.unload_lora(1)
    w.sleep(2)
    w.wake_up()
    for a, b in w.lora_slots.stacks.values():
        assert not slot_a(a, 1).any() and not b[:, 1].any()
    w.shutdown()


@pytest.mark.parametrize("tokens", [5, EXT_MAX_TOKENS + 3])
def test_lora_linear_both_paths_equal_linear_plus_the_delta(tokens):
    """A layer whose weight holds every slot's A after W's rows (a q|k|v-like layer with a
    bias): a few tokens take the GEMM over all of it and expand every slot's u, more take
    the GEMM over W and the reference delta; both equal linear(x) + lora_delta."""
    g = torch.Generator().manual_seed(tokens)
    k, slices, rank, slots = 32, (24, 8, 8), 16, 3
    weight, bias = torch.randn(sum(slices), k, generator=g), torch.randn(sum(slices), generator=g)
    a = torch.randn(slots, len(slices) * rank, k, generator=g)
    b = torch.randn(slots, sum(slices), rank, generator=g)
    ext = torch.cat([weight, a.reshape(-1, k)])
    w = LoRAWeights(ext[sum(slices):].view(a.shape), b, slices)
    x = torch.randn(tokens, k, generator=g)
    token_slot = torch.randint(-1, slots, (tokens,), generator=g, dtype=torch.int32)
    order = torch.argsort(token_slot, stable=True).to(torch.int32)
    lora = LoRAInputs(token_slot, order, token_slot[order])
    with forward_context(ForwardContext(attn=None, lora=lora)):
        got = lora_linear(x, ext, bias, w)
    want = F.linear(x, weight, bias) + lora_delta(x, a, b, token_slot, slices)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32, other sum orders
    assert got.shape == (tokens, sum(slices))


# step -> the prompts arriving: adapters come while others decode, and wait for 2 slots
ARRIVALS = {0: [0, 1], 2: [2, 4], 4: [3, 5], 11: [7], 12: [6]}


def serve_with_promotions(w: Worker, seqs: list[Sequence], paths: list[str | None],
                          arrivals: dict[int, list[int]], num_blocks: int
                          ) -> tuple[list[bool], dict]:
    """The served loop's logic with the coordinator's slot admission, in this process:
    seqs[i] (under the adapter at paths[i]; None: base) arrives at the step `arrivals`
    names; granted loads ride on the next step. Returns, per load sent, whether a step was
    in flight then, and the registry's moves."""
    registry = LoRARegistry(w.cfg.lora.max_loras, lambda path: 0)
    for path in dict.fromkeys(p for p in paths if p):
        registry.register(path, path)
    admission = LoRAAdmission(registry)
    core = EngineCore.from_config(w.cfg, w.model_cfg, num_blocks)
    dispatch = local_dispatch(w)
    arrivals, loads_in_flight, step = dict(arrivals), [], 0
    while True:
        new = [(seqs[i], paths[i]) for i in arrivals.pop(step, [])]
        for seq, name in new:
            seq.adapter_id = registry.open(name).adapter_id if name else 0
        for seq in admission.admit(new):
            core.schedulers[0].add(seq)
        planned = core.schedule()
        if planned is None and not arrivals and core.in_flight is None:
            break
        if planned is None:
            emitted = core.flush(dispatch) if core.in_flight is not None else []
        else:
            loads = admission.take_loads()
            loads_in_flight += [core.in_flight is not None] * len(loads)
            outputs = dispatch(core.encode(*planned, loads))
            emitted = core.apply(outputs)
            core.in_flight = planned[0]
            assert admission.loaded([r for o in outputs for r in o.lora_loads]) == []
        for seq, _ in [pair for pairs in emitted for pair in pairs]:
            if seq.finish_reason is not None:
                admission.release(seq)
        step += 1
    return loads_in_flight, {(f, t): n for f, t, n in registry.stats()["moves"]}


def test_promotions_ride_on_steps_while_others_decode(adapters, expected):
    """2 slots for 4 adapters: adapters are promoted into freed slots by the next step's
    message (no flush: a step is in flight each time); greedy tokens equal HF + PEFT for
    every request."""
    w = loaded_worker(config(max_loras=2), NUM_BLOCKS, capture=True)
    seqs = sequences([-1] * len(PROMPTS))
    paths = [str(adapters[s]) if s >= 0 else None for s in SLOTS]
    loads_in_flight, moves = serve_with_promotions(w, seqs, paths, ARRIVALS, NUM_BLOCKS)
    assert [s.output_token_ids for s in seqs] == expected
    # 2 loads into empty slots, then 3 into slots freed meanwhile, each with a step in flight
    assert len(loads_in_flight) == 5 and sum(loads_in_flight) >= 3
    assert moves["hot", "warm"] == 3 and moves["warm", "hot"] == 1


# --- target modules ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def qv_adapter(tmp_path_factory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("qv") / "qv8", ["q_proj", "v_proj"], 8, 7)


def test_target_modules_are_inferred_from_the_adapters_at_start(adapters, qv_adapter):
    """SGLang's rule: the union of the start adapters' target_modules; all seven without
    any; given ones are kept (the CLI flag sets them)."""
    def resolved(*paths: Path, **kw) -> tuple[str, ...]:
        modules = tuple((f"a{i}", str(p)) for i, p in enumerate(paths))
        return ServeConfig(lora=LoRAConfig(max_loras=2, modules=modules, **kw)
                           ).resolved(0).lora.targets

    assert resolved(qv_adapter) == ("q_proj", "v_proj")
    assert resolved(qv_adapter, adapters[1]) == ("q_proj", "v_proj", "gate_proj", "up_proj",
                                                 "down_proj")
    assert resolved() == tuple(ATTN + MLP)
    assert resolved(qv_adapter, target_modules=("o_proj",)) == ("o_proj",)
    with pytest.raises(LoRAError, match="not a directory"):
        resolved(Path("/no/such/adapter"))
    with pytest.raises(ConfigError, match=r"unknown LoRA target modules \['lm_head'\]"):
        LoRAConfig(target_modules=("q_proj", "lm_head"))
    p = argparse.ArgumentParser()
    add_serve_args(p)
    a = p.parse_args(["--lora-target-modules", "q_proj", "down_proj"])
    assert serve_config(a).lora.target_modules == ("q_proj", "down_proj")
    # the issue's names for the tiers' budgets: hot slots, warm host memory
    a = p.parse_args(["--lora-hot-budget", "32", "--lora-warm-budget", "0.5"])
    cfg = serve_config(a).lora
    assert (cfg.max_loras, cfg.warm_budget_bytes) == (32, 2**29)


def test_only_targeted_projections_get_slots_and_others_are_refused(adapters, qv_adapter):
    """q and v: slots on q|k|v only (o, gate|up and down keep their plain kernels); greedy
    tokens still equal HF + PEFT; an adapter with an MLP module is refused with one line
    naming it and the flag."""
    w = loaded_worker(config(target_modules=("q_proj", "v_proj")), NUM_BLOCKS, capture=True)
    layer = w.model.model.layers[0]
    assert layer.self_attn.qkv_proj.lora.parts == (0, 2)  # the GPU kernels skip k
    assert all(m.lora is None for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                        layer.mlp.down_proj))
    w.load_lora(1, str(qv_adapter))
    seqs = serve_in_process(w.cfg, w, sequences([-1, 1, 1, -1, 1, -1, -1, -1]), NUM_BLOCKS)
    ref = hf_greedy(MODEL, [PROMPTS[i] for i in (1, 2, 4)], MAX_TOKENS, qv_adapter)
    assert [seqs[i].output_token_ids for i in (1, 2, 4)] == ref
    with pytest.raises(LoRAError, match=(
            r"targets 'gate_proj', which has no adapter slots \(served target modules: "
            r"\['q_proj', 'v_proj'\]; set them at start with --lora-target-modules\)")) as e:
        w.load_lora(0, str(adapters[1]))
    assert "\n" not in str(e.value)


def test_lora_off_builds_the_plain_model():
    w = loaded_worker(config(max_loras=0), 8)
    assert all(getattr(m, "lora", None) is None for m in w.model.modules())
    assert w.executor.bufs.lora is None
    assert "lora" not in {b.name for b in w.executor.buffer_infos()}
    with pytest.raises(LoRAError, match="LoRA is off"):
        w.unload_lora(0)


def test_tp2_mixed_batch_greedy_equals_hf_peft(ray_session, adapters, expected):
    """Two Worker actors over gloo, each loading its shard of every adapter (B split with
    the q|k|v and gate|up rows, A with the o and down columns), stepped as the coordinator
    steps a TP group: the same message to both, the first rank's tokens back."""
    cfg = config("graph", tp=2)
    actor = ray_session.remote(Worker).options(num_cpus=1)
    workers = [actor.remote(cfg, rank) for rank in range(2)]
    try:
        addr = ray_session.get(workers[0].address.remote())
        ray_session.get([w.load.remote(addr) for w in workers])
        ray_session.get([w.allocate_kv_cache.remote(NUM_BLOCKS) for w in workers])
        ray_session.get([w.capture_all.remote() for w in workers])
        ray_session.get([w.load_lora.remote(slot, str(path)) for slot, path in
                         enumerate(adapters) for w in workers])
        decoder = msgspec.msgpack.Decoder(StepOutput)

        def dispatch(msgs: list[bytes]) -> list[StepOutput]:
            (msg,) = msgs
            first, _ = ray_session.get([w.run.remote(msg) for w in workers])
            return [decoder.decode(first)]

        core = EngineCore.from_config(cfg, ModelConfig.from_pretrained(str(MODEL)), NUM_BLOCKS)
        seqs = sequences(SLOTS)
        for s in seqs:
            core.schedulers[0].add(s)
        run_to_completion(core, dispatch)
        assert [s.output_token_ids for s in seqs] == expected
    finally:
        for w in workers:
            ray_session.kill(w)
