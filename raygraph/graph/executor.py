"""The executor seam: the worker hands it a Batch and gets logits back.

Eager is the reference and is always available; graph executors plug in behind the same
interface (chosen by `make_executor` from GraphConfig).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from raygraph.config import GraphConfig
from raygraph.graph.inputs import Batch
from raygraph.model.context import forward_context
from raygraph.model.llama import LlamaForCausalLM


class Executor(ABC):
    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model

    @abstractmethod
    def hidden_states(self, batch: Batch) -> torch.Tensor:
        """Final hidden states [T, hidden] for every token of the batch."""

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        """Float32 logits [S, vocab] at the batch's sampling rows."""
        hidden = self.hidden_states(batch)
        return self.model.compute_logits(hidden[batch.sample_idx]).float()


class EagerExecutor(Executor):
    def hidden_states(self, batch: Batch) -> torch.Tensor:
        with forward_context(batch.ctx):
            return self.model(batch.input_ids, batch.positions)


def make_executor(cfg: GraphConfig, model: LlamaForCausalLM) -> Executor:
    if cfg.mode == "eager":
        return EagerExecutor(model)
    raise ValueError(f"unknown graph mode {cfg.mode!r}")
