"""One frozen config per concern, built once and passed down whole.

ModelConfig is read from the checkpoint's config.json; the rest come from the CLI or a
TOML file and are validated in `__post_init__`. Every section lives in this one file (over
500 lines) so that docs/configuration.md and the TOML checks read one place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import msgspec

from raygraph.adapter_files import LORA_MODULES, adapter_targets
from raygraph.generation import eos_token_ids
from raygraph.quantization import ONLINE, QuantConfig, QuantError, read_quant_config

DEFAULT_MODEL = str(Path(__file__).parent / "assets" / "default_model")

# RoPE variants model/rope.py computes (as transformers does)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# HF architecture name -> our model family. Qwen2 differs from Llama only in qkv bias, Qwen3
# in its per-head q/k norms (ModelConfig.attention_bias, .qk_norm).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # an EAGLE-3 draft head (speculative method "eagle3"): never served as a model itself
    "LlamaForCausalLMEagle3": "eagle3",
}
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

# config.json fields that change the math, with the values raygraph computes: any other value
# is refused by name rather than ignored. An absent (or null) field takes HF's default, which
# raygraph computes. Per architecture on top: Llama and Qwen3 bias o_proj too when
# attention_bias is set. (The attention window fields: `_sliding_window`.)
MATH_FIELDS: dict[str, tuple[object, ...]] = {
    "hidden_act": ("silu", "swish"),
    "mlp_bias": (False,),
    "partial_rotary_factor": (1.0,),  # also read from rope_parameters
    "qk_layernorm": (False,),  # q/k norms of other families; Qwen3's come with the arch
    "use_qk_norm": (False,),
}
ARCH_MATH_FIELDS: dict[str, dict[str, tuple[object, ...]]] = {
    arch: {"attention_bias": (False,)}
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
}


class ConfigError(ValueError):
    """A configuration that cannot work, with the reason in the message."""


class ModelConfig(msgspec.Struct, frozen=True):
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    # rope_type ("default", "linear", "dynamic", "llama3", "yarn") and its parameters, as the
    # checkpoint's rope_parameters / rope_scaling give them (model/rope.py computes them)
    rope_scaling: dict[str, str | float | int | bool | None] = {}
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False  # bias on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3)
    sliding_window: int = 0  # > 0: each query sees its last this many keys (Mistral); 0: all
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "float32"
    # sparse MoE (num_experts 0: dense). Layer i is sparse unless it is in mlp_only_layers
    # or (i + 1) % decoder_sparse_step != 0 (Qwen2-MoE's rules; Mixtral: every layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # FP8 linear layers: the checkpoint's quantization_config, or quantized at load
    # (ServeConfig.quantization); None: the weights run in the model's dtype
    quant: QuantConfig | None = None
    # an EAGLE-3 head: the vocabulary it proposes from (d2t maps it into the target's), and
    # the target layers whose input it reads (empty: the target's 2, L / 2 and L - 3)
    draft_vocab_size: int = 0
    aux_layers: tuple[int, ...] = ()
    norm_before_residual: bool = False  # the head's residual is its normed hidden state

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one TP rank holds: its share, or one replicated head when TP exceeds the
        KV heads (each rank keeps the head its query heads read, as vLLM does)."""
        return max(1, self.num_kv_heads // tp)

    def is_sparse_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @staticmethod
    def from_pretrained(path: str) -> ModelConfig:
        """Read an HF config.json; unknown architectures and missing files are clear errors."""
        cfg_file = Path(path) / "config.json"
        if not Path(path).is_dir():
            raise FileNotFoundError(f"model path {path!r} is not a directory")
        if not cfg_file.is_file():
            raise FileNotFoundError(f"model path {path!r} has no config.json")
        try:
            hf = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from None
        try:
            return ModelConfig._from_hf(str(path), cfg_file, hf)
        except ConfigError:
            raise
        except KeyError as e:
            raise ConfigError(f"{cfg_file} lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type
            raise ConfigError(f"{cfg_file}: {type(e).__name__}: {e}") from None

    @staticmethod
    def _from_hf(path: str, cfg_file: Path, hf: dict) -> ModelConfig:
        if hf.get("speculators_model_type") == "eagle3":  # the `speculators` layout of a head
            hf = _speculators_eagle3(hf)
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs} in {cfg_file}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers 5 writes rope_parameters; 4.x wrote rope_theta and rope_scaling
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        if rope["rope_type"] not in ROPE_TYPES:
            raise ConfigError(f"rope type {rope['rope_type']!r} in {cfg_file} is not supported; "
                              f"supported: {list(ROPE_TYPES)}")
        _check_math_fields(arch, hf, rope, cfg_file)
        rope_theta = hf.get("rope_theta") or rope.pop("rope_theta", None)
        num_heads = hf["num_attention_heads"]
        # Qwen3Config's head_dim defaults to 128, the others' to hidden / heads
        head_dim = hf.get("head_dim") or (
            128 if arch == "Qwen3ForCausalLM" else hf["hidden_size"] // num_heads)
        try:
            quant = read_quant_config(path, hf, cfg_file)
        except QuantError as e:
            raise ConfigError(str(e)) from None
        if quant is not None and SUPPORTED_ARCHITECTURES[arch] != "llama":
            raise ConfigError(f"FP8 checkpoints of MoE models ({arch}) are not supported yet: "
                              "the experts are not quantized")
        return ModelConfig(
            path=str(path),
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            # Qwen2 always biases q/k/v, Qwen2-MoE by qkv_bias; the rest refuse or ignore it
            attention_bias=arch == "Qwen2ForCausalLM"
            or (arch == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True))),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            sliding_window=_sliding_window(arch, hf, cfg_file),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            # config.json's, generation_config.json's and the tokenizer's: each one stops
            eos_token_ids=eos_token_ids(path, hf.get("eos_token_id")),
            checkpoint_dtype=_torch_dtype(hf),
            quant=quant,
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"]
            if arch == "LlamaForCausalLMEagle3" else 0,
            aux_layers=tuple((hf.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids") or ()),
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            **_moe_fields(hf, arch),
        )


def _speculators_eagle3(hf: dict) -> dict:
    """A `speculators` EAGLE-3 config.json as the EAGLE authors' fields: its transformer
    layer's config, the draft vocabulary, the target layers read, and the residual taken
    after the hidden state's norm (that layout's default)."""
    out = dict(hf["transformer_layer_config"])
    out.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               draft_vocab_size=hf.get("draft_vocab_size"),
               norm_before_residual=hf.get("norm_before_residual", True))
    if hf.get("eagle_aux_hidden_state_layer_ids"):
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids":
                               hf["eagle_aux_hidden_state_layer_ids"]}
    return out


def _torch_dtype(hf: dict) -> str:
    """The dtype config.json says the weights were saved in (transformers 5 writes `dtype`)."""
    return str(hf.get("torch_dtype") or hf.get("dtype") or "float32").removeprefix("torch.")


def auto_dtype(device: str, checkpoint: str) -> str:
    """What `--dtype auto` runs weights in. On cuda a half-precision checkpoint keeps its own
    dtype (float16 weights cast to bfloat16 would lose 3 mantissa bits; bfloat16 ones cast to
    float16 could overflow) and anything else runs in bfloat16; the cpu runs float32."""
    if device != "cuda":
        return "float32"
    return checkpoint if checkpoint in ("float16", "bfloat16") else "bfloat16"


def _check_math_fields(arch: str, hf: dict, rope: dict, cfg_file: Path) -> None:
    """Refuse, by name, a field of config.json whose value raygraph would not compute."""
    fields = {**MATH_FIELDS, **ARCH_MATH_FIELDS.get(arch, {})}
    for name, accepted in fields.items():
        value = hf[name] if hf.get(name) is not None else rope.get(name)
        if value is not None and value not in accepted:
            raise ConfigError(f"{name}={value!r} in {cfg_file} is not supported for {arch}; "
                              f"supported: {list(accepted)}")


def _sliding_window(arch: str, hf: dict, cfg_file: Path) -> int:
    """The attention window of every layer (0: none), as transformers applies it: Mistral
    and Mixtral by `sliding_window`; the Qwen families only with `use_sliding_window`, per
    layer (refused: one window for all layers is what the kernels take)."""
    kinds = set(hf.get("layer_types") or ())
    if "sliding_attention" in kinds and kinds != {"sliding_attention"}:
        raise ConfigError(f"layer_types in {cfg_file} mixes sliding-window and full attention "
                          "layers; not supported")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return int(hf.get("sliding_window") or 0)
    if hf.get("use_sliding_window"):
        raise ConfigError(f"use_sliding_window=true in {cfg_file} is not supported for {arch} "
                          "(windows per layer)")
    return 0


def _moe_fields(hf: dict, arch: str) -> dict:
    """The MoE fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json (nothing for dense
    models). transformers 5 saves Qwen3-MoE's num_experts as num_local_experts."""
    if arch == "MixtralForCausalLM":  # every layer sparse, experts as wide as the dense MLP
        return dict(num_experts=hf["num_local_experts"],
                    num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):  # Qwen3-MoE: no shared expert
        shared = arch == "Qwen2MoeForCausalLM" and hf.get("shared_expert_intermediate_size")
        return dict(
            num_experts=hf.get("num_experts") or hf["num_local_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            shared_expert_intermediate_size=shared or 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
    return {}


def check_ep(model: ModelConfig, ep: int, tp: int = 1) -> None:
    """MoE layouts that cannot work are refused up front: with ep > 1 each EP rank owns
    num_experts / ep whole experts; with ep == 1 every expert is split over the TP group."""
    if ep > 1 and model.num_experts == 0:
        raise ConfigError(f"ep={ep} needs an MoE model; {model.architecture} is dense")
    if model.num_experts % ep:
        raise ConfigError(f"ep={ep} must divide num_experts={model.num_experts}")
    if ep == 1 and model.moe_intermediate_size % tp:
        raise ConfigError(
            f"tp={tp} must divide moe_intermediate_size={model.moe_intermediate_size}")
    if model.shared_expert_intermediate_size % tp:
        raise ConfigError(f"tp={tp} must divide shared_expert_intermediate_size="
                          f"{model.shared_expert_intermediate_size}")


class ParallelConfig(msgspec.Struct, frozen=True):
    """World = tp x dp ranks. World rank r is TP rank r % tp of DP group r // tp: each DP
    group runs its own batch through attention (TP inside the group). MoE experts are
    either TP-split inside each group (ep = 1) or spread over every rank (ep = tp x dp),
    with tokens dispatched across DP groups at a shared size (num_comm_tokens)."""

    tp: int = 1  # tensor-parallel ranks in a DP group
    dp: int = 1  # attention data-parallel groups (MoE models)
    ep: int = 1  # expert-parallel ranks: 1 (experts TP-split) or tp * dp

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ep not in (1, self.world_size):
            raise ConfigError(f"ep={self.ep} must be 1 or span every rank (tp*dp = "
                              f"{self.world_size}): experts are spread over the whole world")
        if self.dp > 1 and self.ep == 1:
            raise ConfigError(f"dp={self.dp} needs ep = tp*dp = {self.world_size}: attention "
                              "data parallelism is for MoE expert parallelism; for a dense "
                              "model run separate replicas")

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def check_model(self, model: ModelConfig) -> None:
        """Shapes that cannot be split evenly over the TP group are refused up front."""
        kv = model.num_kv_heads
        if model.num_heads % self.tp or (kv % self.tp and self.tp % kv):
            raise ConfigError(
                f"tp={self.tp} must divide num_heads={model.num_heads}, and divide or be a "
                f"multiple of num_kv_heads={kv} (KV heads are then replicated)"
            )
        dense = any(not model.is_sparse_layer(i) for i in range(model.num_layers))
        if dense and model.intermediate_size % self.tp:
            raise ConfigError(
                f"tp={self.tp} must divide intermediate_size={model.intermediate_size}"
            )
        check_ep(model, self.ep, self.tp)
        if model.quant is not None and model.quant.block is not None:
            cols = model.quant.block[1]
            for name, n in (("num_heads * head_dim", model.num_heads * model.head_dim),
                            ("intermediate_size", model.intermediate_size)):
                if self.tp > 1 and (n // self.tp) % cols:
                    raise ConfigError(f"tp={self.tp} splits {name}={n} into {n // self.tp} "
                                      f"columns a rank, not a multiple of the FP8 weight "
                                      f"blocks' {cols}")


class CacheConfig(msgspec.Struct, frozen=True):
    """KV cache sizing: an explicit block count, a byte budget, or a GPU memory fraction.

    high_watermark / low_watermark: fractions of the page pool in use (pinned or cached).
    Once use passes high_watermark, cached pages are evicted (LRU) until it is back at
    low_watermark: evictions come in batches, not one page per allocation, and some pages
    stay free. 1.0 / 1.0 evicts only on demand (with prefix caching off nothing is cached,
    and the watermarks do nothing)."""

    block_size: int = 16  # tokens per KV block (page)
    # auto: the weights' dtype; fp8: FP8 e4m3 (per-tensor scales from the checkpoint, else
    # 1.0; saturating at +-448), half the bytes a token, so twice the tokens fit; the
    # attention kernels read it back in the weights' dtype
    cache_dtype: Literal["auto", "fp8"] = "auto"
    num_blocks: int | None = None  # KV blocks per rank; None: sized from memory
    kv_cache_bytes: int | None = None  # KV bytes per rank; None: gpu_memory_utilization
    gpu_memory_utilization: float = 0.85  # share of the GPU the worker may fill, KV included
    cpu_kv_cache_bytes: int = 64 << 20  # KV bytes per rank on CPU
    high_watermark: float = 0.95  # pool use past which cached pages are evicted
    low_watermark: float = 0.90  # pool use eviction brings it back to
    # full KV blocks stay cached by content (a hash chain of their tokens) after their
    # sequence ends; a request whose prompt starts with cached blocks computes only the rest
    enable_prefix_caching: bool = True
    # after sleep, wake maps the first blocks (about wake_first_bytes of KV per rank, plus
    # up to a chunk per K/V tensor) and serves at once; the rest map in the background and
    # the scheduler gains them as they come. False: wake maps the whole cache first
    staged_wake: bool = True
    wake_first_bytes: int = 2 << 30  # KV bytes a staged wake maps before serving

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.cache_dtype not in ("auto", "fp8"):  # keywords are not type-checked
            raise ConfigError(f"cache_dtype must be 'auto' or 'fp8', got {self.cache_dtype!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.wake_first_bytes < 1:
            raise ConfigError(f"wake_first_bytes must be >= 1, got {self.wake_first_bytes}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError(
                "watermarks must satisfy 0 < low_watermark <= high_watermark <= 1, got "
                f"low {self.low_watermark}, high {self.high_watermark}"
            )


MAX_SEQS = 2**16  # running sequences a replica may be asked to hold at most


class SchedulerConfig(msgspec.Struct, frozen=True):
    """Continuous batching: how many sequences run, and a step's token budget."""

    max_num_seqs: int = 64  # running sequences at most (the largest decode batch)
    max_num_batched_tokens: int = 512  # tokens a step computes at most (chunked prefill)
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        seqs, tokens = self.max_num_seqs, self.max_num_batched_tokens
        if not (1 <= seqs <= MAX_SEQS and 1 <= tokens <= 2**31 - 1):
            raise ConfigError(f"max_num_seqs must be in [1, {MAX_SEQS}] and "
                              "max_num_batched_tokens in [1, 2**31 - 1], got "
                              f"{seqs} and {tokens}")
        if self.max_model_len is not None and not 1 <= self.max_model_len <= 2**31 - 1:
            raise ConfigError(f"max_model_len must be >= 1 (or unset: the model's), got "
                              f"{self.max_model_len}")


class GraphConfig(msgspec.Struct, frozen=True):
    """How steps run: mode `graph` replays bucketed graphs (decode: full; prefill: full or
    piecewise, `prefill_graph`), eager above the largest bucket; `eager` is the reference
    path only. backend `eager` runs the graph executor's logic without capture (what CPUs
    always do).

    prefill_graph: how a prefill bucket is captured. `piecewise`: graphs between the
    attention calls, attention run eagerly in between; `full`: one graph, attention (the
    Triton prefill kernel, whose launch depends only on the bucket) inside it.

    pool: where captured graphs keep their memory. `vmm`: a virtual range per capture over
    one set of physical chunks (max over captures, budgeted before the KV cache is sized,
    can sleep); `torch`: torch's one shared graph pool; `private`: a torch pool per capture
    (the baseline: sum over captures)."""

    mode: Literal["graph", "eager"] = "graph"  # eager: no graphs (the reference path)
    backend: Literal["auto", "eager"] = "auto"  # eager: the graph logic without capture
    decode_sizes: list[int] | None = None  # None: the default schedule up to max_decode
    prefill_sizes: list[int] | None = None  # None: the default schedule up to max_prefill
    max_decode: int = 256  # the largest decode bucket (rows: a sequence's, and its drafts')
    max_prefill: int = 2048  # the largest prefill bucket (tokens)
    prefill_graph: Literal["piecewise", "full"] = "full"  # measured faster: bench/RESULTS.md
    # decode batches of 8+ sequences that all start with the same cached blocks (a shared
    # system prompt under prefix caching, 256+ keys) attend over them once for the batch (the
    # decode kernel's cascade, model/triton_attention.py). Decode buckets of 8+ are captured
    # twice, with and without it, and a step takes the cascade graph only when its batch
    # shares such a prefix, so other steps launch none of its kernels; the cost is a second
    # capture per bucket (bench/RESULTS.md)
    decode_cascade: bool = True
    # when the capture schedule runs: `background` serves at once (steps of keys not yet
    # captured run eagerly) and captures between steps, busiest shapes first
    # (engine/capture.py); `at_start` before serving; `lazy` a key when a step first needs
    # it (that step waits); `auto`: background on cuda, lazy on cpu (where a capture
    # records no graph: warming every bucket up front would only compete with requests)
    capture: Literal["auto", "background", "at_start", "lazy"] = "auto"
    # background, under load: the share of the step thread's time captures may take (the
    # steps keep the rest)
    capture_share: float = 0.3
    capture_timeout_s: float = 600.0  # per key and phase; a rank slower than this has failed
    pool: Literal["vmm", "torch", "private"] = "vmm"  # where graphs keep their memory
    vmm_chunk_bytes: int = 2 << 20  # rounded up to the driver's granularity
    # the VMM budget is the largest buckets' capture times (1 + this): a smaller bucket can
    # need more (the caching allocator rounds 1-10 MiB blocks up to 20 MiB segments), and
    # run-time keys are not measured at all. A fraction of a few hundred MiB, not of the cache.
    vmm_headroom: float = 0.25

    def __post_init__(self) -> None:
        for sizes in (self.decode_sizes, self.prefill_sizes):
            if sizes is not None and (not sizes or min(sizes) < 1):
                raise ConfigError(f"capture sizes must be positive integers, got {sizes}")
        if self.vmm_chunk_bytes < 1:
            raise ConfigError(f"vmm_chunk_bytes must be >= 1, got {self.vmm_chunk_bytes}")
        if self.vmm_headroom < 0:
            raise ConfigError(f"vmm_headroom must be >= 0, got {self.vmm_headroom}")
        if not 0 < self.capture_share <= 1:
            raise ConfigError(f"capture_share must be in (0, 1], got {self.capture_share}")


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'1073741824', '1.5GiB', '800MB' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in BYTE_UNITS or not num:
        raise ConfigError(f"cannot read {text!r} as a size (e.g. 2147483648, 1.5GiB, 800MB)")
    return int(float(num) * BYTE_UNITS[unit])


class OffloadConfig(msgspec.Struct, frozen=True):
    """Weights in host memory, at most `budget_bytes` of weights on the GPU (None: off).

    mode `ring`: fixed addresses, the forward and its copies captured in graphs; `lru`: a
    capped pool with LRU eviction and prefetch (eager only); `sync`: copy each weight right
    before its kernel (the baseline). check_floor=False is for tests and the floor sweep.
    """

    budget_bytes: int | None = None  # weight bytes on the GPU at most; None: no offload
    mode: Literal["ring", "lru", "sync"] = "ring"  # how weights reach the GPU
    check_floor: bool = True  # refuse a budget below what one layer needs

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise ConfigError(f"offload budget must be >= 1 byte, got {self.budget_bytes}")


class LoRAConfig(msgspec.Struct, frozen=True):
    """Multi-LoRA: `max_loras` adapter slots on every rank, each holding one adapter of rank
    <= max_lora_rank; a step mixes tokens of any slots and of the base model. 0 slots: off
    (no buffers, no kernels: the graphs of the plain model)."""

    max_loras: int = 0  # adapter slots on every rank (hot adapters); 0: LoRA off
    max_lora_rank: int = 64  # the largest adapter rank served
    # adapters registered at start: (name, PEFT directory) pairs
    modules: tuple[tuple[str, str], ...] = ()
    # each worker keeps recently loaded adapters in (pinned) host memory up to this many
    # bytes: the warm tier, from which a promotion is a host-to-device copy
    warm_budget_bytes: int = 1 << 30
    # the HF modules (LORA_MODULES) adapters may target: only their projections get slots
    # and kernels. Empty: inferred at `resolved` from the adapters in `modules` (all seven
    # when there are none)
    target_modules: tuple[str, ...] = ()
    # adapters loaded at run time must lie under one of these directories (none: run-time
    # loading is refused); `modules` named at start are the operator's and are not limited
    allowed_dirs: tuple[str, ...] = ()
    max_adapters: int = 64  # registered adapters at most (hot, warm and cold together)

    def __post_init__(self) -> None:
        if self.max_adapters < 1:
            raise ConfigError(f"max_adapters must be >= 1, got {self.max_adapters}")
        unknown = [m for m in self.target_modules if m not in LORA_MODULES]
        if unknown:
            raise ConfigError(f"unknown LoRA target modules {unknown}; supported: "
                              f"{list(LORA_MODULES)}")
        if self.modules and not self.max_loras:
            raise ConfigError("LoRA modules need max_loras >= 1")
        if self.warm_budget_bytes < 0:
            raise ConfigError(f"warm_budget_bytes must be >= 0, got {self.warm_budget_bytes}")
        if self.max_loras < 0:
            raise ConfigError(f"max_loras must be >= 0, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ConfigError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    @property
    def padded_rank(self) -> int:
        """The slots' rank dimension: max_lora_rank rounded up to 16 (tensor-core tiles)."""
        return -(-self.max_lora_rank // 16) * 16

    @property
    def targets(self) -> tuple[str, ...]:
        """The modules served: `target_modules`, or all seven when none are set."""
        return self.target_modules or LORA_MODULES

    def resolved(self) -> LoRAConfig:
        """`target_modules` pinned: when empty, the union of what the adapters in `modules`
        target, read from their adapter_config.json (as SGLang infers them), so slots and
        kernels cover only those projections. LoRAError for an adapter that cannot be read."""
        if self.target_modules or not self.modules:
            return self
        found = set().union(*(adapter_targets(p) for p in {p for _, p in self.modules}))
        return msgspec.structs.replace(
            self, target_modules=tuple(m for m in LORA_MODULES if m in found))


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding (vLLM's --speculative-config). method "ngram": prompt lookup
    proposes up to `num_speculative_tokens` drafts a step from the sequence's own tokens
    (engine/ngram.py); method "draft": a small model of the target's tokenizer (`model`, a
    checkpoint directory) proposes them greedily on the workers (worker/drafter.py); method
    "eagle3": an EAGLE-3 head (`model`) over the target's hidden states does (model/eagle3.py).
    The target verifies them in one step and keeps the ones its greedy argmax agrees with (a
    sampled request: rejection sampling, so its tokens follow the target's distribution).
    Constrained and logprob requests decode as usual; a
    speculating sequence runs in every other step of the overlapped
    loop (its drafts need its last token), so one whose proposals rarely hold (or that
    finds none) stops speculating and decodes as usual."""

    method: Literal["", "ngram", "draft", "eagle3"] = ""  # "": off
    model: str = ""  # method "draft" or "eagle3": the draft model's or head's directory
    num_speculative_tokens: int = 4  # drafts a step at most (k)
    prompt_lookup_min: int = 1  # the shortest n-gram matched
    prompt_lookup_max: int = 4  # the longest (tried first)
    # no drafts in a step with this many running sequences or more (0: any batch): there a
    # step's time grows with its tokens, and a verifying sequence gives up the overlap
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.method not in ("", "ngram", "draft", "eagle3"):
            raise ConfigError(f"speculative method must be 'ngram', 'draft' or 'eagle3', got "
                              f"{self.method!r}")
        if (self.method in ("draft", "eagle3")) != bool(self.model):
            raise ConfigError("a speculative 'model' goes with methods 'draft' and 'eagle3' "
                              f"and only with them, got method {self.method!r} and model "
                              f"{self.model!r}")
        if self.num_speculative_tokens < 1:
            raise ConfigError("num_speculative_tokens must be >= 1, got "
                              f"{self.num_speculative_tokens}")
        if self.disable_by_batch_size < 0:
            raise ConfigError("disable_by_batch_size must be >= 0, got "
                              f"{self.disable_by_batch_size}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")


class ReplicaConfig(msgspec.Struct, frozen=True):
    """Scale-out: engines (replicas) of the model, each one TP group (or one MoE DP x EP
    group) packed on one node with its own KV cache and graphs, behind one coordinator."""

    replicas: int = 1  # engines; each fails and restarts alone
    # spread: each replica on the node holding the fewest (a hint; Ray places it where the
    # resources are); pack: wherever Ray puts it
    placement: Literal["spread", "pack"] = "spread"
    # cache: the replica that served the longest prefix of the prompt, unless it is loaded
    # past max_imbalance; load: the less loaded of two picked at random; round-robin
    routing: Literal["cache", "load", "round-robin"] = "cache"
    # cache routing keeps a prompt on its prefix's replica unless that replica has both
    # max_imbalance times the least loaded one's outstanding tokens and balance_tokens more
    max_imbalance: float = 1.5
    # ... and more than this many outstanding tokens above the least loaded replica
    balance_tokens: int = 32768
    # cache routing moves a prefix to the replica routed the least when its home was routed
    # this fraction of the mean more (over the last few hundred requests) and the move
    # narrows the gap: homes are rebalanced by traffic, one recomputed prefix at a time
    rebalance_gap: float = 0.1
    # prompt prefixes remembered per router for cache routing (an LRU of block hashes)
    max_prefixes: int = 65536
    # replicas kept awake (None: all). Replicas past them are elastic: a router sends them
    # requests only while every awake one has max_num_seqs of its requests outstanding
    min_replicas: int | None = None
    # an elastic replica with no request for this long sleeps, and wakes on its next one
    idle_sleep_s: float = 30.0
    # the level an idle replica sleeps at (1: graph pool and KV cache; 2: the weights too)
    idle_sleep_level: Literal[1, 2] = 1
    # autoscaling (None: off): while every serving replica has requests waiting or its KV
    # cache nearly full for upscale_delay_s, another starts, up to this many. Replicas
    # past min_replicas (None: the starting count) are elastic: idle, they sleep
    max_replicas: int | None = None
    # how long every serving replica must stay saturated before the autoscaler adds one
    upscale_delay_s: float = 10.0

    @property
    def awake(self) -> int:
        """Replicas [0, awake) never sleep when idle; the rest are elastic."""
        return self.replicas if self.min_replicas is None else self.min_replicas

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.max_imbalance < 1:
            raise ConfigError(f"max_imbalance must be >= 1, got {self.max_imbalance}")
        if self.max_prefixes < 1:
            raise ConfigError(f"max_prefixes must be >= 1, got {self.max_prefixes}")
        if self.balance_tokens < 0:
            raise ConfigError(f"balance_tokens must be >= 0, got {self.balance_tokens}")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.replicas:
            raise ConfigError(f"min_replicas must be between 0 and replicas "
                              f"({self.replicas}), got {self.min_replicas}")
        if self.idle_sleep_s <= 0:
            raise ConfigError(f"idle_sleep_s must be > 0, got {self.idle_sleep_s}")
        if self.rebalance_gap <= 0:
            raise ConfigError(f"rebalance_gap must be > 0, got {self.rebalance_gap}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ConfigError(f"max_replicas must be >= replicas ({self.replicas}), "
                              f"got {self.max_replicas}")
        if self.upscale_delay_s < 0:
            raise ConfigError(f"upscale_delay_s must be >= 0, got {self.upscale_delay_s}")

    def pinned(self) -> ReplicaConfig:
        """With autoscaling, min_replicas defaults to the starting count: replicas the
        autoscaler adds are elastic for every router and engine."""
        if self.max_replicas is None or self.min_replicas is not None:
            return self
        return msgspec.structs.replace(self, min_replicas=self.replicas)


# ServeConfig fields that resolved() fills in: no file or flag sets them
DERIVED = ("model_config",)


class ServeConfig(msgspec.Struct, frozen=True):
    """Everything `raygraph serve` serves with, one section per concern."""

    model: str = DEFAULT_MODEL  # a checkpoint directory (the CLI also takes a hub id)
    # the tokenizer's directory ("": the checkpoint's own); for a checkpoint without one
    tokenizer: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda with a GPU per rank
    # auto: on cuda a float16 or bfloat16 checkpoint's own torch_dtype, else bfloat16;
    # float32 on cpu
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # auto: the checkpoint's *.safetensors; dummy: random weights drawn on the device from
    # config.json's shapes alone (no weights on disk), to time a model's shapes
    load_format: Literal["auto", "dummy"] = "auto"
    # auto: as the checkpoint is stored (an FP8 checkpoint runs its linear layers in FP8);
    # fp8: a bf16/fp16/fp32 checkpoint's linear layers quantized to FP8 e4m3 at load (one
    # scale per output channel, activations quantized per token past 16 rows), halving their memory
    quantization: Literal["auto", "fp8"] = "auto"
    seed: int = 0  # the workers' sampling generator (a request's own seed overrides it)
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    graph: GraphConfig = GraphConfig()
    offload: OffloadConfig = OffloadConfig()
    lora: LoRAConfig = LoRAConfig()
    replica: ReplicaConfig = ReplicaConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    coordinator_name: str = "raygraph-coordinator"  # the named Ray actor clients find
    namespace: str = "raygraph"  # its Ray namespace
    # a step (or worker call) not answered in this long fails the group, which restarts
    step_timeout_s: float = 300.0
    # derived, never given: config.json as resolved() read it, for every process after it
    model_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):  # keywords are not type-checked
            raise ConfigError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization not in ("auto", "fp8"):
            raise ConfigError(f"quantization must be 'auto' or 'fp8', got {self.quantization!r}")
        if self.lora.enabled and self.offload.budget_bytes is not None:
            raise ConfigError("LoRA adapters (lora.max_loras > 0) and weight offload "
                              "(offload.budget_bytes) cannot be combined")
        if self.speculative.model and self.offload.budget_bytes is not None:
            raise ConfigError(f"a speculative {self.speculative.method} model and weight "
                              "offload (offload.budget_bytes) cannot be combined yet")

    @property
    def uses_graphs(self) -> bool:
        """Graph mode, unless offloaded weights move between steps (lru: eager only). The
        coordinator keys steps and captures by this, the workers build their executor by it."""
        lru = self.offload.budget_bytes is not None and self.offload.mode == "lru"
        return self.graph.mode == "graph" and not lru

    def max_model_len(self, model: ModelConfig, num_blocks: int | None = None) -> int:
        """The context a sequence may reach: the configured limit, the model's positions
        and, once the KV cache is sized, what its blocks hold. The one place it is derived."""
        limit = self.scheduler.max_model_len or model.max_position_embeddings
        cap = model.max_position_embeddings
        if num_blocks is not None:
            cap = min(cap, num_blocks * self.cache.block_size)
        return min(limit, cap)

    def executor_graph(self) -> GraphConfig:
        """The GraphConfig the executor is built from (eager whenever graphs are not used)."""
        return self.graph if self.uses_graphs else msgspec.structs.replace(self.graph, mode="eager")

    def model_cfg(self) -> ModelConfig:
        """The model's config.json: read once by resolved() and carried from then on (a
        config not resolved, as a test's own worker gets, reads it here), with `quantization`
        applied: the one place the model's FP8 layout is decided."""
        if self.model_config is not None:
            return self.model_config
        model = ModelConfig.from_pretrained(self.model)
        if model.family == "eagle3":
            raise ConfigError(f"{self.model!r} is an EAGLE-3 head: serve its target model, "
                              "with speculative method 'eagle3' and this as its model")
        quant = model.quant
        if quant is None and self.quantization == "fp8":
            if model.num_experts:
                raise ConfigError(f"quantization='fp8' is not supported for MoE models "
                                  f"({model.architecture}) yet: the experts are not quantized")
            quant = ONLINE
        if quant is not None and self.lora.enabled:
            raise ConfigError(f"FP8 weights ({quant.method}) cannot be combined with LoRA "
                              "adapters yet")
        return msgspec.structs.replace(model, quant=quant)

    def draft_cfg(self) -> ModelConfig | None:
        """The draft model's or EAGLE-3 head's config.json (speculative method "draft" or
        "eagle3"; None: neither), checked against the target's: it must share the
        vocabulary and hold the served context; a head must also fit the target's width
        and layers (its `aux_layers` resolved: the target's 2, L / 2 and L - 3 by default)."""
        spec = self.speculative
        if spec.method not in ("draft", "eagle3"):
            return None
        try:
            draft = ModelConfig.from_pretrained(spec.model)
        except FileNotFoundError as e:
            raise ConfigError(f"{spec.method} model: {e}") from None
        target, name = self.model_cfg(), f"{spec.method} model {spec.model!r}"
        if (draft.family == "eagle3") != (spec.method == "eagle3"):
            raise ConfigError(f"{name} is a {draft.architecture}: method 'eagle3' takes "
                              "EAGLE-3 heads, method 'draft' any other model")
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(f"{name} has a vocabulary of {draft.vocab_size}, the target "
                              f"{target.vocab_size}: a draft model must share the target's "
                              "tokenizer")
        if draft.max_position_embeddings < self.max_model_len(target):
            raise ConfigError(f"{name} holds {draft.max_position_embeddings} positions, the "
                              f"served context {self.max_model_len(target)}: set "
                              "scheduler.max_model_len to at most that")
        if spec.method == "draft":
            return draft
        layers = target.num_layers
        aux = draft.aux_layers or (2, layers // 2, layers - 3)
        if (target.family != "llama" or draft.hidden_size != target.hidden_size
                or draft.num_layers != 1 or len(aux) != 3
                or not 0 < draft.draft_vocab_size <= target.vocab_size
                or not all(0 <= i < layers for i in aux)):
            raise ConfigError(
                f"{name} ({draft.num_layers} layer(s) of {draft.hidden_size}, reading layers "
                f"{list(aux)}, drafting {draft.draft_vocab_size} tokens) does not fit the "
                f"target ({target.architecture}, {layers} layers of {target.hidden_size}, "
                f"{target.vocab_size} tokens): an EAGLE-3 head is one layer of the dense "
                "target's width over three of its layers, drafting from its vocabulary")
        return msgspec.structs.replace(draft, aux_layers=tuple(aux))

    def weights_dtype(self, device: str) -> str:
        """The dtype the weights run in on `device`: the one asked for, or for "auto"
        `auto_dtype` of the checkpoint's. The one place it is decided."""
        if self.dtype != "auto":
            return self.dtype
        if device != "cuda":
            return auto_dtype(device, "")
        return auto_dtype(device, self.model_cfg().checkpoint_dtype)

    def resolved(self, num_gpus: float) -> ServeConfig:
        """Pin 'auto' device, dtype and capture given the GPUs the cluster offers, the LoRA
        target modules (every worker builds the same layers from it) and the replicas kept
        awake."""
        device = self.device
        if device == "auto":
            device = "cuda" if num_gpus >= self.parallel.world_size else "cpu"
        graph = self.graph
        if graph.capture == "auto":
            graph = msgspec.structs.replace(
                graph, capture="background" if device == "cuda" else "lazy")
        cfg = msgspec.structs.replace(self, model_config=self.model_cfg())
        cfg.draft_cfg()  # a draft model that cannot draft for this one: refused here
        return msgspec.structs.replace(cfg, device=device, dtype=cfg.weights_dtype(device),
                                       graph=graph, lora=self.lora.resolved(),
                                       replica=self.replica.pinned())


def load_toml(path: str | os.PathLike[str]) -> ServeConfig:
    """A ServeConfig from a TOML file (same field names as the Structs). A key no Struct has
    is refused rather than ignored: a misspelled or misplaced setting would otherwise leave
    its default in force without a word."""
    try:
        table = msgspec.toml.decode(Path(path).read_bytes())
        _check_keys(table, ServeConfig)
        return msgspec.convert(table, ServeConfig)
    except OSError as e:
        raise ConfigError(f"cannot read the config file {str(path)!r}: {e.strerror}") from None
    except (msgspec.MsgspecError, ConfigError) as e:
        raise ConfigError(f"{path}: {e}") from None


def _sections(struct: type[msgspec.Struct]) -> dict[str, type[msgspec.Struct]]:
    """The fields of `struct` that are Structs themselves: its TOML tables."""
    return {f.encode_name: f.type for f in msgspec.structs.fields(struct)
            if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct)}


def _check_keys(table: object, struct: type[msgspec.Struct], where: str = "") -> None:
    """ConfigError naming the first key of `table` that `struct` has no field for, with the
    valid keys and, for a flat key that is a section's, the section it belongs in."""
    if not isinstance(table, dict):
        return  # not a table: msgspec.convert names the type it wanted
    sections = _sections(struct)
    keys = [f.encode_name for f in msgspec.structs.fields(struct)
            if f.encode_name not in sections and f.encode_name not in DERIVED]
    for key, value in table.items():
        if key in sections:
            _check_keys(value, sections[key], f"{where}{key}.")
            continue
        if key in keys:
            continue
        home = [name for name, sub in sections.items()
                if key in (f.encode_name for f in msgspec.structs.fields(sub))]
        hint = f" (it belongs in [{where}{home[0]}])" if home else ""
        place = f"in [{where[:-1]}]" if where else "at the top level"
        valid = ", ".join(keys) + "".join(f", [{where}{name}]" for name in sections)
        raise ConfigError(f"unknown key {key!r} {place}{hint}; valid: {valid}")
