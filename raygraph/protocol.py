"""Everything that crosses an actor boundary: msgspec Structs only."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

FinishReason = Literal["stop", "length", "abort", "error"]


# the sampling fields a request may leave out, and their values when the model has no
# generation_config.json defaults: greedy, no top-k / top-p filter
SAMPLING_FALLBACK: dict[str, float | int] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}

# Bounds of what the workers accept: messages are msgpack (ints within int64/uint64) and the
# sampler keeps temperature and top_k in float32 rows, so every field is checked where a
# request enters and a value past them is a 400, never a failed step.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_TEMPERATURE = 1e4  # float32-safe; a softmax is uniform long before this
# below this a temperature samples greedily (as vLLM does): logits divided by 1e-38 overflow
# float32, and the NaN rows gave token 0
MIN_TEMPERATURE = 1e-5
# float32-safe (a smaller one rounds to 0 in the sampler's rows); any top_p below the top
# token's probability keeps that token alone
MIN_TOP_P = 1e-30
# one page-pool allocate call in this many is timed (no clock pair per block); the engine
# samples at this rate and /metrics says so
ALLOCATE_SAMPLE = 16
Seed = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
# stop strings a request may give, and their length: every new token of the request is
# checked against each on the engine's event loop, which serves every request of the replica
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]


def nth_seed(seed: int, i: int) -> int:
    """The i-th of n samples' seed: seed + i, wrapped into int64 (so n > 1 never overflows)."""
    return (seed + i - INT64_MIN) % 2**64 + INT64_MIN


class StructuredOutputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Output constrained to a grammar (raygraph/grammar.py): `kind` json (value: a JSON
    schema as text; '{"type": "object"}' is any object), regex, choice (a JSON list of the
    allowed strings), or grammar (Lark, or GBNF/EBNF as llama.cpp writes it)."""

    kind: Literal["json", "regex", "choice", "grammar"]
    value: str


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Greedy when temperature is 0 (or below MIN_TEMPERATURE); top_k == 0 and top_p == 1
    disable those filters.
    None: not given; the coordinator fills it from the model's generation_config.json
    (`resolved`), else from SAMPLING_FALLBACK."""

    max_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] = 64
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None  # >= vocab: off
    top_p: Annotated[float, Meta(ge=MIN_TOP_P, le=1.0)] | None = None
    seed: Seed | None = None
    stop_token_ids: list[TokenId] = []
    # "" would stop before any text
    stop: Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] = []
    ignore_eos: bool = False
    # return each output token's logprob and this many top alternatives (0: the token's only)
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # the LoRA adapter to generate with, by its registered name (None: the base model)
    lora: str | None = None
    structured: StructuredOutputs | None = None  # every token sampled within its grammar

    def resolved(self, defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """Every sampling field set: the given ones, else `defaults` (the model's), else
        SAMPLING_FALLBACK."""
        fill = {**SAMPLING_FALLBACK, **(defaults or {})}
        unset = {k: fill[k] for k in SAMPLING_FALLBACK if getattr(self, k) is None}
        temperature = unset.get("temperature", self.temperature)
        if 0 < temperature < MIN_TEMPERATURE:
            unset["temperature"] = 0.0
        return msgspec.structs.replace(self, **unset) if unset else self


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One output token's log-probability under the model's raw (unscaled) distribution and
    the top alternatives, most likely first."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestTiming(msgspec.Struct, frozen=True, array_like=True):
    """Where a finished request's time went, measured by the coordinator (seconds)."""

    queue_s: float  # submitted -> first scheduled
    ttft_s: float  # submitted -> first token
    e2e_s: float  # submitted -> finished


# an engine numbers its requests from replica << REPLICA_SHIFT: a request id names its replica
# every router asks the coordinator for the replicas at least this often (a replica that
# leaves is drained only after it)
ROUTES_REFRESH_S = 5.0
REPLICA_SHIFT = 48


def replica_of(request_id: int) -> int:
    """The replica whose engine numbered this request id."""
    return request_id >> REPLICA_SHIFT


class ReplicaState(msgspec.Struct, frozen=True):
    """One replica as the coordinator sees it: its engine (None while none runs) and state."""

    replica: int
    engine: Any
    state: Literal["starting", "serving", "failed", "stopped"]
    reason: str | None = None
    node_id: str | None = None


class GenerateResult(msgspec.Struct, frozen=True):
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when asked for
    timing: RequestTiming | None = None
    # what ended a "stop": the stop string or stop token id; None for EOS (vLLM's field)
    stop_reason: str | int | None = None


class StreamDelta(msgspec.Struct, frozen=True):
    """One step's new output for a streamed request; the last one carries finish_reason
    (and, for "error", the error: never in `text`, which is output only)."""

    request_id: int
    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when asked for
    timing: RequestTiming | None = None  # on the last delta
    stop_reason: str | int | None = None  # on the last delta: GenerateResult.stop_reason
    error: str | None = None  # finish_reason "error": why
    bad_request: bool = False  # finish_reason "error": the request's own doing (errors.failure)


class BucketKey(msgspec.Struct, frozen=True, order=True):
    """A captured graph's identity. Phase "eager" names a step above the largest bucket,
    which every rank runs eagerly (num_tokens is then the real, unpadded count)."""

    phase: Literal["decode", "prefill", "eager"]
    num_tokens: int
    num_comm_tokens: int = 0


class Collective(msgspec.Struct, frozen=True, array_like=True):
    """One collective a forward issued: what every rank of the group must issue alike."""

    op: str
    dtype: str
    numel: int
    group_size: int


class BufferInfo(msgspec.Struct, frozen=True, array_like=True):
    name: str
    address: int
    shape: list[int]


class CaptureRecord(msgspec.Struct, frozen=True):
    """What one rank captured for one key; the coordinator compares these across ranks."""

    key: BucketKey
    rank: int
    pieces: int  # graphs in this bucket (full graphs: 1, or 2 with a cascade graph; or the
    # piecewise segments)
    nodes: int | None  # CUDA graph nodes summed over pieces; None where not known (CPU)
    collectives: list[Collective]  # in issue order: warm-up + captured pass (GPU), eager pass (CPU)
    pool_bytes: int
    buffers: list[BufferInfo]
    seconds: float


class SeqChunk(msgspec.Struct, frozen=True, array_like=True):
    """The tokens of one sequence to compute this step.

    `start_pos` is the number of tokens already in the KV cache; when `sample` is set, the
    last token's logits are sampled with the request's parameters, at output index
    `num_generated` (the seed stream position, so preemption replays the same draws).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    num_generated: int = 0
    feed: int = -1  # >= 0: the token is this row of the previous step's sampled tokens
    logprobs: int = -1  # >= 0: return the sampled token's logprob and this many alternatives
    lora_slot: int = -1  # the adapter slot its tokens read (-1: the base model)
    verify: int = 0  # its last `verify` tokens are drafts: greedy tokens at each of them too
    propose: bool = False  # the worker's draft model proposes the tokens after this one's
    next_token: int = -1  # >= 0: the known token after its last (an EAGLE-3 head reads it)


class StepPlan(msgspec.Struct, frozen=True):
    """One step for one worker. `key` is the bucket the coordinator chose; the worker checks
    it equals the key it derives itself (None: derive it, for in-process use without a
    coordinator). `num_comm_tokens` is the EP dispatch size (DP attention + MoE EP)."""

    step_id: int
    seqs: list[SeqChunk]
    key: BucketKey | None = None
    num_comm_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class NewSeq(msgspec.Struct, frozen=True, array_like=True):
    """A sequence the workers start tracking (admitted, or readmitted after preemption)."""

    seq_id: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    num_generated: int = 0  # outputs already known (a recompute after preemption)
    logprobs: int = -1  # SeqChunk.logprobs
    # tokens whose KV its first blocks already hold (prefix cache hits): its first chunk
    # starts there
    num_computed: int = 0
    lora_slot: int = -1  # SeqChunk.lora_slot
    structured: StructuredOutputs | None = None  # its grammar: its samples are masked
    replay: list[int] = []  # with a grammar: the outputs so far, which its matcher consumes


class SeqStep(msgspec.Struct, frozen=True, array_like=True):
    """Tokens of one tracked sequence to compute this step (a prefill chunk, a recompute, or a
    decode whose token the coordinator already knows)."""

    seq_id: int
    token_ids: list[int]
    sample: bool
    verify: int = 0  # SeqChunk.verify
    # drafts of its last verify step that were not kept: its workers forget their KV first
    forget: int = 0
    propose: bool = False  # SeqChunk.propose
    next_token: int = -1  # SeqChunk.next_token


class StepDelta(msgspec.Struct, frozen=True):
    """One step for one DP group, as a change to the state the workers keep.

    The batch is `feed` then `chunks`, in order. `feed` ids decode one token each: the token
    they sampled in the previous step, which stays on the device. `blocks` appends KV blocks
    (seq id, block) before the step; `new` starts tracking sequences, `drop` stops (finished,
    aborted, preempted) before anything else. `lora_loads` (slot, adapter path) are
    written into their slots on the device's stream before the step is launched: after the
    step in flight, ahead of this one (every DP group's message carries them all).
    """

    step_id: int
    feed: list[int] = []
    chunks: list[SeqStep] = []
    new: list[NewSeq] = []
    blocks: list[tuple[int, int]] = []
    drop: list[int] = []
    key: BucketKey | None = None
    num_comm_tokens: int = 0
    lora_loads: list[tuple[int, str]] = []


class LoRALoad(msgspec.Struct, frozen=True, array_like=True):
    """One rank's load of a StepDelta's `lora_loads` entry. A failed one left the slot zero
    (its tokens compute the base model) and names the reason in one line."""

    slot: int
    tier: Literal["warm", "cold"]  # the rank's warm tier held the adapter, or it read files
    seconds: float  # host time to read or find the image and queue its copies
    error: str = ""


class StepOutput(msgspec.Struct, frozen=True, array_like=True):
    """A finished step's sampled tokens (one per sampling sequence, in batch order), from the
    group's first TP rank; step_id -1: no step was pending."""

    step_id: int
    token_ids: list[int]
    forward_s: float = 0.0  # the step's device time (CUDA), or its host time (CPU)
    idle_s: float = 0.0  # how long the device waited for this step after the previous one
    logprobs: dict[int, TokenLogprobs] = {}  # batch row -> logprobs, for rows that asked
    # the loads of the step this call launched (not of step_id): every rank answers with them
    lora_loads: list[LoRALoad] = []
    # tokens per sampling sequence when a row verified drafts (then token_ids holds each
    # row's kept drafts and next token); empty: one token each
    counts: list[int] = []
    # sampling row -> the draft model's proposal after that row's last token (SeqChunk.propose)
    drafts: dict[int, list[int]] = {}
    draft_s: float = 0.0  # the drafter's part of forward_s (its passes and proposal loop)


class StepResult(msgspec.Struct, frozen=True):
    """Sampled tokens, one per SeqChunk with sample=True, in plan order."""

    step_id: int
    token_ids: list[int]
    forward_s: float = 0.0


class WorkerInfo(msgspec.Struct, frozen=True):
    rank: int
    device: str
    num_kv_blocks: int
    weight_bytes: int
    kv_bytes_per_block: int
    load_s: float


class StartupProgress(msgspec.Struct, frozen=True):
    """(done, total) of each start-up phase; total 0: not started or nothing to do."""

    load: tuple[int, int] = (0, 0)  # checkpoint tensors read by rank 0
    capture: tuple[int, int] = (0, 0)  # capture-schedule keys


class WorkerCall(msgspec.Struct, frozen=True):
    """A worker method call over the coordinator's compiled graph (lockstep capture, stats,
    sleep/wake, fault drills): while the graph is up the actor runs its loop, so a plain
    `.remote()` call would wait for the graph to be torn down."""

    method: str
    args: tuple = ()
    rank: int = -1  # >= 0: only this rank runs it (the others answer None)


# the worker methods a WorkerCall may name
WORKER_CALLS = frozenset({"prepare_capture", "capture", "memory_stats", "offload_stats",
                          "sleep", "wake_up", "kv_blocks_ready", "inject_fault", "logits",
                          "load_lora", "unload_lora"})
