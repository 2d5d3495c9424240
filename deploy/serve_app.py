"""The HTTP front door as a Ray Serve app, over a coordinator already serving on the cluster
(UNTESTED: Ray Serve is not a raygraph dependency; `pip install "ray[serve]"` first).

    raygraph serve --address auto --detach --no-http    # the coordinator
    serve run deploy.serve_app:app                       # from the repository root

Every replica builds the same FastAPI app as `raygraph serve` (raygraph.api.app.build_app)
over the coordinator found by name; replicas share it: the global counters come from it,
the request histograms are each replica's own. Settings from the environment:
RAYGRAPH_COORDINATOR (default raygraph-coordinator), RAYGRAPH_API_KEY,
RAYGRAPH_SERVED_MODEL_NAME, RAYGRAPH_CHAT_TEMPLATE (a file on the replicas' nodes),
RAYGRAPH_HTTP_REPLICAS (default 1), RAYGRAPH_MAX_REQUEST_BYTES (default 16 MiB),
RAYGRAPH_ENABLE_SLEEP_ROUTES=1 and RAYGRAPH_ENABLE_LORA_UPDATES=1 (the operator routes, off
by default as in `raygraph serve`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

try:
    from ray import serve
except ImportError as e:  # Ray without its Serve extra
    raise SystemExit(f"Ray Serve is not installed ({e}): pip install 'ray[serve]'") from None


def build():  # runs on each replica
    from raygraph.api.app import HttpConfig, build_app
    from raygraph.client.connect import get_coordinator

    env = os.environ.get
    template = env("RAYGRAPH_CHAT_TEMPLATE")
    cfg = HttpConfig(api_key=env("RAYGRAPH_API_KEY"),
                     served_model_name=env("RAYGRAPH_SERVED_MODEL_NAME"),
                     chat_template=Path(template).read_text() if template else None,
                     max_request_bytes=int(env("RAYGRAPH_MAX_REQUEST_BYTES",
                                               str(HttpConfig().max_request_bytes))),
                     enable_sleep_routes=env("RAYGRAPH_ENABLE_SLEEP_ROUTES") == "1",
                     enable_lora_updates=env("RAYGRAPH_ENABLE_LORA_UPDATES") == "1")
    return build_app(get_coordinator(env("RAYGRAPH_COORDINATOR", "raygraph-coordinator")), cfg)


@serve.deployment(num_replicas=int(os.environ.get("RAYGRAPH_HTTP_REPLICAS", "1")),
                  ray_actor_options={"num_cpus": 0})
@serve.ingress(build)
class RaygraphHttp:
    """Routes come from `build`'s app; nothing else lives here."""


app = RaygraphHttp.bind()
