"""raygraph: LLM serving on GPUs with Ray, in graph mode."""

__version__ = "0.1.0"
