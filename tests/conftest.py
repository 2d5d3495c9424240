"""Shared fixtures: one Ray instance per session, tiny random HF checkpoints, GPU skips."""

from __future__ import annotations

import atexit
import importlib
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray starts its workers at nice 15: any busy process outside Ray (this one, a subprocess,
# another job on the machine) then takes nearly all of the CPU from the actors under test,
# and a 10 s start-up becomes minutes. At 0 they share it fairly.
os.environ.setdefault("RAY_worker_niceness", "0")
if not torch.cuda.is_available():
    # Triton kernels can run only in its interpreter here; it is chosen when triton is first
    # imported (triton.language's own helpers are made then). Nothing else here runs them.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # modules that replace the session's Ray with a cluster of their own run last, so the
    # coordinators the session shares (shared_coordinator) start once, and the session's Ray
    # is not needed again after them
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is not None)
    gpus = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible"))
        for n in (2, 4):
            if f"gpu{n}" in item.keywords and gpus < n:
                item.add_marker(pytest.mark.skip(reason=f"needs {n} CUDA GPUs; {gpus} visible"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Leave without tearing the interpreter down once Triton was loaded: its nanobind
    bindings print a leak report of the IR objects its caches still hold at that point
    (dozens of lines after a green run). Everything is flushed and the status kept."""
    if "triton" not in sys.modules:
        return

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(exitstatus))

    atexit.register(leave)  # runs first: atexit is last in, first out


@pytest.fixture
def interpreted():
    """Imports a `raygraph.model` Triton module whose kernels run in Triton's interpreter on
    CPU tensors: the GPU kernels' logic (indexing, masks, the online softmax, split bounds)
    is checked on a machine without a GPU. The interpreter has no bfloat16 (it gives
    garbage): tests use float16 and float32. With a GPU the same logic runs compiled, in
    tests/gpu."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is visible: its tests run these kernels compiled")
    pytest.importorskip("triton", reason="the Triton interpreter needs the triton package")
    return lambda name: importlib.import_module(f"raygraph.model.{name}")


def init_test_ray() -> None:
    """The suite's one-node Ray (own_ray modules, last, shut it down for a cluster of their
    own)."""
    import ray

    ray.init(num_cpus=6, include_dashboard=False, namespace="raygraph-tests",
             log_to_driver=False)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    init_test_ray()
    yield ray
    stop_shared_coordinators()
    ray.shutdown()


def start_coordinators(cfgs: list) -> list:
    """Coordinators of `cfgs` started side by side: a start-up waits on new processes and
    on rendezvous, not only on the CPU, so starts overlap well even on 2 cores. If one
    fails, those that started are stopped and its error raised."""
    from raygraph.client.connect import start_coordinator

    with ThreadPoolExecutor(len(cfgs)) as pool:
        futures = [pool.submit(start_coordinator, cfg) for cfg in cfgs]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        stop_coordinators(started)
        raise errors[0]
    return started


def stop_coordinators(handles: list) -> None:
    import ray

    for handle in handles:
        ray.get(handle.shutdown.remote())
        ray.kill(handle)


# coordinator name -> handle: coordinators on the session's Ray that several modules use
_SHARED: dict[str, Any] = {}


def shared_coordinator(cfg: Any) -> Any:
    """The coordinator of `cfg` on the session's Ray, started on first use and kept until
    the session ends: starting one costs seconds of CPU, so modules that only send requests
    to the same config share it (none of them sleeps, stops or breaks it)."""
    from raygraph.client.connect import start_coordinator

    if cfg.coordinator_name not in _SHARED:
        _SHARED[cfg.coordinator_name] = start_coordinator(cfg)
    return _SHARED[cfg.coordinator_name]


def stop_shared_coordinators() -> None:
    """Stop the shared coordinators (before their Ray goes)."""
    handles = list(_SHARED.values())
    _SHARED.clear()
    stop_coordinators(handles)


def default_model_config() -> Any:
    """The built-in model on CPU with room for 64 concurrent requests: the shared
    coordinator of the modules that serve it as it ships (default graph mode and cache)."""
    from raygraph.config import SchedulerConfig, ServeConfig

    return ServeConfig(device="cpu", coordinator_name="shared-default-model", step_timeout_s=60,
                       scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024))


def default_model_tp2_config() -> Any:
    """The built-in model at TP=2 on CPU, 8 sequences a step: the shared coordinator of the
    modules that serve it over two ranks."""
    from raygraph.config import ParallelConfig, SchedulerConfig, ServeConfig

    return ServeConfig(device="cpu", parallel=ParallelConfig(tp=2),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                       coordinator_name="shared-default-model-tp2")


@pytest.fixture(scope="session")
def shared_stopper() -> Any:
    """`stop_shared_coordinators` of the conftest pytest loaded: a module importing
    tests.conftest gets a second copy of the module, with a registry of its own."""
    return stop_shared_coordinators


@pytest.fixture(scope="module")
def default_model_coord(ray_session) -> Any:
    """The shared coordinator of `default_model_config()`."""
    return shared_coordinator(default_model_config())


@pytest.fixture(scope="module")
def default_model_tp2_coord(ray_session) -> Any:
    """The shared coordinator of `default_model_tp2_config()`."""
    return shared_coordinator(default_model_tp2_config())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(path: Path, arch: str, random_norms: bool = False, **overrides) -> Path:
    """A tiny random HF checkpoint written with save_pretrained (float32). random_norms:
    RMSNorm weights drawn from [0.5, 1.5) instead of HF's ones, so a norm loaded into the
    wrong place (or not at all) changes the tokens."""
    import transformers

    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model = getattr(transformers, arch)(cfg_cls(**kw)).eval()
    if random_norms:
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def make_gpu_llama(path: Path, num_key_value_heads: int = 2, **kw: Any) -> Path:
    """The GPU tests' Llama: big enough for the Triton kernels' tiles, small to build."""
    return make_checkpoint(path, "LlamaForCausalLM", vocab_size=512, hidden_size=256,
                           intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                           num_key_value_heads=num_key_value_heads, **kw)


@pytest.fixture(scope="session")
def gpu_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpu_llama(tmp_path_factory.mktemp("gpu-llama"))


# Results computed with different shapes or kernels (a graph bucket padded past the real
# batch vs the exact batch, a batched kernel vs a per-token reference) round differently: a
# GEMM's M alone can change its reduction order on some CPUs (seen: 682 of 768 float32
# logits off by up to 1.6e-7 on an AVX-512 EPYC). They agree to a few units in the last place
# of the values' magnitude (<= 3 measured on the tiny checkpoints), never bitwise by
# contract. Compare like with like (same shapes, same kernels) exactly; across shapes or
# kernels use this tolerance, a fixed number of the dtype's epsilons: ~10x the rounding
# noise seen, far below what a real bug does (wrong rows back from a kernel, padding leaking
# into a real row, one fp16 round trip: 1e-4 relative and more).
CROSS_SHAPE_ULPS = 32



def prefill_logits(model: torch.nn.Module, tp: int, prompt: list[int], block: int
                   ) -> torch.Tensor:
    """Full-vocab logits of every prompt position, over a fresh paged cache on the CPU."""
    from raygraph.graph.inputs import batch_from, host_inputs
    from raygraph.model.context import forward_context
    from raygraph.protocol import SeqChunk, StepPlan

    cfg = model.config
    blocks = -(-len(prompt) // block)
    for layer in model.attention_layers():
        shape = (blocks + 1, block, cfg.kv_heads_per_rank(tp), cfg.head_dim)
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    plan = StepPlan(0, [SeqChunk(0, prompt, 0, list(range(blocks)), False)])
    batch = batch_from(host_inputs(plan, block), torch.device("cpu"))
    with torch.no_grad(), forward_context(batch.ctx):
        return model.compute_logits(model(batch.input_ids, batch.positions))

def dtype_tol(dtype: torch.dtype, scale: float = 1.0,
              ulps: int = CROSS_SHAPE_ULPS) -> tuple[float, float]:
    """(atol, rtol) for `dtype` results computed with different shapes or kernels: `ulps`
    epsilons of the dtype, relative, and absolute on values of magnitude `scale`."""
    eps = torch.finfo(dtype).eps
    return ulps * eps * scale, ulps * eps


def assert_close_across_shapes(got: torch.Tensor, want: torch.Tensor, msg=None) -> None:
    """`got` equals `want` within the dtype's rounding noise (see `dtype_tol`), scaled by the
    largest magnitude in `want`. Only for results of different shapes or kernels: like with
    like compares with torch.equal."""
    atol, rtol = dtype_tol(want.dtype, want.abs().max().item() if want.numel() else 1.0)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=msg)


def loaded_worker(cfg, num_blocks: int, capture: bool = False):
    """A rank-0 Worker in this process, built as the coordinator builds it: loaded, its KV
    cache bound, and (capture) the start-up capture schedule run."""
    from raygraph.worker.worker import Worker

    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(num_blocks)
    if capture:
        w.capture_all()
    return w


def serve_in_process(cfg, worker, seqs: list, num_blocks: int) -> list:
    """`seqs` through the served loop's logic (EngineCore: deltas, tokens fed on the device,
    replies a step late) against `worker` called directly; returns them, finished."""
    from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion

    core = EngineCore.from_config(cfg, worker.model_cfg, num_blocks)
    for s in seqs:
        core.schedulers[0].add(s)
    run_to_completion(core, local_dispatch(worker))
    return seqs


def cascade_lengths(executor) -> list[int]:
    """From now on, per step of the graph executor: the shared prefix length its cascade
    graph read, or 0 where the plain graph (or a prefill) ran."""
    lengths, step = [], executor.step

    def recording_step(plan):
        out = step(plan)
        lengths.append(executor.bufs.shared_prefix if executor.last_cascade else 0)
        return out

    executor.step = recording_step
    return lengths


def randomise_caches(workers, seed: int) -> None:
    """The same random K/V contents in every worker's cache (graph and eager compared)."""
    for w in workers:
        torch.manual_seed(seed)
        for layer in w.model.attention_layers():
            layer.k_cache.normal_()
            layer.v_cache.normal_()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM",
                           rope_theta=500000.0)


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A draft model for the built-in one: a random one-layer Llama of its vocabulary,
    whose drafts rarely hold."""
    return str(make_checkpoint(tmp_path_factory.mktemp("draft"), "LlamaForCausalLM",
                               vocab_size=4096, num_hidden_layers=1))


def make_eagle3_head(path: Path, target: str, draft_vocab: int, seed: int = 0,
                     speculators: bool = False) -> str:
    """A random EAGLE-3 head for the checkpoint at `target`, in the EAGLE authors' layout
    (config.json's fields, `midlayer.*`, `fc`, `d2t`, `t2d`, no embedding), float32; with
    `speculators`, in that library's (the layer's config nested, `layers.0.*`, the residual
    after the hidden state's norm by default)."""
    import json

    from safetensors.torch import save_file

    t = json.loads((Path(target) / "config.json").read_text())
    h, vocab = t["hidden_size"], t["vocab_size"]
    heads, kv = t["num_attention_heads"], t.get("num_key_value_heads", t["num_attention_heads"])
    d, inter = t.get("head_dim") or h // heads, t["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    tensors = {"fc.weight": rand(h, 3 * h), "norm.weight": torch.ones(h),
               "lm_head.weight": rand(draft_vocab, h), "d2t": ids - torch.arange(draft_vocab),
               "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)}
    # q and k spread wide: attention sharp enough that a key at the wrong place shows
    for name, shape, std in (("self_attn.q_proj", (heads * d, 2 * h), 0.3),
                             ("self_attn.k_proj", (kv * d, 2 * h), 0.3),
                             ("self_attn.v_proj", (kv * d, 2 * h), 0.05),
                             ("self_attn.o_proj", (h, heads * d), 0.05),
                             ("mlp.gate_proj", (inter, h), 0.05), ("mlp.up_proj", (inter, h), 0.05),
                             ("mlp.down_proj", (h, inter), 0.05)):
        tensors[f"midlayer.{name}.weight"] = rand(*shape, std=std)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = torch.ones(h)
    if speculators:
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                "rms_norm_eps", "max_position_embeddings") if k in t}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                  num_hidden_layers=1, num_key_value_heads=kv, head_dim=d, vocab_size=vocab,
                  draft_vocab_size=draft_vocab, torch_dtype="float32",
                  rope_theta=(t.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if speculators:
        layer = {**config, "architectures": ["LlamaForCausalLM"]}
        del layer["draft_vocab_size"]
        config = {"speculators_model_type": "eagle3", "transformer_layer_config": layer,
                  "draft_vocab_size": draft_vocab, "architectures": ["Eagle3Speculator"],
                  "speculators_config": {"proposal_methods": [
                      {"proposal_type": "greedy", "speculative_tokens": 3}],
                      "verifier": {"name_or_path": target}}}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def eagle3_head(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random EAGLE-3 head for the built-in model: 1024 of its 4096 tokens drafted."""
    from raygraph.config import DEFAULT_MODEL

    return make_eagle3_head(tmp_path_factory.mktemp("eagle3"), DEFAULT_MODEL, 1024)


@pytest.fixture(scope="session")
def eagle3_speculators_head(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same kind of head in the `speculators` layout."""
    from raygraph.config import DEFAULT_MODEL

    return make_eagle3_head(tmp_path_factory.mktemp("eagle3-sp"), DEFAULT_MODEL, 1024,
                            seed=1, speculators=True)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "Qwen2ForCausalLM",
                           tie_word_embeddings=True)


def verify_rows_case(dtype: torch.dtype, device: torch.device, rope: bool, bs: int = 16,
                     kv_heads: int = 2, group: int = 4, d: int = 64) -> dict:
    """A decode batch where sequences verify drafts (a row per token: graph/inputs.py) beside
    plain decode rows and two padding rows, chunks straddling 64-key tiles; random caches,
    queries and K/V (unrotated when `rope`, with the rotary tables). Also the reference:
    the caches with every row's K/V stored, and the torch attention over them. The keyword
    arguments of paged_decode_attention (but the scale), `rows` and the reference's."""
    from raygraph.graph.inputs import prepare_batch
    from raygraph.model.ops import paged_attention_ref, rotary, store_kv
    from raygraph.protocol import SeqChunk, StepPlan

    # (keys cached before the step, tokens in the step: the last one and its drafts)
    shape = [(61, 5), (20, 1), (127, 3), (1, 2), (64, 1)]
    gen = torch.Generator().manual_seed(7)
    perm, used, seqs = torch.randperm(40, generator=gen).tolist(), 0, []
    for i, (cached, n) in enumerate(shape):
        blocks = -(-(cached + n) // bs)
        seqs.append(SeqChunk(i, [1] * n, cached, perm[used: used + blocks], True,
                             verify=n - 1))
        used += blocks
    md = prepare_batch(StepPlan(0, seqs), bs, device).ctx.attn
    rows, pad = md.num_tokens, 2

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    def padded(x: torch.Tensor) -> torch.Tensor:  # padding rows: zeros (kv length 0)
        return torch.cat([x, x.new_zeros(pad, *x.shape[1:])])

    kc, vc = rand(41, bs, kv_heads, d), rand(41, bs, kv_heads, d)
    q, k_new, v_new = (rand(rows + pad, n, d) for n in (kv_heads * group, kv_heads, kv_heads))
    tables = tuple(torch.randn(2, 512, d // 2, generator=gen).to(device)) if rope else None
    # (the GPU's rotary op rotates in place)
    rq, rk = (rotary(q[:rows].clone(), k_new[:rows].clone(), *tables, md.positions) if rope
              else (q, k_new))
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(rk[:rows], v_new[:rows], ref_k, ref_v, md.slot_mapping)
    ref = paged_attention_ref(rq[:rows], ref_k, ref_v, md, d**-0.5)
    args = dict(q=q, k_cache=kc, v_cache=vc, block_tables=padded(md.block_tables),
                seq_lens=padded(md.seq_lens), k_new=k_new, v_new=v_new, rope=tables,
                verify_row=padded(md.verify_row))
    return dict(args=args, rows=rows, verify_row=md.verify_row.tolist(), ref_k=ref_k,
                ref_v=ref_v, ref=ref)
