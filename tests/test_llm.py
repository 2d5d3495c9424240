"""raygraph.LLM, the Python API, on the built-in model on CPU: its tokens are HF's, its stream
adds up to its result, its errors are the coordinator's own, and it leaves a Ray it joined
running. Its keywords build the ServeConfig the CLI's flags build."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from raygraph import LLM, SamplingParams
from raygraph.cli import add_serve_args, serve_config
from raygraph.config import DEFAULT_MODEL
from raygraph.errors import BadRequest
from raygraph.serve_options import SERVE_OPTIONS, build_config
from tests.hf_ref import hf_greedy

PROMPTS = ["The import statement", "A class"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(ray_session):
    with LLM(max_num_seqs=8) as llm:
        yield llm
    assert ray_session.is_initialized()  # it joined the session's Ray: that one stays up


def coordinator_stats(llm: LLM) -> dict:
    import ray

    coord = ray.get_actor(llm.config.coordinator_name, namespace=llm.config.namespace)
    return ray.get(coord.stats.remote())


def test_generate_is_hf_greedy_for_text_ids_and_dict_params(llm):
    outs = llm.generate(PROMPTS, GREEDY)
    ids = [o.prompt_token_ids for o in outs]
    assert [o.token_ids for o in outs] == hf_greedy(DEFAULT_MODEL, ids, GREEDY.max_tokens)
    assert all(isinstance(o.text, str) and o.text for o in outs)
    assert all(o.finish_reason == "length" for o in outs)
    (again,) = llm.generate(ids[1], {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    assert again.token_ids == outs[1].token_ids and again.text == outs[1].text


def test_stream_adds_up_to_generate(llm):
    (whole,) = llm.generate(PROMPTS[0], GREEDY)
    deltas = list(llm.stream(PROMPTS[0], GREEDY))
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text or "" for d in deltas) == whole.text
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == "length"


def test_closing_a_stream_early_cancels_its_request(llm):
    aborted = coordinator_stats(llm)["finished"].get("abort", 0)
    it = llm.stream(PROMPTS[1], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    assert next(it).finish_reason is None
    it.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = coordinator_stats(llm)
        if stats["finished"].get("abort", 0) == aborted + 1 and not stats["running"]:
            break
        time.sleep(0.1)
    assert stats["finished"].get("abort", 0) == aborted + 1
    assert stats["running"] == stats["waiting"] == 0


def test_chat_prompts_with_the_checkpoint_template(llm):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, GREEDY)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("user: hi\nassistant:")
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert len(out.token_ids) == GREEDY.max_tokens and isinstance(out.text, str)


@pytest.mark.parametrize("prompt, params, cause", [
    ("", None, "empty prompt"),
    ([10**6], None, "outside the vocabulary"),
    ("A class", {"max_tokens": 0}, "invalid sampling params"),
    ("A class", {"max_token": 4}, "invalid sampling params"),
])
def test_bad_input_is_bad_request_without_ray_traceback(llm, prompt, params, cause):
    for call in (llm.generate, lambda p, s: list(llm.stream(p, s))):
        with pytest.raises(BadRequest) as e:
            call(prompt, params)
        assert type(e.value) is BadRequest  # not Ray's RayTaskError(BadRequest)
        assert cause in str(e.value)
        assert "Traceback" not in str(e.value) and "\n" not in str(e.value)


def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'max_num_seq'") as e:
        LLM(max_num_seq=8)
    assert "max_num_seqs" in str(e.value) and "tp" in str(e.value)  # the valid ones
    with pytest.raises(FileNotFoundError, match="'/no/such/model' is not a directory"):
        LLM("/no/such/model")  # found before Ray is touched


def test_a_second_llm_serves_beside_the_first_and_leaves_ray_running(llm, ray_session):
    (want,) = llm.generate(PROMPTS[0], GREEDY)
    with LLM(DEFAULT_MODEL, eager=True, block_size=8) as second:
        assert second.config.coordinator_name != llm.config.coordinator_name
        assert (second.config.graph.mode, second.config.cache.block_size) == ("eager", 8)
        assert second.generate(PROMPTS[0], GREEDY)[0].token_ids == want.token_ids
    second.close()  # a second close does nothing
    assert ray_session.is_initialized()
    with pytest.raises(RuntimeError, match="closed"):
        second.generate(PROMPTS[0], GREEDY)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == want.token_ids


def test_the_readme_block_starts_a_private_ray_and_stops_it(llm):
    """The README's LLM block (tests/test_docs leaves it to this test), as its readers run it
    without Ray: it exits 0, its tokens are the session's LLM's, and the Ray it started is
    gone after the `with`."""
    from tests.test_docs import block_env, block_holding

    block = block_holding("with LLM() as llm:")
    greedy = SamplingParams(max_tokens=16, temperature=0.0)  # the block's
    want = [o.token_ids for o in llm.generate(["The import statement", "A class"], greedy)]
    script = block.code + "\nimport ray\nprint(ray.is_initialized())\n"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, env=block_env())
    assert p.returncode == 0, f"{block}\n{p.stderr[-4000:]}"
    assert all(f" {ids}\n" in p.stdout for ids in want), p.stdout
    assert p.stdout.split("\n")[-2:] == ["False", ""]


def test_a_private_ray_runs_its_actors_at_normal_priority():
    """Not at Ray's default nice 15, where any busy process outside Ray starves them."""
    script = ("import os, ray\nfrom raygraph.client.connect import connect\n"
              "connect(None, num_cpus=1)\n"
              "print(ray.get(ray.remote(lambda: os.nice(0)).remote()))\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["0"]


def cli_config(*flags: str):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return serve_config(p.parse_args(list(flags)))


def test_keywords_build_the_config_the_flags_build(tmp_path):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert set(vars(p.parse_args([]))) == set(SERVE_OPTIONS)  # every flag is a keyword
    toml = tmp_path / "serve.toml"
    toml.write_text("[scheduler]\nmax_num_seqs = 8\n[graph]\nmode = \"eager\"\n")
    assert cli_config("--config", str(toml), "--tp", "1", "--block-size", "8",
                      "--no-prefix-caching", "--offload-budget", "1GiB",
                      "--max-num-batched-tokens", "64", "--graph-pool", "torch") == build_config(
        dict(config=str(toml), tp=1, block_size=8, enable_prefix_caching=False,
             offload_budget="1GiB", max_num_batched_tokens=64, graph_pool="torch"))
    lora = build_config(dict(lora_modules={"a": "/x"}, lora_warm_budget=0.5, eager=True,
                             lora_allowed_dirs=["/ads"]))
    assert lora == cli_config("--lora-modules", "a=/x", "--lora-warm-budget", "0.5", "--eager",
                              "--lora-allowed-dir", "/ads")
    assert (lora.lora.max_loras, lora.lora.modules, lora.graph.mode) == (4, (("a", "/x"),),
                                                                         "eager")
    # the file's values stand where no keyword is given; eager=False turns graphs back on
    cfg = build_config(dict(config=str(toml), eager=False))
    assert (cfg.scheduler.max_num_seqs, cfg.graph.mode) == (8, "graph")
