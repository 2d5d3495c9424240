"""A checkpoint's generation rules as HF transformers applies them, read from its JSON files
(no transformers import, so ModelConfig can use them):

- EOS: config.json's `eos_token_id`, generation_config.json's (an int or a list) and
  tokenizer_config.json's `eos_token` all end a sequence (Llama 3 instruct stops at
  <|eot_id|> and <|eom_id|> too; Qwen at <|im_end|> and <|endoftext|>).
- Sampling defaults: what `model.generate()` would do with generation_config.json and no
  arguments (`do_sample` false or absent: greedy; true: its temperature / top_k / top_p over
  HF's defaults 1.0 / 50 / 1.0). They fill the fields a request leaves out, as vLLM's
  `--generation-config auto` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # GenerationConfig's defaults


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, {} when absent; ValueError naming the file when malformed."""
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path} is not a JSON object")
    return out


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _token_id(model_dir: Path, token: Any) -> int | None:
    """The id of a special token named in tokenizer_config.json (a string or an AddedToken
    dict), from its added_tokens_decoder or tokenizer.json."""
    content = token.get("content") if isinstance(token, dict) else token
    if not isinstance(content, str):
        return None
    tc = read_json(model_dir / "tokenizer_config.json")
    for i, t in (tc.get("added_tokens_decoder") or {}).items():
        if t.get("content") == content:
            return int(i)
    tj = read_json(model_dir / "tokenizer.json")
    for t in tj.get("added_tokens") or []:
        if t.get("content") == content:
            return int(t["id"])
    vocab = (tj.get("model") or {}).get("vocab")
    return vocab.get(content) if isinstance(vocab, dict) else None


def eos_token_ids(model_dir: str, config_eos: Any) -> tuple[int, ...]:
    """config.json's EOS ids, then generation_config.json's, then the tokenizer's, once each."""
    d = Path(model_dir)
    ids = _ids(config_eos) + _ids(read_json(d / "generation_config.json").get("eos_token_id"))
    eos = read_json(d / "tokenizer_config.json").get("eos_token")
    tok = _token_id(d, eos) if eos is not None else None
    if tok is not None:
        ids.append(tok)
    return tuple(dict.fromkeys(ids))


def sampling_defaults(model_dir: str) -> dict[str, float | int]:
    """temperature / top_k / top_p for the fields a request leaves out ({} without
    generation_config.json: the built-in greedy). top_k 0 is off."""
    g = read_json(Path(model_dir) / "generation_config.json")
    if not g:
        return {}
    if not g.get("do_sample"):
        return {"temperature": 0.0}
    out: dict[str, float | int] = dict(HF_SAMPLING)
    for k in ("temperature", "top_k", "top_p"):
        if g.get(k) is not None:
            out[k] = g[k]
    out["top_k"] = max(0, int(out["top_k"]))
    out["temperature"], out["top_p"] = float(out["temperature"]), float(out["top_p"])
    return out
