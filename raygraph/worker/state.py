"""What a worker keeps per sequence (vLLM v1's cached request state), so a step's message
carries only what changed: new sequences, appended blocks, dropped ids, the chunks."""

from __future__ import annotations

from dataclasses import dataclass

from raygraph.protocol import NewSeq, SeqChunk, StepDelta, StepPlan


class StateError(RuntimeError):
    """A message that does not fit the state this worker keeps (a coordinator bug)."""


@dataclass
class _Seq:
    params: NewSeq
    blocks: list[int]
    num_computed: int
    num_generated: int  # outputs before its next chunk's: its seed stream's index
    drafts: int = 0  # drafts its last chunk verified; the next one says how many were kept


class SeqTable:
    """Per-sequence state of one DP group; every TP rank of the group keeps the same."""

    def __init__(self) -> None:
        self.seqs: dict[int, _Seq] = {}
        self.sampled_rows: dict[int, int] = {}  # seq id -> row of the last step's tokens
        self.logprob_seqs = 0  # tracked sequences that want logprobs (0: steps skip them)

    def apply(self, d: StepDelta) -> StepPlan:
        """Update the state and return the step as the executor runs it."""
        seqs = self.seqs
        for seq_id in d.drop:
            s = seqs.pop(seq_id, None)
            if s is not None and s.params.logprobs >= 0:
                self.logprob_seqs -= 1
        for n in d.new:
            seqs[n.seq_id] = _Seq(n, [], n.num_computed, n.num_generated)
            self.logprob_seqs += n.logprobs >= 0
        try:
            for seq_id, block in d.blocks:
                seqs[seq_id].blocks.append(block)
            rows = self.sampled_rows
            chunks = [self._chunk(seq_id, [0], True, rows[seq_id]) for seq_id in d.feed]
            for c in d.chunks:
                s = seqs[c.seq_id]
                s.num_computed -= c.forget
                s.num_generated += s.drafts - c.forget  # its kept drafts were outputs too
                s.drafts = 0
            chunks += [self._chunk(c.seq_id, c.token_ids, c.sample, -1, c.verify, c.propose,
                                   c.next_token) for c in d.chunks]
        except KeyError as e:
            raise StateError(f"step {d.step_id}: sequence {e.args[0]} is not tracked here "
                             "(or sampled nothing last step)") from None
        self.sampled_rows = {c.seq_id: r for r, c in enumerate(c for c in chunks if c.sample)}
        return StepPlan(d.step_id, chunks, d.key, d.num_comm_tokens)

    def _chunk(self, seq_id: int, tokens: list[int], sample: bool, feed: int,
               verify: int = 0, propose: bool = False, next_token: int = -1) -> SeqChunk:
        s = self.seqs[seq_id]
        start, gen = s.num_computed, s.num_generated
        s.num_computed += len(tokens)
        s.num_generated += sample
        s.drafts = verify if sample else 0
        p = s.params
        # NOTE: the chunk shares the table's live block list; a plan is consumed before the
        # next delta can append to it
        return SeqChunk(seq_id, tokens, start, s.blocks, sample, p.temperature, p.top_k,
                        p.top_p, p.seed, gen, feed, p.logprobs, p.lora_slot, verify, propose,
                        next_token)
