"""N-gram prompt lookup: a speculative proposer with no model. The tokens that followed the
latest earlier occurrence of a sequence's last n tokens (the longest n that occurred
before, from `max_n` down to `min_n`) are its guess at what comes next: code edits, quotes
and structured output repeat their context often.

Each sequence keeps an index of its n-grams' latest end positions, extended as its tokens
arrive, so a proposal costs O(max_n) whatever the context's length.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One sequence's tokens (prompt, then outputs as they are accepted) and n-grams."""

    asks = False  # proposes on the coordinator: its chunks ask the workers for nothing

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end index, latest occurrence
        self._match = -1  # end index of the latest earlier occurrence of the current suffix

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._append(token)

    def _append(self, token: int) -> None:
        toks = self.tokens
        toks.append(token)
        end = len(toks) - 1
        self._match = -1
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):  # longest first
            key = tuple(toks[end - n + 1:])
            if self._match < 0:
                self._match = self._last.get(key, -1)
            self._last[key] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens: what followed the matched n-gram last time (none: no match)."""
        if self._match < 0 or k <= 0:
            return []
        return self.tokens[self._match + 1: self._match + 1 + k]
