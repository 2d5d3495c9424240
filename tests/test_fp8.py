"""FP8 checkpoints as published (compressed-tensors, HF fine-grained, ModelOpt) on the CPU
reference path: each loads as its dequantized weights; weight-only ones give the reference's
greedy tokens exactly; W8A8 ones its logits within e4m3's precision; TP=2 equals TP=1; any
other quantization method is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from raygraph.config import (
    CacheConfig,
    ConfigError,
    GraphConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.engine.sequence import Sequence
from raygraph.model import ops
from raygraph.model.checkpoint import CheckpointError
from raygraph.model.loader import build_model, check_checkpoint
from raygraph.model.parallel import Comm
from raygraph.model.quant import DECODE_ROWS, FP8, Fp8Weight, check_fp8_device, fp8_weight
from raygraph.protocol import SamplingParams
from raygraph.worker.worker import Worker
from tests.conftest import (
    assert_close_across_shapes,
    free_port,
    loaded_worker,
    make_checkpoint,
    serve_in_process,
)
from tests.conftest import prefill_logits as shared_prefill_logits
from tests.fp8_checkpoints import FORMATS, Fp8Format, write_fp8
from tests.test_cli import one_error_line, raygraph

CPU = torch.device("cpu")
# e4m3's unit roundoff: 3 mantissa bits, so quantizing one value errs by at most 2^-4 of it
E4M3_U = 2.0**-4
PROMPTS = [[5 + i, 9, 11, 13 + i, 7] * (1 + i % 3) for i in range(4)]
MAX_TOKENS = 10
PROMPT = [5, 9, 33, 100, 7, 40, 12, 60, 61, 62, 200, 17]
BLOCK = 4


def prefill_logits(model: torch.nn.Module, tp: int, prompt: list[int] = PROMPT) -> torch.Tensor:
    return shared_prefill_logits(model, tp, prompt, BLOCK)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("fp8-src"), "LlamaForCausalLM",
                           random_norms=True)


@pytest.fixture(scope="module")
def checkpoints(source: Path, tmp_path_factory: pytest.TempPathFactory):
    """format name -> (FP8 checkpoint, reference checkpoint of its dequantized weights)."""
    root = tmp_path_factory.mktemp("fp8")
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            made[name] = (root / name, root / f"{name}-ref")
            write_fp8(source, *made[name], FORMATS[name])
        return made[name]

    return get


def model(path: Path, comm: Comm | None = None) -> torch.nn.Module:
    return build_model(ModelConfig.from_pretrained(str(path)), comm or Comm(), torch.float32, CPU)


def fp8_layers(m: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: mod for n, mod in m.named_modules() if getattr(mod, "fp8", None) is not None}


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_loads_as_its_dequantized_weights(checkpoints, name: str) -> None:
    quant, ref = checkpoints(name)
    check_checkpoint(ModelConfig.from_pretrained(str(quant)))  # the driver's check agrees
    got, want = model(quant), model(ref)
    layers = fp8_layers(got)
    assert len(layers) == 2 * 4  # q|k|v, o, gate|up, down of both layers
    for n, layer in layers.items():
        assert layer.weight.dtype == FP8
        assert torch.equal(fp8_weight(layer).dequantize(torch.float32),
                           want.get_submodule(n).weight), n
    assert got.lm_head.weight.dtype == torch.float32  # ignored: kept in the model's dtype
    fmt = FORMATS[name]
    if fmt.activations == "static":  # q|k|v quantize x once, by their largest scale
        stored = load_file(quant / "model.safetensors")
        qkv = got.model.layers[0].self_attn.qkv_proj.input_scale
        parts = [stored[f"model.layers.0.self_attn.{p}_proj.input_scale"] for p in "qkv"]
        assert qkv.item() == max(p.item() for p in parts) == parts[1].item()
    if fmt.method == "modelopt":  # recorded for an FP8 KV cache
        attn = got.model.layers[1].self_attn
        assert (attn.k_scale.item(), attn.v_scale.item()) == (0.5, 0.25)


def test_an_fp8_cache_takes_the_checkpoints_kv_scales(checkpoints) -> None:
    """ModelOpt's k_scale / v_scale (0.5 / 0.25 here) divide what an FP8 cache stores; a
    cache in the model's dtype needs none."""
    quant, _ = checkpoints("modelopt")
    for kind, want in (("fp8", (0.5, 0.25)), ("auto", (1.0, 1.0))):
        cfg = ServeConfig(model=str(quant), device="cpu", cache=CacheConfig(cache_dtype=kind))
        worker = Worker(cfg, 0)
        worker.load(("127.0.0.1", 0))
        assert {layer.kv_scale for layer in worker.model.attention_layers()} == {want}
        worker.shutdown()


def greedy(path: Path) -> list[list[int]]:
    cfg = ServeConfig(model=str(path), device="cpu", cache=CacheConfig(block_size=4),
                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12),
                      graph=GraphConfig(mode="eager"))
    worker = loaded_worker(cfg, 64)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    seqs = [Sequence(i, p, params) for i, p in enumerate(PROMPTS)]
    return [s.output_token_ids for s in serve_in_process(cfg, worker, seqs, 64)]


@pytest.mark.parametrize("name", ["ct-channel-w8a16", "ct-tensor-w8a16"])
def test_weight_only_greedy_tokens_equal_the_dequantized_reference(checkpoints, name: str,
                                                                   source: Path) -> None:
    quant, ref = checkpoints(name)
    want = greedy(ref)
    assert greedy(quant) == want
    # the quantization changed the model (its greedy tokens may survive it)
    assert not torch.equal(prefill_logits(model(ref), 1), prefill_logits(model(source), 1))


@pytest.mark.parametrize("name", ["ct-channel-dynamic", "ct-tensor-static", "fp8-block",
                                  "modelopt", "modelopt-file"])
def test_w8a8_logits_within_e4m3_precision(checkpoints, name: str) -> None:
    """Activations quantized to e4m3 (each value off by up to E4M3_U of itself) before 8 GEMMs:
    the logits' RMS error stays within E4M3_U of their RMS, the largest within 2 E4M3_U of
    the largest logit (measured: about half of each)."""
    quant, ref = checkpoints(name)
    prompt = PROMPT * 2  # past DECODE_ROWS tokens: the activations are quantized
    got, want = prefill_logits(model(quant), 1, prompt), prefill_logits(model(ref), 1, prompt)
    err = got - want
    assert err.abs().max() > 0  # the activations were quantized
    assert err.pow(2).mean().sqrt() <= E4M3_U * want.pow(2).mean().sqrt()
    assert err.abs().max() <= 2 * E4M3_U * want.abs().max()


def _tp2_rank(rank: int, port: int, path: Path, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        torch.save(prefill_logits(model(path, Comm(dist.group.WORLD)), 2),
                   out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["fp8-block-tp", "modelopt"])
def test_tp2_over_gloo_equals_tp1(checkpoints, name: str, tmp_path: Path) -> None:
    """Scales split with their weights: rows of q|k|v and gate|up, block columns of o and
    down (whose blocks then quantize the activations per rank as one rank does)."""
    quant, _ = checkpoints(name)
    mp.spawn(_tp2_rank, args=(free_port(), quant, tmp_path), nprocs=2, join=True)
    want = prefill_logits(model(quant), 1)
    for rank in range(2):
        assert_close_across_shapes(torch.load(tmp_path / f"rank{rank}.pt"), want)


def test_modules_to_not_convert_stay_in_the_model_dtype(source: Path, tmp_path: Path) -> None:
    fmt = Fp8Format("fp8", "block", "dynamic", block=(16, 32),
                    not_convert=("model.layers.1.mlp",))
    write_fp8(source, tmp_path / "q", tmp_path / "ref", fmt)
    got = model(tmp_path / "q")
    mlp = got.model.layers[1].mlp
    assert mlp.gate_up_proj.fp8 is None and mlp.down_proj.weight.dtype == torch.float32
    assert len(fp8_layers(got)) == 6


def test_linear_of_an_fp8_weight_is_the_dequantized_product() -> None:
    """ops.linear's reference path against the definition, written out: W[o, i] =
    data[o, i] * scale[o, i // group]; x quantized per token and group of columns past
    DECODE_ROWS tokens, as it is at decode rows."""
    torch.manual_seed(0)
    x, w = torch.randn(DECODE_ROWS + 4, 12) * 3, torch.randn(8, 12)
    group = 4
    scale = w.abs().view(8, 3, 4).amax(-1) / 448
    data = (w / scale.repeat_interleave(group, 1)).to(FP8)
    weight = Fp8Weight(data, scale, group, "none")
    deq = torch.tensor([[data[o, i].item() * scale[o, i // group].item() for i in range(12)]
                        for o in range(8)])
    torch.testing.assert_close(ops.linear(x, weight), x @ deq.T, rtol=1e-6, atol=1e-6)
    xs = x.abs().view(-1, 3, 4).amax(-1) / 448
    xq = (x / xs.repeat_interleave(group, 1)).to(FP8).float() * xs.repeat_interleave(group, 1)
    dynamic = Fp8Weight(data, scale, group, "dynamic")
    torch.testing.assert_close(ops.linear(x, dynamic), xq @ deq.T, rtol=1e-6, atol=1e-6)
    s = torch.tensor([0.01])  # static: values past 448 * s clip to it
    static = Fp8Weight(data, scale, group, "static", s)
    xq = (x / s).clamp(-448, 448).to(FP8).float() * s
    torch.testing.assert_close(ops.linear(x, static), xq @ deq.T, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ops.linear(x, static), ops.linear(x, weight), atol=1e-2)
    decode = x[:DECODE_ROWS]
    for w8 in (dynamic, static):
        assert torch.equal(ops.linear(decode, w8), ops.linear(decode, weight))


def with_quant_config(src: Path, dst: Path, qc: dict) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return dst


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "awq", "bits": 4}, "quantization method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method "
                                                              "'bitsandbytes'"),
    ({"quant_method": "mxfp4"}, "quantization method 'mxfp4'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt quant_algo 'NVFP4'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}},
     "compressed-tensors format 'int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
     "compressed-tensors format 'nvfp4-pack-quantized'"),
])
def test_other_quantization_methods_are_refused_by_name(source: Path, tmp_path: Path, qc,
                                                        named: str) -> None:
    path = with_quant_config(source, tmp_path / "q", qc)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_pretrained(str(path))
    line = str(err.value)
    assert named in line and str(path) in line and "\n" not in line
    assert "supported; raygraph loads FP8 checkpoints" in line


def test_an_unknown_quant_method_is_one_line_exit_2(source: Path, tmp_path: Path) -> None:
    path = with_quant_config(source, tmp_path / "awq", {"quant_method": "awq", "bits": 4})
    p = raygraph("serve", "--model", str(path))
    assert p.returncode == 2, p.stderr
    assert "quantization method 'awq'" in one_error_line(p)


def test_fp8_tensors_without_an_fp8_config_are_refused(checkpoints, tmp_path: Path) -> None:
    quant, _ = checkpoints("ct-channel-w8a16")
    path = Path(shutil.copytree(quant, tmp_path / "no-config"))
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items()
               if not k.endswith("weight_scale")}
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"_proj.weight in model.safetensors: stored "
                                              r"as F8_E4M3; expected not FP8"):
        model(path)


def test_lora_with_fp8_is_refused_and_offload_is_not(checkpoints) -> None:
    from raygraph.config import LoRAConfig, OffloadConfig

    quant, _ = checkpoints("ct-channel-w8a16")
    with pytest.raises(ConfigError, match="cannot be combined with LoRA adapters"):
        ServeConfig(model=str(quant), lora=LoRAConfig(max_loras=1)).model_cfg()
    offloaded = ServeConfig(model=str(quant), offload=OffloadConfig(budget_bytes=1 << 20))
    assert offloaded.model_cfg().quant is not None  # tests/test_offload.py runs it


def test_a_scale_of_the_wrong_shape_is_refused_by_name(checkpoints, tmp_path: Path) -> None:
    quant, _ = checkpoints("fp8-block")
    path = Path(shutil.copytree(quant, tmp_path / "blocks"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [16, 16]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.weight_scale_inv "
                                              r"in model.safetensors: shape \(3, 3\), the "
                                              r"config implies \(4, 8\)"):
        check_checkpoint(ModelConfig.from_pretrained(str(path)))


def test_blocks_a_tp_split_would_cut_are_refused_up_front(checkpoints) -> None:
    quant, _ = checkpoints("fp8-block")  # blocks of 48 columns; o_proj's 64 split in 32s
    with pytest.raises(ConfigError, match="tp=2 splits num_heads \\* head_dim=64 into 32 "
                                          "columns a rank, not a multiple of the FP8 weight "
                                          "blocks' 48"):
        ParallelConfig(tp=2).check_model(ModelConfig.from_pretrained(str(quant)))


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_the_scaled_mm_path_on_torchs_cpu_kernel(monkeypatch, activations: str) -> None:
    """ops.fp8_gemm's arguments (row-wise scales, the column-major weight, the static scale
    expanded) through torch's CPU _scaled_mm, where this torch has one: the GPU path's math,
    against the reference path in float32 (the GPU kernel itself: tests/gpu/test_fp8_gpu.py)."""
    torch.manual_seed(2)
    x, w = torch.randn(DECODE_ROWS + 8, 64).to(torch.bfloat16), torch.randn(32, 64)
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    weight = Fp8Weight((w / scale).to(FP8), scale, 64, activations,
                       torch.tensor([0.01]) if activations == "static" else None)
    try:
        torch._scaled_mm(weight.data, weight.data.t(), scale_a=scale, scale_b=scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        pytest.skip("this torch has no CPU _scaled_mm with row-wise scales")
    monkeypatch.setattr(ops, "_scaled_mm_applies", lambda x, w: True)
    bias = torch.randn(32).to(torch.bfloat16)
    got = ops.fp8_gemm(x, weight, bias).float()
    want = F.linear(*ops.dense_operands(x.float(), weight), bias.float())
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps * want.abs().max().item())


@pytest.mark.parametrize("capability,weights,cache,refused", [
    ((8, 0), True, False, "FP8 weights"), ((8, 6), False, True, "an FP8 KV cache"),
    ((8, 6), True, True, "FP8 weights .* and an FP8 KV cache"),
    ((8, 0), False, False, None), ((8, 9), True, True, None), ((9, 0), True, True, None)])
def test_fp8_is_refused_in_one_line_on_a_gpu_older_than_ada(monkeypatch, capability, weights,
                                                            cache, refused) -> None:
    """A GPU without e4m3 conversions (compute capability below 8.9) refuses FP8 weights and
    an FP8 cache when the worker loads, naming what asked for FP8 and the GPU's capability;
    nothing is asked of a CPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    if refused is None:
        check_fp8_device(cuda, weights, cache)
    else:
        with pytest.raises(ConfigError, match=rf"^{refused} .* on cuda:0: compute capability "
                                              rf"{capability[0]}\.{capability[1]}; FP8 needs "
                                              r"8\.9 or later"):
            check_fp8_device(cuda, weights, cache)
    check_fp8_device(torch.device("cpu"), True, True)
