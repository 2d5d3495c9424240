"""Client input checking and incremental detokenization, kept apart from the step loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from tokenizers import Tokenizer

from raygraph.protocol import SamplingParams


class BadRequest(ValueError):
    """The request cannot be served as given; nothing was scheduled."""


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def parse_params(params: Any) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        params = msgspec.structs.asdict(params)  # re-validate: Structs skip checks on init
    try:
        return msgspec.convert(params, SamplingParams)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid sampling params: {e}") from None


def split_prompts(prompts: Any) -> list[str | list[int]]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, list | tuple) and len(prompts) == 0:
        raise BadRequest("empty prompt")
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and all(type(t) is int for t in prompts)
    ):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts:
        return list(prompts)
    raise BadRequest(
        f"prompts must be a string, a list of token ids, or a non-empty list of those; "
        f"got {type(prompts).__name__}"
    )


def encode_prompt(
    prompt: Any, tokenizer: Tokenizer | None, vocab_size: int, bos: int | None
) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer.json: send token ids, not text")
        if not prompt:
            raise BadRequest("empty prompt")
        ids = tokenizer.encode(prompt).ids
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids
    if not isinstance(prompt, list | tuple) or not all(type(t) is int for t in prompt):
        kind = type(prompt).__name__
        raise BadRequest(f"a prompt must be a string or a list of ints, got {kind}")
    if not prompt:
        raise BadRequest("empty prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return list(prompt)


class Detokenizer:
    """Text of one request's output so far, decoded incrementally, with stop strings.

    Each step decodes only a short window of tokens (from `prefix` on) rather than the
    whole output: the coordinator's loop does this for every running request every step.
    """

    def __init__(self, tokenizer: Tokenizer | None, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.prefix = 0  # window start: text before it is final
        self.read = 0  # tokens already turned into self.text

    def update(self, token_ids: list[int]) -> tuple[str, bool]:
        """Feed the whole output so far; returns (new text, whether a stop string ended it)."""
        if self.tokenizer is None:
            return "", False
        decode = self.tokenizer.decode
        before = decode(token_ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(token_ids[self.prefix :], skip_special_tokens=True)
        # an unfinished UTF-8 sequence (or a token with no text): wait for more tokens
        if after.endswith("\ufffd") or len(after) <= len(before):
            return "", False
        self.prefix, self.read = self.read, len(token_ids)
        old = self.text
        text = old + after[len(before) :]
        hit = False
        for s in self.stop:
            at = text.find(s, max(0, len(old) - len(s)))
            if at >= 0:
                text, hit = text[:at], True
        self.text = text
        return text[len(old) :], hit
