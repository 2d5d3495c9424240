"""What the routes share: the HTTP config, the coordinator handle, the model's facts, the
tokenizer, metrics, and the coordinator calls (whole responses and merged streams)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from raygraph.api.answers import REASONING_PARSERS
from raygraph.api.chat import ChatTemplate
from raygraph.api.errors import ApiError, translate
from raygraph.api.metrics import Metrics
from raygraph.api.schemas import ChatRequest, Logprobs, check_params
from raygraph.api.tools import FORMATS, ToolCalls, ToolFormat, format_for
from raygraph.client.streams import ReplicaStreams
from raygraph.grammar import LazyGrammars
from raygraph.protocol import (
    GenerateResult,
    SamplingParams,
    StreamDelta,
    StructuredOutputs,
    TokenLogprobs,
    nth_seed,
)
from raygraph.requests import encode_prompt, split_prompts
from raygraph.tokenizer import TextTokenizer, load_tokenizer

T = TypeVar("T")
# text of this many characters or more tokenizes in a lane of its own (`Front.bulk`)
BULK_CHARS = 1 << 16
Receive = Callable[[], Awaitable[dict]]
# Logprobs.completion or Logprobs.chat
Shape = Callable[[list[int], list[TokenLogprobs]], dict]


class HttpConfig(msgspec.Struct, frozen=True):
    """The HTTP front door (`raygraph serve` flags)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    api_key: str | None = None  # set: every route but /health and /metrics needs it
    served_model_name: str | None = None  # None: the checkpoint directory's name
    chat_template: str | None = None  # a Jinja template's text; None: the checkpoint's
    probe_timeout_s: float = 5.0  # /health and /metrics calls to the coordinator
    # API server actors sharing the port (SO_REUSEPORT: the kernel spreads connections):
    # one Python process sends a few thousand SSE chunks a second
    replicas: int = 1
    max_request_bytes: int = 16 * 2**20  # a larger body is a 413, refused before it is read
    enable_sleep_routes: bool = False  # POST /sleep and /wake_up (else 404)
    enable_lora_updates: bool = False  # POST /v1/load_lora_adapter, /v1/unload_... (else 404)
    # chat answers' <think> part as reasoning_content: deepseek_r1 or qwen3 (api/answers.py)
    reasoning_parser: str | None = None
    # the model's tool-call format (api/tools.py); None: read off the chat template
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.tool_call_parser not in (None, *FORMATS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(FORMATS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")


# one SSE stream per choice: (choice index, prompt token ids, params)
Choice = tuple[int, list[int], SamplingParams]


class ClientGone(ApiError):
    """The client closed its connection while its response was computed (nginx's 499)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", code="client_closed")


async def until_disconnected(receive: Receive) -> None:
    """Returns when the client goes away (the request's body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# what a chat message costs a template past its text (its role, markers), in characters
MESSAGE_CHARS = 16


def text_size(arg: Any) -> int:
    """The characters of text in a prompt, a list of prompts or of chat messages: what
    tokenizing them costs (token ids cost nothing; a message its text and MESSAGE_CHARS)."""
    size = 0
    for x in arg if isinstance(arg, list) else [arg]:
        if isinstance(x, dict):
            size += MESSAGE_CHARS
            x = x.get("content")
        if isinstance(x, str):
            size += len(x)
    return size


class Merged:
    """A request's merged stream deltas (`Front.open_streams`), iterated once. `aclose()`
    stops every stream not finished, whether or not they were read: a generator closed
    before it started runs no cleanup of its own."""

    def __init__(self, deltas: AsyncGenerator[tuple[int, StreamDelta], None],
                 stop: Callable[[], None]) -> None:
        self._deltas, self._stop = deltas, stop

    def __aiter__(self) -> AsyncGenerator[tuple[int, StreamDelta], None]:
        return self._deltas

    async def aclose(self) -> None:
        await self._deltas.aclose()
        self._stop()


class Front:
    """What the routes share: the coordinator, the model's facts, tokenizer and metrics."""

    def __init__(self, coord: Any, cfg: HttpConfig, info: dict) -> None:
        self.coord, self.cfg = coord, cfg
        model_dir = info["model"]
        self.name = cfg.served_model_name or Path(model_dir).name
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.metrics = Metrics(self.name)
        self.streams = ReplicaStreams.from_info(coord, info)  # to the engines directly
        # per-request CPU work (tokenizing, chat templates, logprob strings) runs here, so
        # a long prompt never holds up the event loop's other requests and probes
        self.cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="raygraph-http-cpu")
        # long prompts (seconds each at megabytes) tokenize here: they queue behind each
        # other, never in front of a short prompt
        self.bulk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raygraph-http-bulk")
        # transformers takes seconds to import: the tokenizer loads while the server already
        # answers probes and token-id routes (a server restarted after a crash serves at once)
        self._text = self.cpu.submit(self._load_text, info.get("tokenizer", model_dir),
                                     cfg.chat_template)
        self.grammars = LazyGrammars(lambda: self.tokenizer)  # checks structured outputs

    @staticmethod
    def _load_text(tokenizer_dir: str, template: str | None
                   ) -> tuple[TextTokenizer | None, Logprobs, ChatTemplate]:
        tokenizer = load_tokenizer(tokenizer_dir)
        return tokenizer, Logprobs(tokenizer), ChatTemplate(tokenizer, tokenizer_dir, template)

    def text_ready(self) -> None:
        """Wait for the tokenizer (ValueError if it does not load)."""
        self._text.result()

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return self._text.result()[0]

    @property
    def logprobs(self) -> Logprobs:
        return self._text.result()[1]

    @property
    def chat(self) -> ChatTemplate:
        return self._text.result()[2]

    @property
    def tool_format(self) -> ToolFormat:
        """How the model writes tool calls (`--tool-call-parser`, else its template's)."""
        return format_for(self.cfg.tool_call_parser, self.chat.template)

    def tool_calls(self, body: ChatRequest) -> ToolCalls | None:
        """What a chat answer's calls are parsed against (None: no tools, or "none")."""
        if not body.tools_active:
            return None
        return ToolCalls(self.tool_format, frozenset(t.function.name for t in body.tools or []))

    async def check_structured(self, spec: StructuredOutputs | dict[str, str]) -> None:
        """Compile a request's grammar (raygraph/grammar.py; cached) on the CPU pool, so a
        bad one is a 400 before the request is sent and a large one does not hold up the
        loop."""
        try:
            await self.off_loop(self._compile, msgspec.convert(spec, StructuredOutputs)
                                if isinstance(spec, dict) else spec)
        except (ValueError, msgspec.ValidationError) as e:  # BadRequest
            raise translate(e) from None

    def _compile(self, spec: StructuredOutputs) -> None:
        self.grammars.get().compile(spec)

    async def off_loop(self, fn: Callable[..., T], *args: Any, bulk: bool = False) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.bulk if bulk else self.cpu,
                                          functools.partial(fn, *args))

    # ---- requests in ------------------------------------------------------------------
    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the served model); the
        coordinator refuses a name it does not know (404 model_not_found)."""
        return None if model is None or model == self.name else model

    def encode(self, prompts: Any) -> list[list[int]]:
        """Every prompt's token ids (BadRequest if one is bad); run it off the loop."""
        return [encode_prompt(p, self.tokenizer, self.vocab_size) for p in split_prompts(prompts)]

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               kwargs: dict[str, Any] | None = None) -> list[list[int]]:
        """The chat template's token ids, checked as a prompt; run it off the loop."""
        return self.encode([self.chat.render(messages, tools, kwargs)])

    async def tokenize(self, fn: Callable[[Any], list[list[int]]], arg: Any, extra: int = 0
                       ) -> list[list[int]]:
        """`encode` or `render` on the CPU pool (the bulk lane for long text: `arg`'s and
        `extra` characters more, a chat template's tools); a bad prompt is a 400."""
        await asyncio.wrap_future(self._text)  # the tokenizer, and what uses it after
        try:
            bulk = text_size(arg) + extra >= BULK_CHARS
            return await self.off_loop(fn, arg, bulk=bulk)
        except ValueError as e:  # BadRequest
            raise translate(e) from None

    async def request(self, prompts: list[list[int]], fields: dict[str, Any], n: int,
                      given_max_tokens: int | None) -> list[Choice]:
        """The choices of a request: its sampling fields checked (400s), its grammar
        compiled on the CPU pool (a large schema does not hold up the loop), and its prompts
        checked against the context."""
        try:
            sp = check_params(fields)
        except ValueError as e:  # BadRequest
            raise translate(e) from None
        if sp.structured is not None:
            await self.check_structured(sp.structured)
        self.check_context(prompts, given_max_tokens)
        return self.choices(prompts, sp, n)

    def check_context(self, prompts: list[list[int]], max_tokens: int | None) -> None:
        """Each prompt must leave room for a token and, where the client gave max_tokens,
        for all of them (not given: generation stops where the context ends)."""
        longest, limit = max(len(p) for p in prompts), self.max_model_len
        if longest >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, your prompt has {longest} tokens (plus at least one "
                           "generated token). Please reduce the length of the prompt.",
                           code="context_length_exceeded")
        if max_tokens is not None and longest + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, you requested {longest + max_tokens} tokens ({longest} "
                           f"in the prompt, {max_tokens} in the completion). Please reduce "
                           "the length of the prompt or completion.",
                           "max_tokens", "context_length_exceeded")

    @staticmethod
    def choices(prompts: list[list[int]], sp: SamplingParams, n: int) -> list[Choice]:
        """n samples per prompt, choice index prompt * n + sample; seeded samples get
        seed, seed + 1, ... (wrapped into int64) so they differ and each is reproducible."""
        out = []
        for j, ids in enumerate(prompts):
            for i in range(n):
                seed = None if sp.seed is None else nth_seed(sp.seed, i)
                out.append((j * n + i, ids, msgspec.structs.replace(sp, seed=seed)))
        return out

    # ---- coordinator calls --------------------------------------------------------------
    async def generate(self, choices: list[Choice], receive: Receive) -> list[GenerateResult]:
        """Every choice, in order. Choices differ only by seed: those with the same seed go
        in one call (batched). If the client goes away first (`receive` says so), the calls
        are cancelled, which aborts their requests, and ClientGone is raised."""
        import ray

        groups: dict[int | None, list[Choice]] = {}
        for c in choices:
            groups.setdefault(c[2].seed, []).append(c)
        refs = [self.coord.generate.remote([c[1] for c in g], g[0][2]) for g in groups.values()]
        work = asyncio.ensure_future(asyncio.gather(*refs))
        gone = asyncio.ensure_future(until_disconnected(receive))
        left = False
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client went away, or this handler was cancelled
                left = True
                # a gather is cancelled only once its calls are: its end is not awaited
                work.add_done_callback(lambda f: f.cancelled() or f.exception())
                work.cancel()
                for ref in refs:
                    ray.cancel(ref)
        if left:
            raise ClientGone
        try:
            outs = work.result()
        except Exception as e:  # one call failed: the others' answers are not sent either
            for ref in refs:
                ray.cancel(ref)
            raise translate(e) from None
        results: dict[int, GenerateResult] = {}
        for g, rs in zip(groups.values(), outs):
            for c, r in zip(g, rs):
                results[c[0]] = r
                self.metrics.finished(r.request_id, r.timing, len(r.token_ids))
        return [results[c[0]] for c in choices]

    async def result_logprobs(self, results: list[GenerateResult], shape: Shape | None
                              ) -> list[dict | None]:
        """Each result's logprobs in OpenAI's `shape` (None: not asked for), built on the CPU
        pool: a token string each, for long outputs."""
        if shape is None:
            return [None] * len(results)
        return await self.off_loop(
            lambda: [shape(r.token_ids, r.logprobs or []) for r in results])

    async def open_streams(self, choices: list[Choice]) -> Merged:
        """Start a stream per choice and wait for each one's first delta, so a refused
        request fails before any byte is sent; then the merged deltas, as they come."""
        hub = self.streams
        opened = await asyncio.gather(*(hub.open(ids, sp) for _, ids, sp in choices),
                                      return_exceptions=True)
        rids = [r for r in opened if isinstance(r, int)]
        try:
            failed = next((e for e in opened if isinstance(e, BaseException)), None)
            if failed is not None:
                raise failed
            firsts = await asyncio.gather(*(hub.next(r) for r in rids))
        except Exception as e:
            hub.cancel(rids)
            raise translate(e) from None
        done: set[int] = set()
        return Merged(self._merge([c[0] for c in choices], rids, firsts, done),
                      lambda: hub.cancel([r for r in rids if r not in done]))

    async def _merge(self, indices: list[int], rids: list[int], firsts: list[StreamDelta],
                     done: set[int]) -> AsyncIterator[tuple[int, StreamDelta]]:
        """The deltas as they come; `done` gathers the streams that finished (Merged stops
        the others)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, rid: int, delta: StreamDelta) -> None:
            gaps, tokens, last = [], 0, time.perf_counter()
            gap = 0.0  # before this delta
            try:
                while True:
                    n = len(delta.token_ids)
                    # one gap a token after the first: a delta's tokens after its first came
                    # together (merged while this replica was busy)
                    gaps += ([gap] if tokens and n else []) + [0.0] * max(0, n - 1)
                    tokens += n
                    await queue.put((index, delta))
                    if delta.finish_reason is not None:
                        done.add(rid)
                        self.metrics.finished(rid, delta.timing, tokens, gaps)
                        return
                    delta = await self.streams.next(rid)
                    now = time.perf_counter()
                    gap, last = now - last, now
            except Exception as e:
                await queue.put((index, e))

        tasks = [asyncio.create_task(pump(*a)) for a in zip(indices, rids, firsts)]
        try:
            left = len(tasks)
            while left:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise translate(item)
                yield index, item
                left -= item.finish_reason is not None
        finally:  # the streams themselves stop in Merged.aclose, read or not
            for t in tasks:
                t.cancel()

    async def probe(self) -> tuple[bool, str, list[dict]]:
        """(serving, why not, each replica's state) from the coordinator: serving while one
        replica serves. A replica asleep because idle counts as serving (a request wakes
        it); its state says "asleep"."""
        try:
            stats = await asyncio.wait_for(self.coord.stats.remote(), self.cfg.probe_timeout_s)
            replicas = [{"replica": r["replica"], "node_id": r.get("node_id"),
                         "state": "asleep" if r.get("asleep") else r["state"],
                         "reason": r.get("reason")} for r in stats.get("replicas", [])]
            if not stats["healthy"]:
                return False, f"not serving: {stats['reason'] or 'not started'}", replicas
            if await asyncio.wait_for(self.coord.is_sleeping.remote(),
                                      self.cfg.probe_timeout_s):
                return False, "asleep; POST /wake_up", replicas
        except asyncio.TimeoutError:
            return False, f"the coordinator did not answer in {self.cfg.probe_timeout_s}s", []
        except Exception as e:
            return False, translate(e).message, []
        return True, "ok", replicas

    async def stats(self) -> tuple[dict, int]:
        """The coordinator's stats and, with weight offload, the bytes it copied."""
        try:
            stats = await asyncio.wait_for(self.coord.stats.remote(), self.cfg.probe_timeout_s)
            h2d = 0
            if stats.get("offload"):
                ranks = await asyncio.wait_for(self.coord.worker_stats.remote(),
                                               self.cfg.probe_timeout_s)
                h2d = sum((r["offload"] or {}).get("bytes_copied", 0) for r in ranks)
        except Exception as e:
            raise translate(e) from None
        return stats, h2d
