"""The proposer of a sequence whose drafts come from the workers' draft model (speculative
method "draft", worker/drafter.py): the workers propose the k tokens after a sequence's
newest token in the step that computed it, and return them with it; the scheduler sends
them to verify in the sequence's next step. NgramIndex's interface (engine/ngram.py)."""

from __future__ import annotations

from collections.abc import Iterable


class ModelDrafts:
    """One sequence's latest proposal from the workers."""

    asks = True  # its chunks ask the workers for drafts (SeqStep.propose)

    def __init__(self) -> None:
        self.drafts: list[int] = []

    def extend(self, tokens: Iterable[int]) -> None:
        """Its new tokens: a proposal follows only the token it came back with, so one kept
        from before them is stale (the proposal that comes with them is offered next)."""
        self.drafts = []

    def offer(self, drafts: list[int]) -> None:
        """The proposal that came back with its newest token."""
        self.drafts = drafts

    def propose(self, k: int) -> list[int]:
        """Up to k drafts after its newest token, once (none: nothing proposed since)."""
        drafts, self.drafts = self.drafts[:k], []
        return drafts
