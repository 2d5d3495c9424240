"""raygraph: LLM serving on GPUs with Ray, in graph mode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raygraph.protocol import SamplingParams, StructuredOutputs

if TYPE_CHECKING:
    from raygraph.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]


def __getattr__(name: str) -> Any:
    """`raygraph.LLM`, imported when first asked for: it brings Ray and torch, which a
    worker or a client of the protocol alone does not want at `import raygraph`."""
    if name == "LLM":
        from raygraph.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
