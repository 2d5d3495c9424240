"""Chat prompts from the checkpoint's chat template (`tokenizer_config.json`), rendered by
transformers' tokenizer as the model's authors meant, or from a template given by hand."""

from __future__ import annotations

from typing import Any

from raygraph.api.errors import ApiError
from raygraph.tokenizer import TextTokenizer

# apply_chat_template's own arguments: not a template variable a request may set
RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
            "add_generation_prompt", "continue_final_message", "return_dict",
            "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
            "max_length", "return_tensors"}


class ChatTemplate:
    def __init__(self, tokenizer: TextTokenizer | None, model_dir: str,
                 template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.template = template or getattr(tokenizer and tokenizer.hf, "chat_template", None)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt's token ids for `messages` (and the `tools` the model may call), with
        the assistant's generation prompt, as `apply_chat_template(tokenize=True)` gives
        them: the template writes the special tokens (BOS included), the tokenizer adds
        none. `kwargs` go to the template (e.g. enable_thinking)."""
        clash = set(kwargs or {}) & RESERVED
        if clash:
            raise ApiError(400, f"chat_template_kwargs may not set {sorted(clash)}",
                           "chat_template_kwargs")
        if self.tokenizer is None:
            raise ApiError(400, f"chat is not available: {self.model_dir} has no tokenizer")
        if not self.template:
            raise ApiError(400, f"this model has no chat template ({self.model_dir}/"
                           "tokenizer_config.json has no `chat_template`): use "
                           "/v1/completions, or serve with --chat-template FILE")
        try:
            text = self.tokenizer.hf.apply_chat_template(
                messages, tools=tools, chat_template=self.template, add_generation_prompt=True,
                tokenize=False, **(kwargs or {}))
        except Exception as e:  # the template rejected the conversation (jinja raise)
            raise ApiError(400, f"the chat template rejected the messages: {e}",
                           "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)
