"""A checkpoint's tokenizer, loaded once by transformers' AutoTokenizer for everything that
turns text into ids or back (the coordinator, the HTTP front door, chat templates).

Prompts encode to exactly `AutoTokenizer.from_pretrained(dir)(text)["input_ids"]`: BOS as
tokenizer_config.json's `add_bos_token` or tokenizer.json's post-processor says,
special-token strings in the text as special tokens. Output text is decoded with
`skip_special_tokens` (as HF's generation pipelines do) by the fast `tokenizers` object
underneath, which is what the per-token detokenizer on the coordinator's loop calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raygraph.errors import BadRequest

# files that make a directory's tokenizer (without any: clients send token ids)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class TextTokenizer:
    def __init__(self, hf: Any) -> None:
        self.hf = hf  # the transformers tokenizer (chat templates use it)
        backend = getattr(hf, "backend_tokenizer", None)  # a slow tokenizer has none
        self._decode = backend.decode if backend is not None else hf.decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens=False for text that already has them (a chat template's).
        BadRequest for text that is not Unicode (JSON's escapes can carry a lone surrogate)."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadRequest(f"text is not valid Unicode: {e.reason} at character "
                                 f"{e.start}") from None
        return self.hf(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(token_ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir: str) -> TextTokenizer | None:
    """The directory's tokenizer; None when it has none. ValueError when it does not load."""
    if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # seconds to import: only where text is needed

    try:
        return TextTokenizer(AutoTokenizer.from_pretrained(model_dir))
    except Exception as e:
        raise ValueError(f"the tokenizer of {model_dir} does not load "
                         f"({type(e).__name__}: {e})") from None
