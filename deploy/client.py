"""A client: connect to the Ray cluster by address, find the coordinator by name, generate.

    python deploy/client.py --address HEAD:6379 "The import statement"
"""

from __future__ import annotations

import argparse

import ray

from raygraph.client.connect import connect, get_coordinator
from raygraph.protocol import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("prompts", nargs="+")
    p.add_argument("--address", default="auto")
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    connect(a.address)  # finds this machine's Ray auth token if the cluster needs one
    coord = get_coordinator()
    params = SamplingParams(max_tokens=a.max_tokens)
    # one call with every prompt: they are batched together on the cluster
    for prompt, r in zip(a.prompts, ray.get(coord.generate.remote(a.prompts, params))):
        print(f"{prompt}{r.text}  [{len(r.token_ids)} tokens, {r.finish_reason}]")
    # streaming: tokens as they are produced
    stream = coord.generate_stream.options(num_returns="streaming").remote(a.prompts[0], params)
    print("stream:", "".join(ray.get(ref).text or "" for ref in stream))


if __name__ == "__main__":
    main()
