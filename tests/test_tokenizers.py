"""Text and generation rules as HF transformers applies them (prompt
ids equal AutoTokenizer's for Llama-3-style and Qwen-style tokenizers, with and without BOS;
generation_config.json's EOS lists and sampling defaults), and hub ids resolved offline from
a cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from raygraph.config import DEFAULT_MODEL, CacheConfig, GraphConfig, ModelConfig, ServeConfig
from raygraph.engine.requests import Detokenizer
from raygraph.generation import eos_token_ids, sampling_defaults
from raygraph.hub import resolve_model
from raygraph.protocol import SamplingParams
from raygraph.requests import encode_prompt, parse_params
from raygraph.tokenizer import load_tokenizer
from tests.conftest import loaded_worker, make_checkpoint, serve_in_process

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x + 1\n",
          "Ünïcödé café naïve — “quotes” ✓ 1234567 tokens", "  leading and trailing  "] * 4
TEXTS = ["Hello world", " leading space", "trailing space ", "two  spaces\n\nnewlines\t",
         "Ünïcödé café → ✓ 漢字 🙂", "<|eot_id|> in the text<|im_end|>", "<|begin_of_text|>x",
         "<|endoftext|>", "1234567890", "a"]


def build_tokenizer(out: Path, style: str, flags: dict | None = None,
                    post_processor: bool = True) -> Path:
    """A small byte-level BPE in the style of Llama 3 (tiktoken-like split, BOS from the
    post-processor) or Qwen2 (NFC, single digits, no BOS), saved by transformers;
    tokenizer_config.json `flags` on top."""
    from transformers import PreTrainedTokenizerFast

    specials = LLAMA3_SPECIALS if style == "llama3" else QWEN_SPECIALS
    tok = Tokenizer(models.BPE())
    split = LLAMA3_SPLIT if style == "llama3" else QWEN_SPLIT
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if style == "llama3" and post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 0)])
    names = (dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>") if style == "llama3"
             else dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(out)
    if not post_processor:  # transformers writes a BOS-less one: none at all
        tj = json.loads((out / "tokenizer.json").read_text())
        (out / "tokenizer.json").write_text(json.dumps({**tj, "post_processor": None}))
    if flags:
        cfg_file = out / "tokenizer_config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **flags}))
    return out


# (style, tokenizer_config flags, a post-processor in tokenizer.json, the BOS the ids start
# with: an id, None for no BOS, "hf" where transformers versions differ: its rule, whatever
# it is (5.23 drops add_bos_token for tokenizer.json-backed tokenizers: BOS comes from the
# post-processor only; 4.x honoured it for Llama tokenizers))
CASES = {
    "llama3": ("llama3", None, True, 0),
    "llama3-add-bos-false": ("llama3", {"add_bos_token": False}, True, "hf"),
    "llama3-no-post-processor": ("llama3", None, False, None),
    "llama3-no-post-processor-add-bos": ("llama3", {"add_bos_token": True}, False, "hf"),
    "qwen": ("qwen", None, True, None),
    "qwen-add-bos-true": ("qwen", {"add_bos_token": True, "bos_token": "<|endoftext|>"},
                          True, "hf"),
}


@pytest.mark.parametrize("case", CASES)
def test_text_prompts_encode_as_auto_tokenizer_does(tmp_path, case):
    from transformers import AutoTokenizer

    style, flags, post_processor, bos = CASES[case]
    d = build_tokenizer(tmp_path, style, flags, post_processor)
    hf, ours = AutoTokenizer.from_pretrained(d), load_tokenizer(str(d))
    assert ours is not None
    for text in TEXTS:
        ids = encode_prompt(text, ours, vocab_size=400)
        assert ids == hf(text)["input_ids"], text
        if bos != "hf":
            plain = hf(text, add_special_tokens=False)["input_ids"]
            assert ids == ([] if bos is None else [bos]) + plain, text
    specials = LLAMA3_SPECIALS if style == "llama3" else QWEN_SPECIALS
    named = encode_prompt(f"x{specials[2]}y", ours, 400)
    assert hf.convert_tokens_to_ids(specials[2]) in named  # a special's text is the special


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_output_text_skips_special_tokens_and_streams_whole_characters(tmp_path, style):
    tok = load_tokenizer(str(build_tokenizer(tmp_path, style)))
    text = "Ünïcödé café → ✓ 漢字 🙂 done"
    eot = tok.hf.convert_tokens_to_ids((LLAMA3_SPECIALS if style == "llama3" else
                                        QWEN_SPECIALS)[2])
    ids = tok.encode(text, add_special_tokens=False) + [eot]
    d = Detokenizer(tok, [])
    pieces = [d.update(ids[: i + 1])[0] for i in range(len(ids))]
    assert "".join(pieces) == d.text == text == tok.hf.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_eos_ids_merge_config_generation_config_and_tokenizer(tmp_path):
    build_tokenizer(tmp_path, "llama3")  # eos_token <|eot_id|> = id 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert eos_token_ids(str(tmp_path), 1) == (1, 7, 2)
    assert eos_token_ids(str(tmp_path), [7, 9]) == (7, 9, 1, 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert eos_token_ids(str(tmp_path), None) == (5, 2)


def test_a_generation_config_eos_list_stops_the_sequence(tmp_path):
    """Any id of generation_config.json's eos_token_id list ends a sequence, through the
    scheduler the served loop runs (a worker in process, greedy tokens as HF's)."""
    from raygraph.engine.sequence import Sequence
    from tests.hf_ref import hf_greedy

    path = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    prompt = [5, 9, 11, 13, 7] * 3
    (ref,) = hf_greedy(path, [prompt], 12)
    at = next(i for i in range(3, 12) if ref[i] not in ref[:i] and ref[i] != 2)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen,
                                                             "eos_token_id": [2, ref[at]]}))
    cfg = ServeConfig(model=str(path), device="cpu", graph=GraphConfig(mode="eager"),
                      cache=CacheConfig(block_size=4, num_blocks=32))
    w = loaded_worker(cfg, 32)
    assert ref[at] in w.model_cfg.eos_token_ids
    seqs = serve_in_process(cfg, w, [
        Sequence(0, prompt, SamplingParams(max_tokens=12)),
        Sequence(1, prompt, SamplingParams(max_tokens=12, ignore_eos=True))], 32)
    assert seqs[0].finish_reason == "stop" and seqs[0].output_token_ids == ref[: at + 1]
    assert seqs[1].finish_reason == "length" and seqs[1].output_token_ids == ref


@pytest.mark.parametrize("gen, want", [
    ({}, {}),
    ({"eos_token_id": 1}, {"temperature": 0.0}),  # do_sample absent: HF is greedy
    ({"do_sample": False, "temperature": 0.6}, {"temperature": 0.0}),
    ({"do_sample": True}, {"temperature": 1.0, "top_k": 50, "top_p": 1.0}),
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None},
     {"temperature": 0.6, "top_k": 50, "top_p": 0.9}),
    ({"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8},
     {"temperature": 0.7, "top_k": 20, "top_p": 0.8}),
])
def test_sampling_defaults_are_what_hf_generate_would_do(tmp_path, gen, want):
    if gen:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert sampling_defaults(str(tmp_path)) == want


def test_defaults_fill_only_the_fields_a_request_leaves_out():
    defaults = {"temperature": 0.6, "top_k": 50, "top_p": 0.9}
    assert parse_params(None).resolved(defaults) == SamplingParams(
        temperature=0.6, top_k=50, top_p=0.9)
    given = parse_params({"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_tokens": 5})
    assert given.resolved(defaults) == given
    part = parse_params({"temperature": 1.2}).resolved(defaults)
    assert (part.temperature, part.top_k, part.top_p) == (1.2, 50, 0.9)
    plain = SamplingParams(max_tokens=3).resolved({})  # no generation_config: greedy
    assert (plain.temperature, plain.top_k, plain.top_p) == (0.0, 0, 1.0)


def test_http_requests_pass_not_given_through():
    from raygraph.api.schemas import ChatRequest, CompletionRequest, check_params

    body = CompletionRequest(prompt="x")
    sp = check_params(body.params(body.max_tokens, None))
    assert (sp.temperature, sp.top_k, sp.top_p) == (None, None, None)
    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.3)
    sp = check_params(chat.params(8, None))
    assert (sp.temperature, sp.top_k, sp.top_p) == (0.3, None, None)


# ---- hub ids --------------------------------------------------------------------------
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str, src: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """`src` as huggingface_hub caches a download of `repo`: models--org--name/snapshots/
    <commit>/... and refs/<branch> holding the commit. Returns the snapshot directory."""
    base = root / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / COMMIT
    shutil.copytree(src, snap)
    (base / "refs").mkdir()
    for ref in refs:
        (base / "refs" / ref).write_text(COMMIT)
    return snap


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 for this process (huggingface_hub reads it at import)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path, offline):
    from raygraph.cli import add_serve_args, serve_config

    snap = hub_cache(tmp_path, "org/name", DEFAULT_MODEL, refs=("main", "v1"))
    assert resolve_model("org/name", None, str(tmp_path)) == str(snap)
    assert resolve_model("org/name", "v1", str(tmp_path)) == str(snap)
    assert resolve_model("org/name", COMMIT, str(tmp_path)) == str(snap)
    p = argparse.ArgumentParser()
    add_serve_args(p)
    cfg = serve_config(p.parse_args(["--model", "org/name", "--download-dir", str(tmp_path)]))
    assert cfg.model == str(snap)
    assert ModelConfig.from_pretrained(cfg.model).vocab_size == 4096
    assert resolve_model(DEFAULT_MODEL) == DEFAULT_MODEL  # a local directory stays one


@pytest.mark.parametrize("repo, revision", [("org/missing", None), ("org/name", "nope")])
def test_a_missing_hub_id_is_one_clear_error(tmp_path, offline, repo, revision):
    from raygraph.config import ConfigError

    hub_cache(tmp_path, "org/name", DEFAULT_MODEL)
    with pytest.raises(ConfigError) as e:
        resolve_model(repo, revision, str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and repo in msg and "not in the download cache" in msg


def test_the_cli_reports_a_missing_hub_id_in_one_line_exit_2(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(tmp_path / "cache"), "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run([sys.executable, "-m", "raygraph.cli", "demo", "--model", "org/missing"],
                       capture_output=True, text=True, env=env, timeout=120,
                       cwd=Path(__file__).parent.parent)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raygraph: error: cannot get model "
                                                   "'org/missing'"), r.stderr


def test_a_hub_id_serves_with_the_checkpoint_rules(ray_session, tmp_path, offline):
    """The coordinator on a resolved hub id: text prompts as AutoTokenizer encodes them,
    generation_config.json's sampling used when the request gives none, greedy when asked."""
    from transformers import AutoTokenizer

    from raygraph.client.connect import start_coordinator
    from tests.hf_ref import hf_greedy

    snap = hub_cache(tmp_path, "org/sampled", DEFAULT_MODEL)
    (snap / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [1], "do_sample": True, "temperature": 1.5}))
    model = resolve_model("org/sampled", None, str(tmp_path))
    cfg = ServeConfig(model=model, device="cpu", coordinator_name="hub-test",
                      cache=CacheConfig(block_size=16, num_blocks=64))
    handle = start_coordinator(cfg)
    try:
        text = "The import statement"
        params = [SamplingParams(max_tokens=16, ignore_eos=True, seed=s) for s in (1, 2)]
        a, b = (ray_session.get(handle.generate.remote(text, p))[0] for p in params)
        assert a.prompt_token_ids == AutoTokenizer.from_pretrained(model)(text)["input_ids"]
        assert a.prompt_token_ids[0] == 0  # the default model's tokenizer adds BOS
        assert a.token_ids != b.token_ids  # sampled at the model's temperature
        (g,) = ray_session.get(handle.generate.remote(text, SamplingParams(
            max_tokens=16, ignore_eos=True, temperature=0.0)))
        assert [g.token_ids] == hf_greedy(model, [g.prompt_token_ids], 16)
    finally:
        ray_session.get(handle.shutdown.remote())
        ray_session.kill(handle)
