"""raygraph: LLM serving on GPUs with Ray, in graph mode."""

import logging
import os

__version__ = "0.1.0"


def setup_logging() -> None:
    """INFO for raygraph's loggers in a Ray actor's process (the coordinator and each worker:
    load, graph budget and memory facts); a no-op where logging is already configured.
    RAYGRAPH_LOG_LEVEL=DEBUG adds per-key capture lines."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("raygraph").setLevel(os.environ.get("RAYGRAPH_LOG_LEVEL", "INFO"))
