"""A worker's grammar matchers: the masks its constrained rows sample under, filled on the
host while the step's forward runs on the device.

The served loop queues step N before step N-1's tokens are on the host, and a constrained
row's mask in step N depends on its token of step N-1; the forward does not. So the worker
queues step N's forward first, then reads step N-1's tokens (that step ended before N's
forward began), moves each constrained sequence's matcher past its token, fills the masks
of step N's constrained rows and queues their upload and the sampling behind the forward.
A constrained row samples every step and no row waits: the host's work hides under the
forward. The mask is applied after the captured graph, not inside it: it exists only once
the graph is running.

Every rank that samples keeps the same matchers (their rows draw the same tokens). A
sequence's grammar compiles on a thread when the sequence is first tracked (cached per
spec) and is waited for only when its first mask is needed; one that fails to build (the
engine checked it, so it should not) allows only EOS, which ends that sequence alone.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from raygraph.grammar import Guide, LazyGrammars, fill_masks
from raygraph.protocol import NewSeq, SeqChunk, StepDelta
from raygraph.tokenizer import load_tokenizer


class Guides:
    """The matchers of the constrained sequences this worker tracks, by sequence id."""

    def __init__(self, tokenizer_dir: str, max_rows: int, device: torch.device) -> None:
        self._grammars = LazyGrammars(lambda: load_tokenizer(tokenizer_dir))
        self._pool: ThreadPoolExecutor | None = None
        self._guides: dict[int, Future[Guide | None]] = {}
        self.max_rows = max_rows
        self.device = device
        # staging (pinned) and device buffers: masks [max_rows, words] int32, row indices
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._host_rows: torch.Tensor | None = None
        self._dev_rows: torch.Tensor | None = None
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._shifts = torch.arange(8, dtype=torch.uint8, device=device)

    def apply(self, delta: StepDelta) -> None:
        """Forget the dropped sequences and start building the new constrained ones'."""
        for seq_id in delta.drop:
            self._guides.pop(seq_id, None)
        for n in delta.new:
            self._guides.pop(n.seq_id, None)
            if n.structured is not None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                self._guides[n.seq_id] = self._pool.submit(self._build, n)

    def _build(self, n: NewSeq) -> Guide | None:
        try:
            guide = self._grammars.get().guide(n.structured)
        except Exception:  # the engine compiled it: this is not the request's fault alone
            return None
        for token in n.replay:  # readmitted after preemption: back where it was
            guide.accept(token)
        return guide

    def rows(self, chunks: list[SeqChunk]) -> list[tuple[int, int]]:
        """(row, seq id) of the sampling chunks that follow a grammar."""
        if not self._guides:
            return []
        return [(i, c.seq_id) for i, c in enumerate(chunks) if c.seq_id in self._guides]

    def accept(self, rows: list[tuple[int, int]], tokens: list[int]) -> None:
        """Move the matchers past a step's tokens (row i: tokens[i])."""
        for i, seq_id in rows:
            future = self._guides.get(seq_id)
            guide = future.result() if future is not None else None
            if guide is not None:
                guide.accept(tokens[i])

    def masks(self, rows: list[tuple[int, int]], vocab: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(row indices [R], allowed [R, vocab] bool) on the device: the tokens each row may
        sample. Both go through pinned buffers, without a host sync on CUDA; the mask's
        words are unpacked on the device (tokens past the grammar's vocabulary: not
        allowed)."""
        guides = [self._guides[seq_id].result() for _, seq_id in rows]
        grammars = self._grammars.get()
        if self._host is None:
            cuda = self.device.type == "cuda"
            words = -(-grammars.vocab // 32)
            self._host = torch.zeros(self.max_rows, words, dtype=torch.int32, pin_memory=cuda)
            self._dev = torch.zeros_like(self._host, device=self.device)
            self._host_rows = torch.zeros(self.max_rows, dtype=torch.long, pin_memory=cuda)
            self._dev_rows = torch.zeros_like(self._host_rows, device=self.device)
        if self._copied is not None:
            self._copied.synchronize()  # the last upload has read the staging rows
        n = len(rows)
        self._host_rows[:n] = torch.tensor([i for i, _ in rows])
        fill_masks(guides, self._host[:n].numpy(), grammars.eos)
        sel, dev = self._dev_rows[:n], self._dev[:n]
        sel.copy_(self._host_rows[:n], non_blocking=True)
        dev.copy_(self._host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        # little-endian words as bytes, then bits: bit t of the row is token t
        bits = ((dev.view(torch.uint8).unsqueeze(-1) >> self._shifts) & 1).view(n, -1).bool()
        if bits.shape[1] < vocab:
            bits = torch.cat([bits, bits.new_zeros(n, vocab - bits.shape[1])], dim=1)
        return sel, bits[:, :vocab]
