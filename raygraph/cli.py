"""`raygraph demo | serve | generate | check-capture | submit | stop | sleep | wake | scale`:
one line per error, exit 2 for bad input and 1 for a runtime failure (`--verbose` shows the
traceback).

Over 500 lines because it is every command's parser and handler in one place, the way a
user reads `raygraph --help`; the logic each calls lives in client/, api/ and the actors."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import NoReturn

import msgspec

from raygraph import __version__
from raygraph.adapter_files import LORA_MODULES
from raygraph.client.connect import (
    ClusterError,
    auth_token_available,
    check_startup,
    connect,
    first_line,
    get_coordinator,
    remote_cause,
    start_coordinator,
)
from raygraph.config import ConfigError, ServeConfig, parse_bytes
from raygraph.errors import Asleep, BadRequest, Busy
from raygraph.memory.offload_plan import OffloadBudgetError
from raygraph.protocol import SamplingParams
from raygraph.requests import parse_params
from raygraph.serve_options import DEFAULT_MAX_LORAS, SERVE_OPTIONS, build_config

DEMO_PROMPTS = ["The import statement", "A class definition", "The for statement",
                "Exceptions can be raised"]


D = ServeConfig()  # the defaults the flags fall back to (or a --config file's values)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir, or a hub id (org/name) downloaded before Ray "
                        "starts (default: the built-in model)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir or hub id, for a checkpoint without its own "
                        "(default: the checkpoint's)")
    p.add_argument("--revision", default=None,
                   help="hub branch, tag or commit of a hub id --model (default: main)")
    p.add_argument("--download-dir", default=None,
                   help="hub download cache for a hub id --model; on a multi-node cluster "
                        "a directory every node sees (default: HF_HUB_CACHE)")
    p.add_argument("--config", default=None, help="a TOML ServeConfig; flags override it")
    p.add_argument("--tp", type=int, default=None,
                   help=f"tensor-parallel size (default: {D.parallel.tp})")
    p.add_argument("--dp", type=int, default=None,
                   help="attention data-parallel groups (MoE models; needs --ep tp*dp) "
                        f"(default: {D.parallel.dp})")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel size: 1 (experts TP-split) or tp*dp (MoE models) "
                        f"(default: {D.parallel.ep})")
    p.add_argument("--replicas", type=int, default=None,
                   help="engines of the model, each with its own workers (tp*dp of them), "
                        f"KV cache and graphs, behind one front door (default: "
                        f"{D.replica.replicas})")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="replicas kept awake; the rest sleep when idle and wake for a burst "
                        "(default: all)")
    p.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling: start replicas, up to this many, while every one has "
                        "requests waiting or a full KV cache (default: off)")
    p.add_argument("--idle-sleep-s", type=float, default=None,
                   help="an elastic replica with no request for this long sleeps "
                        f"(default: {D.replica.idle_sleep_s:g})")
    p.add_argument("--placement", choices=["spread", "pack"], default=None,
                   help="spread: replicas over the cluster's nodes; pack: where Ray puts them "
                        f"(default: {D.replica.placement})")
    p.add_argument("--routing", choices=["cache", "load", "round-robin"], default=None,
                   help="cache: to the replica holding the prompt's prefix, within a load "
                        "bound; load: the less loaded of two; round-robin "
                        f"(default: {D.replica.routing})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                   help=f"auto: cuda when the cluster has a GPU per rank (default: {D.device})")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="auto: on cuda a float16 or bfloat16 checkpoint's own torch_dtype, "
                        f"else bfloat16; float32 on cpu (default: {D.dtype})")
    p.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                   help="auto: the checkpoint's *.safetensors; dummy: random weights drawn "
                        "on the device from config.json alone, to time a model's shapes "
                        f"(default: {D.load_format})")
    p.add_argument("--quantization", choices=["auto", "fp8"], default=None,
                   help="auto: as the checkpoint is stored (FP8 checkpoints run in FP8); fp8: "
                        "quantize a bf16/fp16/fp32 checkpoint's linear layers to FP8 at load "
                        f"(default: {D.quantization})")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV block (default: {D.cache.block_size})")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
                        '\'{"method": "eagle3"|"draft", "model": DIR}\' (default: off)')
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                   help="auto: the weights' dtype; fp8: FP8 e4m3, twice the tokens in the "
                        f"same memory (default: {D.cache.cache_dtype})")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per rank (default: sized from free memory)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=None,
                   help="do not keep full KV blocks cached for requests that share a prompt "
                        "prefix (default: prefix caching on)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"running sequences at most (default: {D.scheduler.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of a step (chunked prefill) "
                        f"(default: {D.scheduler.max_num_batched_tokens})")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--eager", action="store_true", default=None,
                   help="run every step eagerly (no graphs): the reference path, for debugging")
    p.add_argument("--graph-pool", choices=["vmm", "torch", "private"], default=None,
                   help="graph memory: vmm (a virtual range per capture over shared physical "
                        "memory), torch (one shared pool), private (a pool per graph) "
                        f"(default: {D.graph.pool})")
    p.add_argument("--prefill-graph", choices=["piecewise", "full"], default=None,
                   help="prefill buckets: piecewise (attention eager between graphs) or full "
                        f"(one graph, attention inside) (default: {D.graph.prefill_graph})")
    p.add_argument("--decode-cascade", action=argparse.BooleanOptionalAction, default=None,
                   help="decode: attend over a prompt prefix every running sequence shares "
                        "(prefix caching) once for the batch, in a second graph per decode "
                        f"bucket (default: {'on' if D.graph.decode_cascade else 'off'})")
    p.add_argument("--capture", choices=["auto", "background", "at_start", "lazy"],
                   default=None,
                   help="when the capture schedule runs: background (serve at once, eager "
                        "steps until each shape is captured between steps), at_start (before "
                        "serving), lazy (a shape when first needed); auto: background on "
                        "cuda, lazy on cpu "
                        f"(default: {D.graph.capture})")
    p.add_argument("--offload-budget", type=parse_bytes, default=None,
                   help="keep weights in host memory with at most this much of them on the GPU "
                        "(bytes, or e.g. 1.5GiB, 800MB); fails at load below the floor "
                        "(default: off)")
    p.add_argument("--offload-mode", choices=["ring", "lru", "sync"], default=None,
                   help="ring: fixed slots, copies inside the graphs; lru: capped pool with "
                        "LRU and prefetch (eager); sync: copy before each kernel "
                        f"(default: {D.offload.mode})")
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=None,
                   metavar="NAME=PATH",
                   help="PEFT LoRA adapters to serve, each under its name (the requests' "
                        "`model` field); more at run time with POST /v1/load_lora_adapter")
    p.add_argument("--max-loras", "--lora-hot-budget", type=int, default=None,
                   help="adapter slots on the GPU (the hot budget); others wait in host "
                        f"memory or on disk (default: {DEFAULT_MAX_LORAS} with --lora-modules, "
                        f"else {D.lora.max_loras}: off)")
    p.add_argument("--lora-warm-budget", type=float, default=None, metavar="GIB",
                   help="pinned host memory per worker for recently used adapters (the warm "
                        f"tier), GiB (default: {D.lora.warm_budget_bytes / 2**30:g})")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help=f"the largest adapter rank served (default: {D.lora.max_lora_rank})")
    p.add_argument("--lora-allowed-dir", dest="lora_allowed_dirs", action="append",
                   default=None, metavar="DIR",
                   help="directories adapters loaded at run time (POST /v1/load_lora_adapter "
                        "with --enable-lora-updates) must lie under; repeatable (default: "
                        "none: run-time loading refused)")
    p.add_argument("--max-lora-adapters", type=int, default=None,
                   help="registered adapters at most, at start and at run time "
                        f"(default: {D.lora.max_adapters})")
    p.add_argument("--lora-target-modules", nargs="+", choices=LORA_MODULES, default=None,
                   help="the modules adapters may target: only their projections get adapter "
                        "slots and kernels; an adapter loaded later that targets another is "
                        "refused (default: those the --lora-modules adapters target, all "
                        "seven without any)")


def lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH -> (name, path)."""
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="HTTP address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000,
                   help="HTTP port; 0 picks a free one (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health and "
                        "/metrics, checked before the body is read (default: none)")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20, metavar="N",
                   help="a larger request body is refused with 413 before it is read "
                        "(default: 16 MiB)")
    p.add_argument("--enable-sleep-routes", action="store_true",
                   help="serve POST /sleep and /wake_up (default: off, 404)")
    p.add_argument("--enable-lora-updates", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(default: off, 404)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the hub id of a hub "
                        "--model, else the checkpoint's directory name)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (default: the checkpoint's "
                        "tokenizer_config.json chat_template)")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="return a chat answer's <think> part as reasoning_content "
                        "(default: off, all of it is content)")
    p.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral"],
                   help="how the model writes tool calls (default: read off its chat "
                        "template, else hermes)")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP server actors sharing the port, for many concurrent streams "
                        "(default: 1)")
    p.add_argument("--no-http", action="store_true",
                   help="no HTTP server: clients reach the coordinator through Ray only")


def serve_options(a: argparse.Namespace) -> dict:
    """The serve flags as `serve_options.build_config` keywords (each flag's dest is one)."""
    return {name: getattr(a, name) for name in SERVE_OPTIONS}


def serve_config(a: argparse.Namespace) -> ServeConfig:
    return build_config(serve_options(a))


def cmd_demo(a: argparse.Namespace) -> int:
    import ray

    cfg = serve_config(a)
    check_startup(cfg)  # a bad model or layout fails here, before Ray starts
    params = parse_params(SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                         seed=0))  # so do bad sampling flags
    connect(None, num_cpus=max(2, cfg.parallel.world_size + 1), log_to_driver=a.verbose)
    coord = start_coordinator(cfg, progress=True)
    t0 = time.perf_counter()
    results = ray.get(coord.generate.remote(DEMO_PROMPTS, params))
    dt = time.perf_counter() - t0
    for prompt, r in zip(DEMO_PROMPTS, results):
        print(f"\n>>> {prompt}\n{prompt}{r.text}")
    n = sum(len(r.token_ids) for r in results)
    print(f"\n{len(results)} requests, {n} tokens in {dt:.2f}s ({n / dt:.0f} tokens/s)")
    ray.get(coord.shutdown.remote())
    ray.shutdown()
    return 0


def listen_port(host: str, port: int) -> int:
    """The HTTP port, checked in the driver before Ray starts: a busy one is one line (exit
    2) at once. Port 0 picks a free one here, so an API server restarted after its process
    died binds the same port."""
    import socket

    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        return s.getsockname()[1]


def cmd_serve(a: argparse.Namespace) -> int:
    import ray
    from ray.exceptions import RayActorError

    if not a.no_http:
        a.port = listen_port(a.host, a.port)
    cfg = serve_config(a)
    check_startup(cfg)  # a bad model or layout fails here, before Ray starts
    template = None
    if a.chat_template and not a.no_http:
        with open(a.chat_template) as f:
            template = f.read()
    if a.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be >= 1, got {a.api_server_count}")
    if a.detach and not a.address:
        raise ConfigError(
            "--detach needs a Ray cluster that outlives this command: start one with "
            "`ray start --head` and pass --address auto (or the head's address)")
    http = None  # checked before anything starts: a bad flag leaves no coordinator behind
    if not a.no_http:
        from raygraph.api.app import HttpConfig

        # a hub id is the name clients know the model by, not its snapshot's directory
        hub_id = a.model if a.model and not os.path.isdir(a.model) else None
        http = HttpConfig(host=a.host, port=a.port, api_key=a.api_key,
                          served_model_name=a.served_model_name or hub_id,
                          chat_template=template,
                          replicas=a.api_server_count, max_request_bytes=a.max_request_bytes,
                          enable_sleep_routes=a.enable_sleep_routes,
                          enable_lora_updates=a.enable_lora_updates,
                          reasoning_parser=a.reasoning_parser,
                          tool_call_parser=a.tool_call_parser)
    addr = connect(a.address, num_cpus=None if a.address else cfg.parallel.world_size + 1,
                   log_to_driver=a.verbose)
    coord = start_coordinator(cfg, detached=a.detach, progress=True)
    print(f"coordinator {cfg.coordinator_name!r} serving {cfg.model} on the Ray cluster at "
          f"{addr}", flush=True)
    print(f"clients: raygraph generate --address {addr} \"The import statement\"; "
          f"stop: raygraph stop --address {addr}"
          + ("" if a.detach else " (or Ctrl-C here)"), flush=True)
    if http is not None:
        from raygraph.api.server import start_http, stop_http

        try:
            servers, url = start_http(http, cfg.coordinator_name, cfg.namespace,
                                      a.detach)  # kept: they live while serve runs
        except BaseException:  # no coordinator left behind that was asked to serve HTTP
            ray.get(coord.shutdown.remote())
            ray.kill(coord)
            raise
        print(f"OpenAI-compatible HTTP server at {url}/v1 (also {url}/health, {url}/metrics)",
              flush=True)
    if a.detach:
        return 0
    try:
        info = ray.get(coord.describe.remote())  # the capture mode as resolved for the device
        report_capture = info["capture"] == "background" and info["graph_mode"] == "graph"
        while True:
            time.sleep(0.5 if report_capture else 2)
            ray.get(coord.ping.remote())
            if report_capture:
                p = ray.get(coord.capture_progress.remote())
                if p["done"]:
                    print(f"capture schedule complete: {p['total']} keys in {p['seconds']}s "
                          f"of capture, {p['complete_after_s']}s after serving started "
                          f"({p['eager_steps']} steps ran eagerly meanwhile)", flush=True)
                    report_capture = False
    except KeyboardInterrupt:
        if not a.no_http:
            stop_http(cfg.coordinator_name, cfg.namespace)
        ray.get(coord.shutdown.remote())
    except RayActorError as e:
        if "killed by `ray.kill`" not in str(e):  # not `raygraph stop` from another shell
            raise ClusterError(f"the coordinator died: {first_line(e)}") from None
        print("coordinator stopped")
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    import ray

    connect(a.address or "auto", log_to_driver=False)
    coord = get_coordinator()
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed, stop=a.stop or [],
                            ignore_eos=a.ignore_eos)
    if a.stream:
        print(a.prompt, end="", flush=True)
        for ref in coord.generate_stream.options(num_returns="streaming").remote(a.prompt, params):
            print(ray.get(ref).text or "", end="", flush=True)
        print()
        return 0
    (r,) = ray.get(coord.generate.remote(a.prompt, params))
    print(a.prompt + (r.text if r.text is not None else str(r.token_ids)))
    return 0


def cmd_check_capture(a: argparse.Namespace) -> int:
    """Run the capture schedule in lockstep on a local cluster, print the per-key table and
    exit non-zero if any key's records disagree (or a rank fails)."""
    import ray

    from raygraph.engine.lockstep import format_table
    from raygraph.errors import last_line

    cfg = serve_config(a)
    check_startup(cfg)  # a bad model or layout fails here, before Ray starts
    cfg = msgspec.structs.replace(
        cfg, graph=msgspec.structs.replace(cfg.graph, mode="graph", capture="lazy"))
    connect(a.address, num_cpus=None if a.address else cfg.parallel.world_size + 1,
            log_to_driver=a.verbose)
    coord = start_coordinator(cfg)
    t0 = time.perf_counter()
    failure = None
    try:
        ray.get(coord.capture_schedule.remote())
    except Exception as e:  # CaptureError, wrapped by Ray
        failure = last_line(e)
    reports = ray.get(coord.capture_report.remote())
    print(format_table(reports))
    print(f"\n{len(reports)} keys on {cfg.parallel.world_size} rank(s) in "
          f"{time.perf_counter() - t0:.1f}s")
    ray.get(coord.shutdown.remote())
    if failure or not all(r.agree for r in reports):
        print(f"raygraph: error: {failure or 'ranks disagree'}", file=sys.stderr)
        return 1
    print("all ranks agree on every key")
    return 0


def cmd_stop(a: argparse.Namespace) -> int:
    import ray

    connect(a.address or "auto", log_to_driver=False)
    coord = get_coordinator()
    ray.get(coord.shutdown.remote())
    ray.kill(coord)
    from raygraph.api.server import stop_http

    if stop_http("raygraph-coordinator", "raygraph"):
        print("HTTP server stopped")
    print("coordinator stopped")
    return 0


def cmd_sleep(a: argparse.Namespace) -> int:
    import ray

    connect(a.address or "auto", log_to_driver=False)
    out = ray.get(get_coordinator().sleep.remote(a.level, not a.no_wait))
    if out.get("already_asleep"):
        print(f"already asleep at level {out['level']}")
    else:
        print(f"asleep at level {out['level']}: released {max(out['bytes']) / 2**20:.1f} MiB "
              f"per rank on {len(out['bytes'])} rank(s) in {out['seconds']:.3f}s; wake: "
              "raygraph wake")
    return 0


def cmd_wake(a: argparse.Namespace) -> int:
    import ray

    connect(a.address or "auto", log_to_driver=False)
    out = ray.get(get_coordinator().wake_up.remote())
    if "bytes" not in out:
        print("cancelled the sleep in progress" if out.get("cancelled_sleep")
              else "already awake")
    else:
        print(f"awake: mapped {max(out['bytes']) / 2**20:.1f} MiB per rank again on "
              f"{len(out['bytes'])} rank(s) in {out['seconds']:.3f}s")
    return 0


def cmd_scale(a: argparse.Namespace) -> int:
    import ray

    connect(a.address or "auto", log_to_driver=False)
    out = ray.get(get_coordinator().scale.remote(a.replicas))
    print(f"{out['replicas']} replica(s) (was {out['was']}), {out['serving']} serving")
    return 0


def cmd_submit(a: argparse.Namespace) -> int:
    """`ray job submit` of deploy/job.py. Ray's job CLI sends the auth token only when
    RAY_AUTH_MODE=token; set it when this machine holds a token (a cluster without auth
    ignores it), as `connect` does for the other clients."""
    import shutil
    import subprocess

    env = dict(os.environ)
    if "RAY_AUTH_MODE" not in env and auth_token_available():
        env["RAY_AUTH_MODE"] = "token"
    local = os.path.join(os.path.dirname(sys.executable), "ray")
    ray_bin = local if os.path.exists(local) else shutil.which("ray") or "ray"
    args = a.serve_args[1:] if a.serve_args[:1] == ["--"] else a.serve_args
    cmd = [ray_bin, "job", "submit", "--address", a.address, "--working-dir", a.working_dir,
           "--", a.python, "deploy/job.py", *args]
    return subprocess.run(cmd, env=env).returncode


# bad input (exit 2): the request or configuration cannot work as given
BAD_INPUT: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError,
                                              NotADirectoryError, OffloadBudgetError,
                                              msgspec.ValidationError)


def explain(err: BaseException) -> tuple[int, str]:
    """(exit code, one line) for an error, looking through Ray's wrappers to the cause."""
    from ray.exceptions import RayActorError

    err = remote_cause(err)
    if isinstance(err, RayActorError):  # the cause survives only as its traceback text
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        causes = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception"))]
        return 1, causes[-1] if causes else lines[0]
    code = 2 if isinstance(err, BAD_INPUT) else 1
    if isinstance(err, (ConfigError, ClusterError, BadRequest, Busy, Asleep)) or code == 2:
        return code, first_line(err)
    return code, f"{type(err).__name__}: {first_line(err)}"


class OneLineParser(argparse.ArgumentParser):
    """argparse that says a usage error in one line (`raygraph: error: ...`, exit 2), as
    every other error is said; `--help` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"raygraph: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="raygraph", description="LLM serving on GPUs with Ray, in graph mode.")
    parser.add_argument("--version", action="version", version=f"raygraph {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show tracebacks and the workers' logs")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="serve the built-in model locally and generate")
    add_serve_args(demo)
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens per prompt (default: 48)")
    demo.add_argument("--temperature", type=float, default=0.0,
                      help="0 is greedy (default: 0.0)")
    serve = sub.add_parser("serve", help="start the named coordinator and its OpenAI-compatible "
                           "HTTP server on a Ray cluster")
    add_serve_args(serve)
    serve.add_argument("--address", default=None,
                       help="Ray cluster to join ('auto': the local one) (default: start a "
                            "private one that lives as long as this command)")
    serve.add_argument("--detach", action="store_true",
                       help="leave the coordinator serving on the cluster and exit "
                            "(needs --address)")
    add_http_args(serve)
    gen = sub.add_parser("generate", help="a client: send a prompt to the running coordinator")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--address", default=None,
                     help="the Ray address `raygraph serve` printed (default: auto, the "
                          "local cluster)")
    gen.add_argument("--max-tokens", type=int, default=48, help="tokens to generate (default: 48)")
    gen.add_argument("--temperature", type=float, default=None,
                     help="0 is greedy (default: the model's generation_config.json, else 0)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="nucleus sampling (default: the model's, else 1.0)")
    gen.add_argument("--top-k", type=int, default=None,
                     help="0 is off (default: the model's, else 0)")
    gen.add_argument("--seed", type=int, default=None, help="per-request seed (default: none)")
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="stop string, repeatable (default: none)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    check = sub.add_parser("check-capture",
                           help="capture the schedule in lockstep and check the ranks agree")
    add_serve_args(check)
    check.add_argument("--address", default=None,
                       help="Ray cluster to join (default: a private local one)")
    job = sub.add_parser("submit", help="submit the serving job to a Ray cluster (`ray job "
                         "submit` of deploy/job.py, with this machine's auth token if any)")
    job.add_argument("--address", required=True,
                     help="the cluster's dashboard address, e.g. http://HEAD:8265")
    job.add_argument("--working-dir", default=".",
                     help="the raygraph checkout uploaded with the job (default: .)")
    job.add_argument("--python", default="python",
                     help="the Python that runs the job on the cluster (default: python)")
    job.add_argument("serve_args", nargs=argparse.REMAINDER,
                     help="`-- raygraph serve` flags for the job, e.g. -- --model DIR --tp 8")
    stop = sub.add_parser("stop", help="shut the named coordinator down")
    stop.add_argument("--address", default=None,
                      help="the Ray address `raygraph serve` printed (default: auto)")
    nap = sub.add_parser("sleep", help="release the workers' memory (graphs stay captured)")
    nap.add_argument("--level", type=int, choices=[1, 2], default=1,
                     help="1: graph pool and KV cache; 2: the weights too, to host memory "
                          "(default: 1)")
    nap.add_argument("--no-wait", action="store_true",
                     help="refuse if requests are in flight instead of letting them finish")
    nap.add_argument("--address", default=None,
                     help="the Ray address `raygraph serve` printed (default: auto)")
    wake = sub.add_parser("wake", help="map the workers' memory back and serve again")
    wake.add_argument("--address", default=None,
                      help="the Ray address `raygraph serve` printed (default: auto)")
    scale = sub.add_parser("scale", help="run N replicas of the model: start new ones, or "
                           "drain and stop the highest-numbered")
    scale.add_argument("replicas", type=int)
    scale.add_argument("--address", default=None,
                       help="the Ray address `raygraph serve` printed (default: auto)")
    a = parser.parse_args(argv)
    handlers = {"demo": cmd_demo, "serve": cmd_serve, "generate": cmd_generate,
                "check-capture": cmd_check_capture, "submit": cmd_submit, "stop": cmd_stop,
                "sleep": cmd_sleep, "wake": cmd_wake, "scale": cmd_scale}
    try:
        return handlers[a.cmd](a)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if a.verbose:
            traceback.print_exc()
        code, line = explain(e)
        print(f"raygraph: error: {line}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
