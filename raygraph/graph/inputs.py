"""StepPlan -> model inputs: host-side lists, then either fresh tensors (eager) or the
persistent, max-shape buffers that captured graphs read (graph mode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from raygraph.graph.buckets import drafts_as_rows
from raygraph.graph.upload import TableCopy
from raygraph.model.context import AttentionMetadata, ForwardContext, LoRAInputs
from raygraph.protocol import StepPlan


@dataclass
class HostInputs:
    ids: list[int]
    positions: np.ndarray  # token_layout gives these three
    slots: list[int] | None  # None: each token's slot follows from its table (slot_mapping)
    token_seq: np.ndarray
    token_row: np.ndarray
    seq_lens: list[int]
    tables: list[list[int]]
    sample_idx: list[int]
    max_q_len: int
    decode: bool
    # per token: -1, or the row of the previous step's sampled tokens (on the device) that
    # is this token; None: no token is fed
    feed: list[int] | None = None
    block_size: int = 0  # the tables' block size, when slots is None
    lora: list[int] | None = None  # per token: its adapter slot (-1: base); None: all base
    verify_row: list[int] | None = None  # decode: AttentionMetadata.verify_row; None: all 0

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def padding_inputs(n: int, scratch_block: int) -> HostInputs:
    """n decode tokens, each a one-token sequence in the scratch block (the block past the
    usable ones): the batch of a capture, and of an idle DP rank that must still join the
    MoE collectives. NOTE: the GPU decode kernel stores each sequence's newest K/V through
    its block table, so these rows must never point at a real block (slot -1 is not enough)."""
    token_seq, token_row, positions = token_layout([1] * n, [0] * n)
    return HostInputs([0] * n, positions, [-1] * n, token_seq, token_row, [1] * n,
                      [[scratch_block]] * n, list(range(n)), 1, True)


def slot_mapping(tables: np.ndarray, token_seq: np.ndarray, positions: np.ndarray,
                 block_size: int) -> np.ndarray:
    """Each token's KV slot: its sequence's block holding the position, then the offset in
    it. Numpy over the whole step: a Python loop per token cost ~70 us a 2048-token chunk."""
    blocks = tables[token_seq, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


# The decode kernel's cascade (one pass over a prefix every sequence shares, for the whole
# batch) runs only in batches and over prefixes at least this large: below them it saves
# less than its extra programs cost.
CASCADE_MIN_SEQS = 8
CASCADE_MIN_TOKENS = 256


def shared_prefix_len(tables: np.ndarray, seq_lens: list[int], block_size: int) -> int:
    """Keys at the start of every sequence that sit in the same physical blocks of every
    table (a prompt prefix cached once, then reused), whole blocks before each sequence's
    newest key: what the decode kernel's cascade attends over once for the batch. 0 when the
    batch or the prefix is too small to pay. `tables`: row b is sequence b's table."""
    b = len(seq_lens)
    if b < CASCADE_MIN_SEQS or block_size == 0:
        return 0
    limit = (min(seq_lens) - 1) // block_size
    if limit * block_size < CASCADE_MIN_TOKENS:
        return 0
    same = (tables[1:b, :limit] == tables[0, :limit]).all(axis=0)
    shared = (limit if same.all() else int(same.argmin())) * block_size
    return shared if shared >= CASCADE_MIN_TOKENS else 0


def token_layout(q_lens: list[int], starts: list[int]) -> tuple[np.ndarray, ...]:
    """(token_seq, token_row, positions) of sequences of q_lens new tokens each, the first at
    position starts[b]. In numpy: built as Python lists, a 2048-token chunk's three rows cost
    ~0.2 ms of host time a step (bench/RESULTS.md), before the step could start."""
    if q_lens.count(1) == len(q_lens):  # decode, one token each: a batch-1 step's shortcut
        return (np.arange(len(q_lens), dtype=np.int64), np.zeros(len(q_lens), dtype=np.int64),
                np.asarray(starts, dtype=np.int64))
    q = np.asarray(q_lens, dtype=np.int64)
    token_seq = np.repeat(np.arange(len(q), dtype=np.int64), q)
    first = np.cumsum(q) - q  # each sequence's first row in the step
    token_row = np.arange(len(token_seq), dtype=np.int64) - first[token_seq]
    positions = token_row + np.asarray(starts, dtype=np.int64)[token_seq]
    return token_seq, token_row, positions


def verify_layout(plan: StepPlan) -> tuple[list[int], ...]:
    """(q_lens, starts, seq_lens, tables, verify_row) of a step whose chunks are each a token
    and the drafts it verifies (or one token): a row per token, consecutive, each a query of
    one at its own position, so verifying runs in the decode buckets and kernel."""
    starts, seq_lens, tables, rows = [], [], [], []
    for s in plan.seqs:
        n = len(s.token_ids)
        starts += range(s.start_pos, s.start_pos + n)
        seq_lens += range(s.start_pos + 1, s.start_pos + n + 1)
        tables += [s.block_table] * n
        rows += range(n)
    return [1] * len(starts), starts, seq_lens, tables, rows


def host_inputs(plan: StepPlan, block_size: int, lora: bool = False,
                max_rows: int | None = None) -> HostInputs:
    """`lora`: the model has adapter slots, so the tokens' slots are read (a pass over the
    sequences a step that a model without LoRA does not pay). `max_rows`: the most rows a
    step with drafts runs as decode rows (buckets.drafts_as_rows)."""
    ids: list[int] = []
    q_lens, starts, seq_lens, tables, sample_idx = [], [], [], [], []
    for s in plan.seqs:
        n = len(s.token_ids)
        end = s.start_pos + n
        if len(s.block_table) * block_size < end:
            raise ValueError(
                f"seq {s.seq_id}: {len(s.block_table)} blocks cannot hold {end} tokens")
        ids += s.token_ids
        q_lens.append(n)
        starts.append(s.start_pos)
        seq_lens.append(end)
        tables.append(s.block_table)
        if s.sample:  # its last token, and each draft it verifies
            sample_idx += range(len(ids) - 1 - s.verify, len(ids))
    decode, verify_row = q_lens.count(1) == len(q_lens), None
    # a chunk with drafts has two tokens or more: only such a step pays for this check
    if not decode and any(s.verify for s in plan.seqs):
        decode = (all(n == 1 + s.verify for n, s in zip(q_lens, plan.seqs))
                  and drafts_as_rows(len(ids), len(q_lens), max_rows))
        if decode:  # each chunk a token and its drafts (or one token), rows permitting
            q_lens, starts, seq_lens, tables, verify_row = verify_layout(plan)
    token_seq, token_row, positions = token_layout(q_lens, starts)
    h = HostInputs(ids, positions, None, token_seq, token_row, seq_lens, tables, sample_idx,
                   max(q_lens, default=0), decode, block_size=block_size,
                   verify_row=verify_row)
    if any(s.feed >= 0 for s in plan.seqs):
        h.feed = [f for s in plan.seqs for f in ([s.feed] if len(s.token_ids) == 1
                                                 else [-1] * len(s.token_ids))]
    if lora and any(s.lora_slot >= 0 for s in plan.seqs):
        h.lora = [s.lora_slot for s in plan.seqs for _ in s.token_ids]
    return h


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    ctx: ForwardContext
    sample_idx: torch.Tensor  # [S]: rows of the hidden states whose logits are sampled
    feed: torch.Tensor | None = None  # [T]: see HostInputs.feed


def feed_tokens(ids: torch.Tensor, feed: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """ids with each fed token replaced by its row of `prev` (the previous step's sampled
    tokens, still on the device): the served loop sends a decode step before the host has
    seen the token it decodes. Branch-free, so graphs capture it."""
    return torch.where(feed >= 0, prev[feed.clamp(min=0)], ids)


def query_starts(token_row: list[int] | np.ndarray, num_seqs: int) -> np.ndarray:
    """[num_seqs + 1] offsets of each sequence's first token, then the token count: a
    sequence's tokens are consecutive and begin at row 0."""
    rows = np.asarray(token_row)
    starts = np.flatnonzero(rows == 0)
    if len(starts) != num_seqs:
        raise ValueError(f"{len(starts)} sequence starts for {num_seqs} sequences")
    return np.append(starts, len(rows))


def sort_by_slot(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, sorted slots): the tokens grouped by adapter slot, a stable sort (LoRAInputs)."""
    order = np.argsort(slots, kind="stable")
    return order, slots[order]


def _padded_tables(tables: list[list[int]], width: int) -> list[list[int]]:
    return [t + [0] * (width - len(t)) for t in tables]


def prepare_batch(plan: StepPlan, block_size: int, device: torch.device,
                  cascade: bool = False) -> Batch:
    """Fresh tensors of exactly the batch's size (the eager path)."""
    return batch_from(host_inputs(plan, block_size), device, cascade)


def batch_from(h: HostInputs, device: torch.device, cascade: bool = False) -> Batch:
    """`cascade`: a decode batch that shares a prefix carries its length (GraphConfig.
    decode_cascade); one that shares none runs the plain kernel, as graphs do."""
    def t(x: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    positions = t(h.positions)
    width = max(len(x) for x in h.tables)
    tables = np.array(_padded_tables(h.tables, width))
    shared = None
    if cascade and h.decode and h.num_seqs >= CASCADE_MIN_SEQS:
        n = shared_prefix_len(tables, h.seq_lens, h.block_size)
        shared = t([n], torch.int32) if n else None
    slots = h.slots if h.slots is not None else slot_mapping(
        tables, h.token_seq, h.positions, h.block_size).tolist()
    md = AttentionMetadata(
        slot_mapping=t(slots), block_tables=torch.from_numpy(tables).to(device, torch.int32),
        seq_lens=t(h.seq_lens, torch.int32),
        query_start=t(query_starts(h.token_row, h.num_seqs).tolist(), torch.int32),
        positions=positions, token_seq=t(h.token_seq), token_row=t(h.token_row),
        num_tokens=h.num_tokens, max_q_len=h.max_q_len, max_kv_len=max(h.seq_lens),
        decode=h.decode, shared_len=shared,
        verify_row=t(h.verify_row) if h.verify_row is not None else None,
    )
    lora = None
    if h.lora is not None:
        slots = np.array(h.lora, dtype=np.int32)
        order, ordered = sort_by_slot(slots)
        lora = LoRAInputs(*(torch.from_numpy(a.astype(np.int32)).to(device, non_blocking=True)
                            for a in (slots, order, ordered)))
    return Batch(t(h.ids), positions, ForwardContext(attn=md, lora=lora), t(h.sample_idx),
                 t(h.feed) if h.feed is not None else None)


class TableSpan(NamedTuple):
    """The block-table part an upload moves: the first `cols` columns of the first `rows`
    rows, every entry written since the last upload."""

    rows: int
    cols: int


class InputBuffers:
    """One set of persistent device buffers at the max shape, shared by every bucket.

    Each step writes the real prefix and safe padding into a pinned host mirror, then two
    async driver copies move it over; graphs read slice views of the bucket's size. NOTE:
    padding slots are -1 (slot 0 is a real KV slot); padding sequences have kv length 0 and
    an all-zero block table row. NOTE: the host mirror is rewritten only once the previous
    step's copy has run: the served loop sends step N+1 while step N runs, so write() waits
    on an event recorded after the last upload (it has nearly always run by then).

    Layout: one byte buffer, [seq lens | query starts | shared prefix length | token rows |
    LoRA rows | block tables]: the fields before the tables move in one copy, the tables in
    one 2-D copy of the columns written since the last upload. A table row is max_blocks
    wide (the longest context) and a step's sequences use a few of its columns
    (bench/RESULTS.md, "A served decode step's timeline"). The device rows past those
    columns hold what the host's do: a row's shrinking table clears its old columns, and
    those go up too. Strided copy_ calls of row slices would stage through pageable memory
    instead (bench/RESULTS.md, third decode pass).

    The LoRA rows (int32: each token's slot, the tokens sorted by slot, their slots in that
    order; padding tokens -1) exist only when `lora` is set: without it the layout is the
    plain model's. The shared prefix length (`shared_prefix_len`) is written and handed to
    decode buckets only with `cascade`; the rows' verify_row only with `verify` (speculative
    decoding: the decode kernel then reads it, and a plain decode step pays nothing for it
    otherwise); a decode step's query starts only with `decode_starts` (heads the decode
    kernel does not take decode through the prefill kernel, which reads them:
    ops.decode_kernel_takes).

    The host side writes through numpy views of the pinned mirror: a numpy slice assignment
    from a list costs about a microsecond, a torch op several, and this runs on the critical
    path of every step.
    """

    # sample_idx: the rows whose logits are sampled (a prefill step's last prompt tokens)
    # feed: HostInputs.feed (-1: none); verify_row (with `verify` only): HostInputs.verify_row
    # (0: none)
    ROWS = ("input_ids", "positions", "slot_mapping", "token_seq", "token_row", "sample_idx",
            "feed")

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 lora: bool = False, cascade: bool = False, verify: bool = False,
                 decode_starts: bool = False):
        self.cascade = cascade
        self.verify = verify  # decode graphs read each row's verify_row
        self.decode_starts = decode_starts  # decode steps read query starts too
        names = self.ROWS + (("verify_row",) if verify else ())
        starts_at = max_seqs * 4
        shared_at = starts_at + (max_seqs + 1) * 4
        lens_end = -(-(shared_at + 4) // 64) * 64  # token rows 8-byte aligned
        rows_end = lens_end + len(names) * max_tokens * 8
        self._tables_at = rows_end + (3 * max_tokens * 4 if lora else 0)
        size = self._tables_at + max_seqs * max_blocks * 4
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device_bytes = torch.zeros(size, dtype=torch.uint8, device=device)

        def views(buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (buf[:starts_at].view(torch.int32),
                    buf[starts_at: shared_at].view(torch.int32),
                    buf[shared_at: shared_at + 4].view(torch.int32),
                    buf[lens_end: rows_end].view(torch.long).view(len(names), -1),
                    buf[self._tables_at:].view(torch.int32).view(max_seqs, max_blocks))

        (self.host_lens, self.host_starts, self.host_shared, self.host_tokens,
         self.host_tables) = views(self.host)
        (self.seq_lens, self.query_start, self.shared_len, self.tokens,
         self.block_tables) = views(self.device_bytes)
        # [slot | order | sorted slot] x max_tokens, int32
        self.lora = (self.device_bytes[rows_end: self._tables_at].view(torch.int32)
                     .view(3, max_tokens) if lora else None)
        self._lora = (self.host[rows_end: self._tables_at].view(torch.int32).view(3, max_tokens)
                      .numpy() if lora else None)
        self._tok, self._tables, self._lens, self._starts, self._shared = (t.numpy() for t in (
            self.host_tokens, self.host_tables, self.host_lens, self.host_starts,
            self.host_shared))
        self._arange = np.arange(max(max_tokens, max_seqs), dtype=np.int64)
        self._tok[[2, 6]] = -1
        self.tokens[[2, 6]] = -1
        self.verify_row: torch.Tensor | None = None
        for i, name in enumerate(names):
            setattr(self, name, self.tokens[i])
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self._widths = [0] * max_seqs  # table row lengths last written
        self._span = TableSpan(0, 0)  # the tables' part written since the last upload
        # (num_tokens, num_seqs) -> (the metadata's row views, the verify rows' or None)
        self._views: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...],
                                                 torch.Tensor | None]] = {}
        self._lora_views: dict[int, LoRAInputs] = {}
        self._tables_copy = TableCopy(self.host_tables, self.block_tables)
        self._stream = self._tables_copy.stream  # None on the CPU
        if self._stream is not None:
            self._uploaded = torch.cuda.Event()  # the last upload; the mirror waits for it

    @property
    def nbytes(self) -> int:
        return self.device_bytes.numel()

    def fill(self, h: HostInputs, num_tokens: int, num_seqs: int) -> None:
        """Write h into the buffers; pad tokens up to num_tokens and seqs up to num_seqs."""
        self.write(h, num_tokens, num_seqs)
        self.upload()

    def upload(self) -> None:
        """The host mirror to the device on the current stream: the fields before the tables
        in one async copy, then the tables' part written since the last upload in a 2-D
        one. On CUDA these are driver calls: torch's copy_ (slicing, dispatch, a
        pinned-memory event) cost 3x as much host time (bench/RESULTS.md, fifth pass)."""
        end, span, stream = self._tables_at, self._span, None
        if self._stream is None:
            self.device_bytes[:end].copy_(self.host[:end])
        else:
            driver, stream = self._stream.driver, self._stream.current()
            (err,) = driver.cuMemcpyHtoDAsync(self.device_bytes.data_ptr(),
                                              self.host.data_ptr(), end, stream)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"input upload ({end} bytes) failed: {err}")
        self._tables_copy(span.rows, span.cols, stream)
        if self._stream is not None:
            self._uploaded.record()
        self._span = TableSpan(0, 0)

    def write(self, h: HostInputs, num_tokens: int, num_seqs: int) -> None:
        """fill's host half: h into the pinned mirror (and what of the tables changed)."""
        if self._stream is not None:  # the previous step's copy may still be reading it
            self._uploaded.synchronize()
        n, b = h.num_tokens, h.num_seqs
        if n > num_tokens or b > num_seqs or num_seqs > self.max_seqs:
            raise ValueError(f"batch of {n} tokens / {b} seqs does not fit bucket "
                             f"({num_tokens}, {num_seqs})")
        width = max(len(t) for t in h.tables)
        if width > self.max_blocks:
            raise ValueError(f"a sequence needs {width} blocks; buffers hold {self.max_blocks}")
        # few numpy calls: each costs microseconds on a busy host, on every step's critical path
        tok = self._tok
        # one row at a time: numpy converts a tuple of rows element by element (~4x slower)
        tok[0, :n] = h.ids
        tok[1, :n] = h.positions
        if h.slots is not None:
            tok[2, :n] = h.slots
        tok[3, :n] = h.token_seq
        tok[4, :n] = h.token_row
        tok[5, : len(h.sample_idx)] = h.sample_idx
        tok[5, len(h.sample_idx): n] = 0  # a full prefill graph gathers these rows too
        tok[6, :n] = -1 if h.feed is None else h.feed
        if self.verify:
            tok[7, :n] = 0 if h.verify_row is None else h.verify_row
        if self._lora is not None:
            self._write_lora(h.lora, n, num_tokens)
        if n < num_tokens:
            tok[:, n:num_tokens] = 0
            tok[[2, 6], n:num_tokens] = -1  # padding slots, nothing fed
            # each padding token is its own padding sequence (decode), never a real one's row
            tok[3, n:num_tokens] = self._arange[n:num_tokens]
        tables, widths = self._tables, self._widths
        cols = width  # every table column this write changes lies below it
        for i, t in enumerate(h.tables):
            w = len(t)
            tables[i, :w] = t
            if widths[i] > w:  # clear what a longer table left in this row
                tables[i, w : widths[i]] = 0
                cols = max(cols, widths[i])
            widths[i] = w
        if b < num_seqs:  # padding sequences: all-zero tables
            stale = max(widths[b:num_seqs])
            if stale:
                tables[b:num_seqs, :stale] = 0
                widths[b:num_seqs] = [0] * (num_seqs - b)
                cols = max(cols, stale)
        # kept until an upload moves it: a write that fails past here is moved by the next
        self._span = TableSpan(max(self._span.rows, num_seqs), max(self._span.cols, cols))
        if h.slots is None:  # after the tables: the slots are read from them
            tok[2, :n] = slot_mapping(tables, tok[3, :n], tok[1, :n], h.block_size)
        self._lens[:b] = h.seq_lens
        if self.cascade:
            self._shared[0] = (shared_prefix_len(tables, h.seq_lens, h.block_size)
                               if h.decode else 0)
        # the prefill kernel's offsets (a decode step's with `decode_starts`); padding
        # sequences are empty
        if not h.decode or self.decode_starts:
            self._starts[: b + 1] = (self._arange[: b + 1] if h.decode
                                     else query_starts(tok[4, :n], b))
            self._starts[b + 1: num_seqs + 1] = n
        self._lens[b:num_seqs] = 0

    def _write_lora(self, slots: list[int] | None, n: int, num_tokens: int) -> None:
        """Each token's slot (padding -1) and the bucket's tokens sorted by slot."""
        lora = self._lora
        if slots is None:  # every token the base model's: already in slot order
            lora[[0, 2], :num_tokens] = -1
            lora[1, :num_tokens] = self._arange[:num_tokens]
            return
        lora[0, :n] = slots
        lora[0, n:num_tokens] = -1
        lora[1, :num_tokens], lora[2, :num_tokens] = sort_by_slot(lora[0, :num_tokens])

    def lora_inputs(self, num_tokens: int) -> LoRAInputs | None:
        """The LoRA rows of a bucket's size (fixed addresses; None: LoRA off)."""
        if self.lora is None:
            return None
        views = self._lora_views.get(num_tokens)
        if views is None:
            views = self._lora_views[num_tokens] = LoRAInputs(*self.lora[:, :num_tokens])
        return views

    @property
    def shared_prefix(self) -> int:
        """The shared prefix length the last write gave (0: none, or `cascade` off)."""
        return int(self._shared[0])

    def metadata(self, num_tokens: int, num_seqs: int, num_real: int, max_q_len: int,
                 max_kv_len: int, decode: bool, cascade: bool = False) -> AttentionMetadata:
        """Views of the bucket's size (their addresses never change; made once per size);
        the first `num_real` tokens are real. `cascade`: the decode kernel reads the shared
        prefix length (a graph with the cascade compiled in)."""
        views = self._views.get((num_tokens, num_seqs))
        if views is None:
            views = (self.slot_mapping[:num_tokens], self.block_tables[:num_seqs],
                     self.seq_lens[:num_seqs], self.query_start[: num_seqs + 1],
                     self.positions[:num_tokens], self.token_seq[:num_tokens],
                     self.token_row[:num_tokens])
            verify = self.verify_row[:num_tokens] if self.verify_row is not None else None
            views = (views, verify)
            self._views[(num_tokens, num_seqs)] = views
        rows, verify = views
        shared = self.shared_len if cascade and self.cascade and decode else None
        return AttentionMetadata(*rows, num_tokens=num_real, max_q_len=max_q_len,
                                 max_kv_len=max_kv_len, decode=decode, shared_len=shared,
                                 verify_row=verify if decode else None)
