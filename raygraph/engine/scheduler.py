"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.
Pure Python.

Every step spends a token budget: running sequences first (decode = 1 token, or the next
chunk of a long prompt), then waiting ones in arrival order. A sequence is admitted with the
cached blocks of its prefix (engine/kv_cache.py), including blocks earlier chunks of the same
step compute, and computes from the first token they do not hold. When blocks run out the
most recently admitted running sequence is preempted: its blocks are released (full ones stay
cached) and it goes back to the front of the queue to recompute prompt + output so far, from
what is still cached.

The served loop sends step N+1 before step N's tokens are back, so a sequence may have one
token *pending*: sampled on the workers, unknown here. Its next decode is sent as "feed"
(the workers use the token they hold on the device); stop conditions are applied when the
token arrives, one step later, and a token computed past a stop is discarded. Limits known
in advance (max_tokens, the context) are never overshot: such a sequence is not scheduled.

A sequence with a grammar (raygraph/grammar.py) is scheduled like any other: the workers
keep its matcher and fill its mask once its pending token is on their host, while the
step's forward runs (worker/guides.py). Its matcher here, a step behind, ends it when the
grammar is complete.

A sequence with a proposer (speculative decoding: an n-gram index, engine/ngram.py, or the
workers' draft model, engine/drafts.py) is sent, once its last token is known, with the
drafts proposed after it: the workers return the drafts their greedy tokens agree with and
the token after them (one to k + 1 tokens), and a draft model's next proposal with them. Its
drafts need its last token, so it sits out the step in which that token is in flight. A
verify step in flight returns one to k + 1 tokens, so no feed can follow it: the sequence
sits out the next step even when drafts are off for it (speculative_max_batch reached).
Where half the running sequences would sit out, the loop may collect the step in flight
before scheduling instead (`num_awaiting`, EngineCore.step), so they all run in the next.

Each step is described as a change to what the workers hold (new sequences, appended
blocks, dropped ids), so its message and cost grow with what changed, not with the batch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from raygraph.engine.kv_cache import KVCacheManager
from raygraph.engine.pages import PagePool
from raygraph.engine.sequence import Sequence
from raygraph.protocol import FinishReason, NewSeq, SeqStep, TokenLogprobs

# a speculating sequence stops once this many of its drafts kept under this share, or after
# this many steps in a row without a proposal: it would lose more overlap than it gains
SPEC_TRIAL_DRAFTS, SPEC_MIN_KEPT, SPEC_MAX_MISSES = 16, 0.25, 8


@dataclass
class SchedulerOutput:
    """One step of one scheduler: the batch is `feed` then `chunks`, in that order."""

    feed: list[Sequence]  # decode the token each sampled last step (on the workers)
    chunks: list[tuple[Sequence, SeqStep]]  # tokens sent explicitly
    new: list[NewSeq]
    blocks: list[tuple[int, int]]
    drop: list[int]
    preempted: list[Sequence]
    num_tokens: int
    num_drafts: int = 0  # draft tokens sent to verify (each one more logits row)

    @property
    def num_seqs(self) -> int:
        return len(self.feed) + len(self.chunks)

    @property
    def decode(self) -> bool:
        """Every sequence computes one token, or one and the drafts it verifies (the graph
        executor's decode phase: graph/buckets.drafts_as_rows)."""
        return self.num_tokens == self.num_seqs + self.num_drafts

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences whose tokens this step returns, in order."""
        return self.feed + [seq for seq, c in self.chunks if c.sample]


class Scheduler:
    def __init__(
        self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int,
        max_model_len: int, eos_token_ids: tuple[int, ...] = (), prefix_caching: bool = True,
        num_speculative_tokens: int = 0, speculative_max_batch: int = 0,
    ) -> None:
        self.pool = pool
        self.kv = KVCacheManager(pool, prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.num_speculative_tokens = num_speculative_tokens  # drafts a verify step at most
        self.speculative_max_batch = speculative_max_batch  # no drafts from this batch (0: any)
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculative decoding's totals
        self.num_drafts = 0  # verify chunks (each one sequence's drafts of a step)
        self.accepted_per_pos = [0] * num_speculative_tokens  # drafts kept at each place
        self._speculate = False  # this step sends drafts (and asks the workers for them)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._drop: list[int] = []  # tracked sequences to forget with the next step
        # Prompt blocks are keyed as a step fills them, so a burst sharing a system prompt
        # computes it once, in the step that admits the first of them, and the others join
        # that same step. That is safe because a step with a chunk of more than one token
        # runs the prefill path, which stores every row's K/V before any row attends in each
        # layer (ops.paged_attention). In a decode step the rows store and attend in
        # parallel, so blocks a one-token chunk fills wait here until the step is planned.
        self._filled: list[Sequence] = []

    def check_prompt(self, num_tokens: int) -> None:
        """Refuse a prompt that leaves no room for one generated token."""
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_tokens} tokens; the context holds {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )

    def add(self, seq: Sequence) -> None:
        self.check_prompt(seq.num_tokens)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq_id: int) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._release(seq, "abort")
                    return seq
        return None

    def schedule(self) -> SchedulerOutput | None:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], [], [], [], self._drop, [], 0)
        self._drop = []
        feed, bs, max_len = out.feed, self.kv.block_size, self.max_model_len
        speculate = self._speculate = self._speculating()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if seq.proposer is not None:
                if seq.drafts:
                    continue  # verifying: 1 to k + 1 tokens come back, no feed can follow
                if speculate and self._rows_free(out):
                    if seq.num_pending:
                        continue  # its drafts follow the token in flight: next step
                    drafts = self._drafts(seq, budget, out)
                    if drafts:
                        if not self._reserve(seq, 1 + len(drafts), out):
                            break
                        budget -= 1 + len(drafts)
                        self._take_drafts(seq, drafts, out)
                        continue
            if seq.num_pending:  # decode the token in flight: the common case, kept lean
                outputs = len(seq.output_token_ids) + seq.num_pending
                if (outputs >= seq.params.max_tokens
                        or len(seq.prompt_token_ids) + outputs >= max_len):
                    continue  # finishes when its last token arrives
                if seq.num_computed < len(seq.block_table) * bs:  # room in its last block
                    feed.append(seq)
                    seq.num_computed += 1
                    seq.num_pending += 1
                    budget -= 1
                    continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._reserve(seq, n, out):
                break  # seq itself was preempted (it was the last one running)
            budget -= n
            self._take(seq, n, out)
        computing: set[int] = set()  # first blocks computed by the sequences admitted now
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) + out.num_drafts < self.max_num_seqs):
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted with a token in flight: readmitted once it is known
            hits = self.kv.match(seq)
            miss = self.kv.first_miss(seq, hits)
            if miss in computing:
                # its next block is being computed by one admitted in this step but is not
                # keyed yet (the chunk ends inside it): admitted next step, it finds that
                # block cached instead of computing it again
                break
            cached = len(hits) * bs
            n = min(seq.num_tokens - cached, budget)
            if not self.kv.admit(seq, hits, self.kv.blocks_for(cached + n) - len(hits)):
                break
            if miss is not None:
                computing.add(miss)
            self.waiting.popleft()
            self.running.append(seq)
            budget -= n
            self._take(seq, n, out)
        if self._filled:
            for seq in self._filled:
                self.kv.commit(seq)
            self._filled.clear()
        if not feed and not out.chunks:
            self._drop = out.drop + self._drop  # nothing to send them with yet
            return None
        out.num_tokens += len(feed)
        return out

    def _speculating(self) -> bool:
        """Whether a step scheduled now sends drafts (speculative_max_batch not reached)."""
        return self.num_speculative_tokens > 0 and (
            not self.speculative_max_batch or len(self.running) < self.speculative_max_batch)

    def num_awaiting(self) -> int:
        """About how many running sequences would sit out a step scheduled now, waiting on
        the one in flight (a verify step's tokens, or the token their drafts follow; the
        latter only where a draft has a logits row: none is left once max_num_seqs run, and
        the rows the step's own drafts take are not foreseen); 0 while a waiting sequence
        may be admitted (its prefill is work for the step)."""
        if not self.num_speculative_tokens or (self.waiting
                                               and len(self.running) < self.max_num_seqs):
            return 0
        speculate = self._speculating() and len(self.running) < self.max_num_seqs
        return sum(1 for s in self.running if s.proposer is not None
                   and (s.drafts or speculate and s.num_pending))

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Put n tokens of seq into the step and account for them."""
        if not seq.tracked:
            p = seq.params.resolved()  # fields still None (not through the coordinator)
            guided = seq.guide is not None
            out.new.append(NewSeq(seq.seq_id, p.temperature, p.top_k, p.top_p, p.seed,
                                  len(seq.output_token_ids),
                                  -1 if p.logprobs is None else p.logprobs, seq.num_computed,
                                  seq.lora_slot, p.structured if guided else None,
                                  list(seq.output_token_ids) if guided else []))
            seq.tracked = True
            if not seq.scheduled_at:
                seq.scheduled_at = time.perf_counter()
        if seq.sent_blocks < len(seq.block_table):
            out.blocks += ((seq.seq_id, b) for b in seq.block_table[seq.sent_blocks:])
            seq.sent_blocks = len(seq.block_table)
        start = seq.num_computed
        sample = start + n == seq.num_tokens
        seq.num_computed += n
        seq.num_pending += sample
        # a prompt's blocks are keyed as they fill, for the requests that share it; blocks
        # of outputs when the sequence releases them (only its own recompute or a later
        # request with its output in the prompt can use those), so a decode never pays here
        if (start < len(seq.prompt_token_ids) and self.kv.prefix_caching
                and seq.num_computed >= (seq.num_keyed + 1) * self.pool.page_size):
            if n > 1:  # keyed now: sequences admitted after it in this step read them
                self.kv.commit(seq)
            else:
                self._filled.append(seq)
        if seq.num_pending > sample:  # n == 1: the pending token is the one to compute
            out.feed.append(seq)
            return  # counted with the other feeds
        drafted = seq.proposer is not None and seq.proposer.asks
        # a chunk that ends inside the known tokens: a drafter reading the token after
        # each position (an EAGLE-3 head) is told the one after its last
        after = (seq.token_slice(start + n, 1)[0]
                 if drafted and not sample and start + n < len(seq.token_ids) else -1)
        out.chunks.append((seq, SeqStep(seq.seq_id, seq.token_slice(start, n), sample,
                                        forget=seq.forget,
                                        propose=sample and self._asks(seq, out),
                                        next_token=after)))
        seq.forget = 0
        out.num_tokens += n

    def _drafts(self, seq: Sequence, budget: int, out: SchedulerOutput) -> list[int]:
        """What seq's n-gram index proposes after its last token, if it is decoding: never
        past max_tokens or the context (a step emits at most drafts + 1 tokens), the step's
        token budget, or max_num_seqs logits rows in all (a row per sequence and draft)."""
        p = seq.params
        if seq.num_computed != seq.num_tokens - 1:
            return []  # still in its prompt (or recomputing)
        room = min(self.num_speculative_tokens, budget - 1,
                   self.max_num_seqs - len(self.running) - out.num_drafts,
                   p.max_tokens - len(seq.output_token_ids) - 1,
                   self.max_model_len - seq.num_tokens - 1)
        drafts = seq.proposer.propose(room) if room > 0 else []
        # a draft model proposes with every token it is asked after: none means not asked
        seq.spec_misses = 0 if drafts or seq.proposer.asks else seq.spec_misses + 1
        if seq.spec_misses >= SPEC_MAX_MISSES:
            seq.proposer = None  # decodes as usual from now on
        return drafts

    def _take_drafts(self, seq: Sequence, drafts: list[int], out: SchedulerOutput) -> None:
        """seq's last token and its drafts into the step, to verify."""
        if seq.sent_blocks < len(seq.block_table):
            out.blocks += ((seq.seq_id, b) for b in seq.block_table[seq.sent_blocks:])
            seq.sent_blocks = len(seq.block_table)
        start = seq.num_computed
        seq.num_computed += 1 + len(drafts)  # until the result says how many were kept
        seq.num_pending += 1
        seq.drafts = len(drafts)
        out.chunks.append((seq, SeqStep(seq.seq_id, seq.token_slice(start, 1) + drafts, True,
                                        len(drafts), seq.forget, seq.proposer.asks)))
        seq.forget = 0
        out.num_tokens += 1 + len(drafts)
        out.num_drafts += len(drafts)

    def _asks(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Whether seq's chunk that samples asks the workers' draft model for drafts."""
        return (self._speculate and seq.proposer is not None and seq.proposer.asks
                and self._rows_free(out))

    def _rows_free(self, out: SchedulerOutput) -> bool:
        """Whether a draft still has a logits row in this step (max_num_seqs in all): where
        none has, a speculating sequence decodes as usual, never sitting out for drafts."""
        return len(self.running) + out.num_drafts < self.max_num_seqs

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Make room for n more tokens of seq, preempting from the back of the running list."""
        # <= 0: it holds them already (blocks taken for drafts it did not keep)
        need = self.kv.blocks_for(seq.num_computed + n) - len(seq.block_table)
        if need <= 0:
            return True
        while need > self.pool.num_free and need > self.pool.num_available:
            victim = self.running.pop()
            self._preempt(victim, out)
            out.preempted.append(victim)
            if victim is seq:
                return False
        seq.block_table += self.kv.allocate(need, seq.seq_id)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.release(seq)  # not in self._filled: see the NOTE below
        seq.num_computed = seq.sent_blocks = seq.forget = 0
        seq.num_preemptions += 1
        if seq.tracked:  # NOTE: never in this step yet: victims come from the back of running
            out.drop.append(seq.seq_id)
            seq.tracked = False
        self.waiting.appendleft(seq)

    def update(self, out: SchedulerOutput, sampled: list[int],
               logprobs: dict[int, TokenLogprobs] | None = None,
               counts: list[int] | None = None,
               drafts: dict[int, list[int]] | None = None) -> list[tuple[Sequence, int]]:
        """Apply one step's tokens (one per `out.sampled`, in order; with `counts`, that
        many each: a verifying sequence's kept drafts and next token), the logprobs of the
        rows that asked and the draft model's proposals (by row, after each row's tokens);
        returns the (seq, token) pairs to emit. A token past a stop is discarded; finished
        sequences leave."""
        new = (self._update_verified(out, sampled, counts) if counts
               else self._update(out, sampled, logprobs))
        for row, proposal in (drafts or {}).items():
            seq = out.sampled[row]
            if seq.finish_reason is None and seq.proposer is not None:
                seq.proposer.offer(proposal)
        return new

    def _update(self, out: SchedulerOutput, sampled: list[int],
                logprobs: dict[int, TokenLogprobs] | None) -> list[tuple[Sequence, int]]:
        """update() for a step of one token a sequence."""
        new: list[tuple[Sequence, int]] = []
        seqs = out.sampled
        if len(seqs) != len(sampled):
            raise RuntimeError(f"step returned {len(sampled)} tokens for {len(seqs)} sequences")
        for row, lp in (logprobs or {}).items():
            if seqs[row].finish_reason is None:  # else past a stop, as its token
                seqs[row].logprobs.append(lp)
        eos, max_len = self.eos_token_ids, self.max_model_len
        for seq, token in zip(seqs, sampled):  # hot: one pass over the batch per step
            if seq.finish_reason is not None:
                continue  # it stopped at the previous step: this token is past the stop
            seq.num_pending -= 1
            outputs = seq.output_token_ids
            outputs.append(token)
            new.append((seq, token))
            p = seq.params
            if (token in eos and not p.ignore_eos) or token in p.stop_token_ids:
                self.finish(seq, "stop")
            elif seq.guide is not None and seq.guide.accept(token):
                self.finish(seq, "error" if seq.guide.error else "stop")  # complete or failed
            elif (len(outputs) >= p.max_tokens
                  or len(seq.prompt_token_ids) + len(outputs) >= max_len):
                self.finish(seq, "length")
            if seq.proposer is not None:
                seq.proposer.extend((token,))
        return new

    def _update_verified(self, out: SchedulerOutput, sampled: list[int], counts: list[int]
                         ) -> list[tuple[Sequence, int]]:
        """update() for a step in which sequences verified drafts: each sequence's tokens
        one by one, so nothing past a stop is kept; a verifying one's KV holds its last
        token and the drafts kept."""
        seqs = out.sampled
        if len(seqs) != len(counts) or sum(counts) != len(sampled):
            raise RuntimeError(f"step returned {len(sampled)} tokens in {len(counts)} rows "
                               f"for {len(seqs)} sequences")
        new: list[tuple[Sequence, int]] = []
        at = 0
        for seq, n in zip(seqs, counts):
            tokens, at = sampled[at: at + n], at + n
            if seq.finish_reason is not None:
                continue
            seq.num_pending -= 1
            if seq.drafts:
                self.num_drafts += 1
                self.num_draft_tokens += seq.drafts
                self.num_accepted_tokens += n - 1
                for pos in range(n - 1):
                    self.accepted_per_pos[pos] += 1
                seq.spec_drafts += seq.drafts
                seq.spec_kept += n - 1
                if (seq.spec_drafts >= SPEC_TRIAL_DRAFTS
                        and seq.spec_kept < SPEC_MIN_KEPT * seq.spec_drafts):
                    seq.proposer = None  # decodes as usual from now on
                if seq.block_table:  # not preempted since: its rejected drafts' KV is stale
                    seq.num_computed -= seq.drafts - (n - 1)
                    seq.forget = seq.drafts - (n - 1)
                seq.drafts = 0
            kept = self._append(seq, tokens, new)
            if seq.proposer is not None:
                seq.proposer.extend(kept)
        return new

    def _append(self, seq: Sequence, tokens: list[int], new: list[tuple[Sequence, int]]
                ) -> list[int]:
        """Apply seq's tokens in order up to the first stop; returns those applied."""
        p, outputs = seq.params, seq.output_token_ids
        for j, token in enumerate(tokens):
            outputs.append(token)
            new.append((seq, token))
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                self.finish(seq, "stop")
            elif seq.guide is not None and seq.guide.accept(token):
                self.finish(seq, "error" if seq.guide.error else "stop")
            elif (len(outputs) >= p.max_tokens
                  or len(seq.prompt_token_ids) + len(outputs) >= self.max_model_len):
                self.finish(seq, "length")
            if seq.finish_reason is not None:
                return tokens[: j + 1]
        return tokens

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.finish_reason is not None:
            return
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)  # preempted, then its pending token stopped it
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: FinishReason) -> None:
        self.kv.release(seq)
        seq.sent_blocks = 0
        seq.finish_reason = reason
        if seq.tracked:
            self._drop.append(seq.seq_id)
            seq.tracked = False
