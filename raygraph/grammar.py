"""Structured outputs: a request's grammar (JSON schema, regex, choice, Lark/GBNF) compiled
with llguidance once per distinct spec, and one matcher per sequence, told each token the
sequence got, that says which tokens its next sample may take.

The engine compiles a request's grammar when it arrives (a bad one is a BadRequest before
anything is queued); an HTTP front compiles it too, so a bad schema is a 400 before the
request is sent. Two matchers follow each constrained sequence: the workers' fills the
masks its rows sample under (worker/guides.py: while the step's forward runs), and the
scheduler's, a step behind, ends the sequence when its grammar is complete.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import msgspec

from raygraph.errors import BadRequest
from raygraph.protocol import StructuredOutputs

CACHE_SIZE = 256  # compiled grammars kept (distinct specs)
# llguidance's parser holds at most 2000 items a row: past ~2000 alternatives that share a
# prefix the matcher fails mid-answer, so longer choice lists are refused up front
MAX_CHOICES = 1024


class Guide:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any, eos: int, vocab: int) -> None:
        self.matcher = matcher
        self.eos = eos
        self.vocab = vocab

    def mask(self) -> bytes:
        """The tokens the next sample may take, as little-endian bits."""
        import llguidance.numpy as lln

        bits = lln.allocate_token_bitmask(1, self.vocab)
        fill_masks([self], bits, self.eos)
        return bits[0].tobytes()

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; True once the grammar is complete (nothing may
        follow but EOS) or has failed (`error`): the sequence stops there."""
        m = self.matcher
        if not m.is_stopped():
            m.consume_token(token)
        return m.is_stopped() or m.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher failed mid-answer (a limit of llguidance's parser), or None."""
        m = self.matcher
        if not m.is_error():
            return None
        return f"structured output failed mid-answer: {one_line(m.get_error())}"


class Grammars:
    """A grammar compiler for one tokenizer: each distinct spec is compiled once into a
    matcher at the grammar's start (or its error), which new sequences copy."""

    def __init__(self, hf_tokenizer: Any) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.vocab = self.tokenizer.vocab_size
        self.eos = self.tokenizer.eos_token
        self._start = lru_cache(CACHE_SIZE)(self._matcher)  # spec -> matcher or BadRequest

    def compile(self, spec: StructuredOutputs) -> None:
        """Compile `spec` (cached, failures too; BadRequest naming the problem)."""
        start = self._start(spec)
        if isinstance(start, BadRequest):
            raise BadRequest(str(start))

    def _matcher(self, spec: StructuredOutputs) -> Any:
        """A matcher at the start of `spec`'s grammar, validated against this tokenizer,
        or the BadRequest that says why there is none."""
        import llguidance

        value = spec.value
        if spec.kind == "choice":
            try:
                choices = json.loads(value)
            except (ValueError, RecursionError):
                choices = None
            if not (isinstance(choices, list) and choices
                    and all(isinstance(c, str) for c in choices)):
                return BadRequest("structured output choice: a non-empty list of strings")
            if len(choices) > MAX_CHOICES:
                return BadRequest(f"structured output choice: at most {MAX_CHOICES} choices, "
                                  f"got {len(choices)}")
        if spec.kind == "json":
            value = fixed_whitespace(value)
        try:
            grammar = llguidance.grammar_from(spec.kind, value)
        except (ValueError, RuntimeError) as e:
            return BadRequest(f"invalid {spec.kind} for structured output: {one_line(e)}")
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            return BadRequest(f"invalid {spec.kind} for structured output: {one_line(error)}")
        return llguidance.LLMatcher(self.tokenizer, grammar)

    def guide(self, spec: StructuredOutputs) -> Guide:
        """A new sequence's matcher at the grammar's start: a copy of the compiled one
        (microseconds; BadRequest if the spec is invalid)."""
        self.compile(spec)
        return Guide(self._start(spec).deep_copy(), self.eos, self.vocab)


class LazyGrammars:
    """A process's Grammars, built on first use from the tokenizer `load` returns (None:
    the model has none), once even when several threads ask at the same time."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._grammars: Grammars | None = None

    def get(self) -> Grammars:
        with self._lock:
            if self._grammars is None:
                tokenizer = self._load()
                if tokenizer is None:
                    raise BadRequest("structured outputs need the model's tokenizer")
                self._grammars = Grammars(tokenizer.hf)
            return self._grammars


_executor: list[Any] = []  # llguidance's thread pool, made on first use


def fill_masks(guides: list[Guide | None], bits: Any, eos: int) -> None:
    """Rows [0, len(guides)) of `bits` (int32 words, llguidance's layout: bit t of the
    little-endian words is token t) set to each sequence's next-token mask, filled in
    parallel on llguidance's thread pool (native code, without the GIL). A None guide (its
    grammar failed to build) or a matcher left with no token allows only EOS."""
    import llguidance
    import llguidance.numpy as lln

    live = [(g.matcher, i) for i, g in enumerate(guides) if g is not None]
    if len(live) > 1:
        if not _executor:
            _executor.append(llguidance.LLExecutor())
        lln.fill_next_token_bitmask_par(_executor[0], live, bits)
    elif live:
        lln.fill_next_token_bitmask(live[0][0], bits, live[0][1])
    for i, g in enumerate(guides):
        if g is None or g.matcher.is_error() or not bits[i].any():
            bits[i] = 0
            bits[i, eos // 32] = 1 << (eos % 32)


def structured_of(params: Any) -> StructuredOutputs | None:
    """A request's grammar spec from its params as sent (SamplingParams or a dict), or None
    when it has none or it does not parse (the request's own checks report that)."""
    spec = getattr(params, "structured", None) if not isinstance(params, dict) \
        else params.get("structured")
    if spec is None or isinstance(spec, StructuredOutputs):
        return spec
    try:
        return msgspec.convert(spec, StructuredOutputs)
    except msgspec.ValidationError:
        return None


def fixed_whitespace(schema: str) -> str:
    """The schema with llguidance's separators pinned (", " and ": ", no other whitespace)
    unless it sets its own: with any whitespace allowed, a model can fill its whole budget
    with newlines and never close the object."""
    try:
        doc = json.loads(schema)
        if not isinstance(doc, dict) or "x-guidance" in doc:
            return schema
        doc["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                             "key_separator": ": "}
        return json.dumps(doc)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
        return schema  # llguidance reports it


def one_line(err: Any) -> str:
    """llguidance's errors quote the grammar over several lines: the first says what."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
