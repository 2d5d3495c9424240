"""Chat prompts from the checkpoint's chat template (`tokenizer_config.json`), rendered by
transformers' tokenizer as the model's authors meant, or from a template given by hand."""

from __future__ import annotations

import asyncio
from typing import Any

from raygraph.api.errors import ApiError


class ChatTemplate:
    """Loaded at the first chat request (transformers takes seconds to import)."""

    def __init__(self, model_dir: str, template: str | None = None) -> None:
        self.model_dir = model_dir
        self.template = template
        self._tokenizer: Any = None
        self._lock = asyncio.Lock()

    def _load(self) -> Any:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.model_dir)
        except Exception as e:
            raise ApiError(400, f"chat is not available: the tokenizer of {self.model_dir} "
                           f"does not load ({type(e).__name__}: {e})") from None
        self.template = self.template or getattr(tok, "chat_template", None)
        if not self.template:
            raise ApiError(400, f"this model has no chat template ({self.model_dir}/"
                           "tokenizer_config.json has no `chat_template`): use "
                           "/v1/completions, or serve with --chat-template FILE")
        return tok

    async def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for `messages`, with the assistant's generation prompt."""
        async with self._lock:
            if self._tokenizer is None:
                self._tokenizer = await asyncio.to_thread(self._load)
        try:
            return self._tokenizer.apply_chat_template(
                messages, chat_template=self.template, add_generation_prompt=True,
                tokenize=False)
        except Exception as e:  # the template rejected the conversation (jinja raise)
            raise ApiError(400, f"the chat template rejected the messages: {e}",
                           "messages") from None
