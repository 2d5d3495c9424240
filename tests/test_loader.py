"""HF checkpoint loading: config parsing, single/sharded safetensors, clear errors, TP slices."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from raygraph.config import ConfigError, ModelConfig
from raygraph.model.llama import LlamaForCausalLM
from raygraph.model.loader import STACKED, CheckpointError, build_model, load_weights
from raygraph.model.parallel import (
    ColumnParallelLinear,
    Comm,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_shard,
)

CPU = torch.device("cpu")


class FakeComm(Comm):
    """Rank `rank` of a `world_size` group, for sharding math only (no collective is run)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.group = None
        self.rank = rank
        self.world_size = world_size


def save_tiny(path: Path, vocab: int = 128, max_shard_size: str | None = None,
              **kw: object) -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, bos_token_id=1,
        eos_token_id=[2, 3], **kw)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1.0: make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("tiny")
    return path, save_tiny(path)


@pytest.fixture
def copy(tiny: tuple[Path, dict], tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny[0], tmp_path / "ckpt"))


def hf_view(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our state dict under HF names: merged q|k|v and gate|up split back into their parts."""
    out = {}
    for name, t in model.state_dict().items():
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        sizes = getattr(owner, "local_sizes", None)
        if sizes is None:
            out[name] = t
            continue
        merged = name.split(".")[-2]
        hf_names = sorted((part, hf) for hf, (m, part) in STACKED.items() if m == merged)
        for (_, hf), piece in zip(hf_names, t.split(sizes), strict=True):
            out[name.replace(merged, hf)] = piece
    return out


def assert_same_weights(model: torch.nn.Module, hf: dict[str, torch.Tensor]) -> None:
    ours = hf_view(model)
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    assert set(ours) == set(hf)
    for name, t in hf.items():
        assert torch.equal(ours[name], t), name


def test_config_from_pretrained(tiny: tuple[Path, dict]) -> None:
    cfg = ModelConfig.from_pretrained(str(tiny[0]))
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "LlamaForCausalLM", 128, 32, 64)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 8)
    assert cfg.rope_theta == 500000.0 and cfg.eos_token_ids == (2, 3)
    assert cfg.bos_token_id == 1 and not cfg.tie_word_embeddings and not cfg.attention_bias


def test_load_matches_hf_state_dict(tiny: tuple[Path, dict]) -> None:
    model = build_model(ModelConfig.from_pretrained(str(tiny[0])), Comm(), torch.float32, CPU)
    assert_same_weights(model, tiny[1])


def test_sharded_index_checkpoint(tiny: tuple[Path, dict], tmp_path: Path) -> None:
    hf = save_tiny(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = build_model(ModelConfig.from_pretrained(str(tmp_path)), Comm(), torch.float32, CPU)
    assert_same_weights(model, hf)
    for name, t in hf.items():  # same random weights as the single-file checkpoint
        assert torch.equal(t, tiny[1][name])


def test_missing_model_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        ModelConfig.from_pretrained(str(missing))


def test_no_config_json(copy: Path) -> None:
    (copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(str(copy))


def test_unknown_architecture(copy: Path) -> None:
    hf = json.loads((copy / "config.json").read_text())
    hf["architectures"] = ["GPT2LMHeadModel"]
    (copy / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel") as e:
        ModelConfig.from_pretrained(str(copy))
    assert "LlamaForCausalLM" in str(e.value) and "Qwen2ForCausalLM" in str(e.value)


def rewrite(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    for name, t in edit.items():
        if t is None:
            del tensors[name]
        else:
            tensors[name] = t
    save_file(tensors, str(file), metadata={"format": "pt"})


def load_into_fresh_model(path: Path, comm: Comm | None = None) -> LlamaForCausalLM:
    cfg = ModelConfig.from_pretrained(str(path))
    comm = comm or Comm()
    model = LlamaForCausalLM(cfg, comm)
    load_weights(model, str(path), comm)
    return model


def test_wrong_shape_names_the_tensor(copy: Path) -> None:
    rewrite(copy, {"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 32)})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_into_fresh_model(copy)


def test_missing_tensor(copy: Path) -> None:
    rewrite(copy, {"model.layers.0.mlp.up_proj.weight": None})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_into_fresh_model(copy)


def test_unexpected_tensor(copy: Path) -> None:
    rewrite(copy, {"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="extra"):
        load_into_fresh_model(copy)


def test_index_listing_a_missing_shard(tmp_path: Path) -> None:
    save_tiny(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_into_fresh_model(tmp_path)


def test_tied_embeddings(tmp_path: Path) -> None:
    hf = save_tiny(tmp_path, tie_word_embeddings=True)
    model = build_model(ModelConfig.from_pretrained(str(tmp_path)), Comm(), torch.float32, CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, hf["model.embed_tokens.weight"])


def test_no_safetensors_files(copy: Path) -> None:
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_into_fresh_model(copy)


def test_column_row_vocab_shards() -> None:
    full = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    for rank in (0, 1):
        comm = FakeComm(rank, 2)
        col = ColumnParallelLinear(32, 64, comm, bias=True)
        load_shard(col.weight, full, col.shard_dim, comm)
        load_shard(col.bias, full[:, 0], 0, comm)
        assert torch.equal(col.weight, full[rank * 32 : (rank + 1) * 32])
        assert torch.equal(col.bias, full[rank * 32 : (rank + 1) * 32, 0])
        row = RowParallelLinear(64, 32, comm)
        load_shard(row.weight, full.T, row.shard_dim, comm)
        assert torch.equal(row.weight, full.T[:, rank * 32 : (rank + 1) * 32])
    emb = torch.randn(127, 8)
    parts = []
    for rank in (0, 1):
        comm = FakeComm(rank, 2)
        layer = VocabParallelEmbedding(127, 8, comm)
        assert layer.weight.shape == (64, 8) and layer.start == 64 * rank
        layer.weight.data.fill_(float("nan"))  # padding must be written, not left stale
        load_shard(layer.weight, emb, layer.shard_dim, comm)
        parts.append(layer.weight.detach())
    assert torch.equal(parts[0], emb[:64]) and torch.equal(parts[1][:63], emb[64:])
    assert torch.equal(parts[1][63], torch.zeros(8))


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_model_loads_its_slices(tmp_path: Path, rank: int) -> None:
    hf = save_tiny(tmp_path, vocab=127)
    model = load_into_fresh_model(tmp_path, FakeComm(rank, 2))
    ours = hf_view(model)
    r = slice(rank * 16, (rank + 1) * 16)  # q: 4 heads * 8 -> 16 rows per rank
    kv = slice(rank * 8, (rank + 1) * 8)  # k/v: 2 heads * 8 -> 8 rows per rank
    mlp = slice(rank * 32, (rank + 1) * 32)
    shards = {"self_attn.q_proj": (0, r), "self_attn.k_proj": (0, kv),
              "self_attn.v_proj": (0, kv), "self_attn.o_proj": (1, r),
              "mlp.gate_proj": (0, mlp), "mlp.up_proj": (0, mlp), "mlp.down_proj": (1, mlp)}
    for i in range(2):
        for n, (dim, sl) in shards.items():
            name = f"model.layers.{i}.{n}.weight"
            want = hf[name][sl] if dim == 0 else hf[name][:, sl]
            assert torch.equal(ours[name], want), name
        for n in ("input_layernorm", "post_attention_layernorm"):
            name = f"model.layers.{i}.{n}.weight"
            assert torch.equal(ours[name], hf[name]), name
    assert torch.equal(ours["model.norm.weight"], hf["model.norm.weight"])
    assert set(ours) == set(hf)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        got, want = ours[name], hf[name][rank * 64 : rank * 64 + 64]
        assert got.shape == (64, 32) and torch.equal(got[: len(want)], want)
        assert torch.equal(got[len(want) :], torch.zeros(64 - len(want), 32))
