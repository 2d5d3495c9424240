"""Process-wide set-up shared by raygraph's long-lived processes: the coordinator, each
engine, each worker, each HTTP server, and a load client. Imports nothing of raygraph, so any
layer can call it."""

from __future__ import annotations

import gc
import logging
import os


def setup_logging() -> None:
    """INFO for raygraph's loggers in a Ray actor's process (the coordinator and each worker:
    load, graph budget and memory facts); a no-op where logging is already configured.
    RAYGRAPH_LOG_LEVEL=DEBUG adds per-key capture lines."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("raygraph").setLevel(os.environ.get("RAYGRAPH_LOG_LEVEL", "INFO"))


def freeze_heap() -> None:
    """Start-up's objects never need collecting: move them out of the collector's reach, so a
    full collection walks only what serving allocated since. In a process holding torch and
    Ray one takes ~100 ms, and every step or stream the process serves waits for it.
    Called by each engine, each worker and each HTTP server once start-up is over."""
    gc.collect()
    gc.freeze()
