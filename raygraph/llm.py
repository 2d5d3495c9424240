"""`raygraph.LLM`: serve a model from a Python program and generate, with no Ray in sight.

It runs the same coordinator `raygraph serve` starts, on the Ray this process has joined (or
on a private one it starts), under a name of its own so several can serve side by side."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import ray
from ray.exceptions import RayTaskError

from raygraph.client.connect import check_startup, connect, remote_cause, start_coordinator
from raygraph.errors import BadRequest
from raygraph.protocol import GenerateResult, SamplingParams, StreamDelta
from raygraph.serve_options import build_config

Params = SamplingParams | dict[str, Any] | None
Prompt = str | list[int]


class LLM:
    """A served model. `model`: a checkpoint directory or hub id (None: the built-in model);
    `address`: the Ray cluster to join ("auto": the local one; None: the Ray this process
    has initialized, else a private one that close() shuts down, with whatever else was
    started on it); the other keywords are
    `raygraph serve`'s options (serve_options.SERVE_OPTIONS: tp, max_num_seqs, eager, ...).

    Errors are the coordinator's own (BadRequest for bad input), not Ray's wrappers."""

    def __init__(self, model: str | None = None, *, address: str | None = None,
                 **serve_options: Any) -> None:
        cfg = build_config({"model": model, **serve_options})
        self.config = msgspec.structs.replace(  # what it serves
            cfg, coordinator_name=f"raygraph-llm-{uuid.uuid4().hex[:12]}")
        check_startup(self.config)  # a bad model or layout fails here, before Ray starts
        self._owns_ray = address is None and not ray.is_initialized()
        world = self.config.parallel.world_size
        connect(address, num_cpus=max(2, world + 1) if self._owns_ray else None,
                log_to_driver=False)
        self._chat: Any = None  # the ChatTemplate, loaded at the first chat()
        try:
            with coordinator_errors():
                self._coord: Any = start_coordinator(self.config)
        except BaseException:
            self._coord = None
            self._leave_ray()
            raise

    def generate(self, prompts: Prompt | list[Prompt], params: Params = None
                 ) -> list[GenerateResult]:
        """One result per prompt (text or token ids), in order."""
        ref = self._coordinator().generate.remote(prompts, params)
        try:
            with coordinator_errors():
                return ray.get(ref)
        except KeyboardInterrupt:  # the coordinator stops computing them
            ray.cancel(ref)
            raise

    def stream(self, prompt: Prompt, params: Params = None) -> Iterator[StreamDelta]:
        """Each step's new tokens for one prompt; the last delta has finish_reason. Closing
        the iterator before that cancels the request."""
        gen = self._coordinator().generate_stream.options(num_returns="streaming").remote(
            prompt, params)
        finished = False
        try:
            for ref in gen:
                with coordinator_errors():
                    delta: StreamDelta = ray.get(ref)
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                ray.cancel(gen)

    def chat(self, messages: list[dict[str, str]], params: Params = None) -> GenerateResult:
        """The assistant's reply to `messages`, prompted by the checkpoint's chat template."""
        import pydantic

        from raygraph.api.errors import ApiError, first_problem
        from raygraph.api.schemas import ChatMessage

        try:
            ids = self._template().render([ChatMessage.model_validate(m).text()
                                           for m in messages])
        except ApiError as e:
            raise BadRequest(e.message) from None
        except pydantic.ValidationError as e:
            raise BadRequest(f"messages: {first_problem(e.errors())[0]}") from None
        return self.generate(ids, params)[0]

    def close(self) -> None:
        """Stop the coordinator and its workers; a Ray this LLM started stops too."""
        coord, self._coord = self._coord, None
        if coord is None or not ray.is_initialized():
            return
        try:
            ray.get(coord.shutdown.remote())
        finally:
            ray.kill(coord)
            self._leave_ray()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _coordinator(self) -> Any:
        if self._coord is None:
            raise RuntimeError("this LLM is closed")
        return self._coord

    def _template(self) -> Any:
        if self._chat is None:
            from raygraph.api.chat import ChatTemplate
            from raygraph.tokenizer import load_tokenizer

            tokenizer_dir = self.config.tokenizer or self.config.model
            self._chat = ChatTemplate(load_tokenizer(tokenizer_dir), tokenizer_dir)
        return self._chat

    def _leave_ray(self) -> None:
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


@contextmanager
def coordinator_errors() -> Iterator[None]:
    """Raise a remote error as the coordinator raised it, without Ray's wrapper."""
    try:
        yield
    except RayTaskError as e:
        raise remote_cause(e) from None


__all__ = ["LLM", "SamplingParams"]
