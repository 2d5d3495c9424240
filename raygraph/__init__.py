"""raygraph: LLM serving on GPUs with Ray, in graph mode."""

import logging

__version__ = "0.1.0"


def setup_logging() -> None:
    """INFO for raygraph's loggers in a Ray actor's process (the coordinator and each worker:
    load, graph budget and memory facts); a no-op where logging is already configured."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
