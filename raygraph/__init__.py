"""raygraph: LLM serving on GPUs with Ray, in graph mode."""

from __future__ import annotations

import gc
import logging
import os
from typing import TYPE_CHECKING, Any

from raygraph.protocol import SamplingParams

if TYPE_CHECKING:
    from raygraph.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    """`raygraph.LLM`, imported when first asked for: it brings Ray and torch, which a
    worker or a client of the protocol alone does not want at `import raygraph`."""
    if name == "LLM":
        from raygraph.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    Called by the coordinator, each worker and each HTTP server once start-up is over."""
    gc.collect()
    gc.freeze()
