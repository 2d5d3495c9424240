"""Paged attention reference + store_kv + prepare_batch against dense causal attention.

GQA (4 query heads over 2 KV heads), block size 4 and shuffled, non-contiguous block tables,
so every block boundary and table lookup matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raygraph.graph.inputs import prepare_batch
from raygraph.model.ops import paged_attention_ref, store_kv
from raygraph.protocol import SeqChunk, StepPlan
from tests.conftest import assert_close_across_shapes

HQ, HKV, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 40
SCALE = D**-0.5
GARBAGE = 1e3  # finite junk in every slot no sequence owns; must never leak into an output


@dataclass
class Seq:
    q: torch.Tensor  # [L, HQ, D]: the query of every position
    k: torch.Tensor  # [L, HKV, D]
    v: torch.Tensor
    table: list[int]


def make_seqs(lengths: list[int], seed: int = 0) -> list[Seq]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=g).tolist()  # the last slot is scratch
    seqs = []
    for n in lengths:
        nb = -(-n // BS)
        table, blocks = blocks[:nb], blocks[nb:]
        seqs.append(Seq(*(torch.randn(n, h, D, generator=g, dtype=torch.float64)
                          for h in (HQ, HKV, HKV)), table))
    return seqs


def empty_cache() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BS, HKV, D)
    return (torch.full(shape, GARBAGE, dtype=torch.float64),
            torch.full(shape, -GARBAGE, dtype=torch.float64))


def dense_causal(s: Seq, start: int, end: int) -> torch.Tensor:
    """softmax(q k^T) v over keys 0..p for each query position p in [start, end)."""
    k = s.k.repeat_interleave(HQ // HKV, dim=1)  # query head h reads KV head h // 2
    v = s.v.repeat_interleave(HQ // HKV, dim=1)
    out = []
    for p in range(start, end):
        w = torch.einsum("hd,lhd->hl", s.q[p], k[: p + 1]) * SCALE
        out.append(torch.einsum("hl,lhd->hd", w.softmax(-1), v[: p + 1]))
    return torch.stack(out)


def write_prefix(s: Seq, n: int, kc: torch.Tensor, vc: torch.Tensor) -> None:
    """Tokens computed by earlier steps, written slot by slot (independent of prepare_batch)."""
    for p in range(n):
        kc[s.table[p // BS], p % BS] = s.k[p]
        vc[s.table[p // BS], p % BS] = s.v[p]


def run_step(seqs: list[Seq], spans: list[tuple[int, int]]) -> None:
    """One batched step: seq i computes positions spans[i]; compare with dense attention."""
    kc, vc = empty_cache()
    chunks = []
    for i, (s, (start, end)) in enumerate(zip(seqs, spans, strict=True)):
        write_prefix(s, start, kc, vc)
        chunks.append(SeqChunk(seq_id=i, token_ids=[0] * (end - start), start_pos=start,
                               block_table=s.table, sample=True))
    md = prepare_batch(StepPlan(1, chunks), BS, torch.device("cpu")).ctx.attn
    cat = lambda x: torch.cat([getattr(s, x)[a:b] for s, (a, b) in zip(seqs, spans, strict=True)])  # noqa: E731
    store_kv(cat("k"), cat("v"), kc, vc, md.slot_mapping)
    out = paged_attention_ref(cat("q"), kc, vc, md, SCALE)
    expect = torch.cat([dense_causal(s, a, b) for s, (a, b) in zip(seqs, spans, strict=True)])
    assert out.shape == expect.shape
    assert_close_across_shapes(out, expect)  # batched paged kernel vs per-query einsum


def test_prefill_of_several_lengths() -> None:
    lengths = [1, 4, 5, 11, 16]
    run_step(make_seqs(lengths), [(0, n) for n in lengths])


def test_chunked_prefill() -> None:
    run_step(make_seqs([19]), [(6, 19)])  # 6 cached (mid-block), a 13-token chunk
    run_step(make_seqs([16], seed=1), [(8, 12)])  # chunk on a block boundary, more to come


def test_decode() -> None:
    lengths = [1, 4, 5, 9, 23]
    run_step(make_seqs(lengths, seed=2), [(n - 1, n) for n in lengths])


def test_mixed_batch() -> None:
    seqs = make_seqs([7, 13, 3, 21, 12], seed=3)
    run_step(seqs, [(6, 7), (0, 13), (2, 3), (5, 18), (8, 12)])


def test_store_kv_padding_never_touches_a_real_slot() -> None:
    # NOTE: the cache's last slot (23 here) is the scratch slot padding rows may land in
    kc = torch.full((6, BS, HKV, D), float("nan"))
    vc = kc.clone()
    k = torch.randn(5, HKV, D)
    v = torch.randn(5, HKV, D)
    slots = torch.tensor([0, -1, 22, 9, -1])  # 0 and 22: the first and last real slots
    store_kv(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, HKV, D), vc.view(-1, HKV, D)
    for t, slot in ((0, 0), (2, 22), (3, 9)):
        assert torch.equal(flat_k[slot], k[t]) and torch.equal(flat_v[slot], v[t])
    untouched = [i for i in range(23) if i not in (0, 9, 22)]
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_prepare_batch_layout() -> None:
    plan = StepPlan(3, [
        SeqChunk(seq_id=7, token_ids=[11, 12, 13], start_pos=2, block_table=[5, 1], sample=True),
        SeqChunk(seq_id=8, token_ids=[21], start_pos=9, block_table=[3, 0, 6], sample=True),
        SeqChunk(seq_id=9, token_ids=[31, 32], start_pos=0, block_table=[2], sample=False),
    ])
    b = prepare_batch(plan, 4, torch.device("cpu"))
    md = b.ctx.attn
    assert b.input_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert b.positions.tolist() == md.positions.tolist() == [2, 3, 4, 9, 0, 1]
    # position p of a seq lives at block_table[p // 4] * 4 + p % 4
    assert md.slot_mapping.tolist() == [22, 23, 4, 25, 8, 9]
    assert md.token_seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert md.token_row.tolist() == [0, 1, 2, 0, 0, 1]
    assert md.seq_lens.tolist() == [5, 10, 2]
    assert md.block_tables.tolist() == [[5, 1, 0], [3, 0, 6], [2, 0, 0]]
    assert (md.max_q_len, md.max_kv_len) == (3, 10)
    assert b.sample_idx.tolist() == [2, 3]  # the last token of each sampling chunk
    assert md.slot_mapping.dtype == torch.long and md.block_tables.dtype == torch.int32
    assert not md.decode  # the flag that routes a batch to the decode kernel
    decode = StepPlan(4, [SeqChunk(seq_id=i, token_ids=[1], start_pos=5 + i, block_table=[i, 7],
                                   sample=True) for i in range(3)])
    md = prepare_batch(decode, 4, torch.device("cpu")).ctx.attn
    assert md.decode and md.slot_mapping.tolist() == [29, 30, 31]
    assert (md.max_q_len, md.max_kv_len, md.seq_lens.tolist()) == (1, 8, [6, 7, 8])


def test_prepare_batch_refuses_a_short_block_table() -> None:
    plan = StepPlan(1, [SeqChunk(seq_id=1, token_ids=[1, 2], start_pos=3, block_table=[4],
                                 sample=True)])
    with pytest.raises(ValueError, match="seq 1"):
        prepare_batch(plan, 4, torch.device("cpu"))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_stale_non_finite_slots_do_not_leak(poison: float) -> None:
    seqs = make_seqs([3, 9], seed=4)  # seq 0 reads up to max_kv_len=9 through padded tables
    kc, vc = (torch.full((NUM_BLOCKS, BS, HKV, D), poison, dtype=torch.float64)
              for _ in range(2))
    chunks = [SeqChunk(seq_id=i, token_ids=[0] * len(s.q), start_pos=0, block_table=s.table,
                       sample=True) for i, s in enumerate(seqs)]
    md = prepare_batch(StepPlan(1, chunks), BS, torch.device("cpu")).ctx.attn
    store_kv(torch.cat([s.k for s in seqs]), torch.cat([s.v for s in seqs]), kc, vc,
             md.slot_mapping)
    out = paged_attention_ref(torch.cat([s.q for s in seqs]), kc, vc, md, SCALE)
    expect = torch.cat([dense_causal(s, 0, len(s.q)) for s in seqs])
    assert_close_across_shapes(out, expect)  # batched paged kernel vs per-query einsum


def test_input_buffers_clear_what_a_longer_table_left() -> None:
    """The fill writes table rows in place; a row whose table shrinks (a new sequence in the
    same row) or that becomes padding must read zeros past its new end, never stale blocks."""
    from raygraph.graph.inputs import InputBuffers, host_inputs

    bufs = InputBuffers(8, 4, 6, torch.device("cpu"))
    long = [SeqChunk(i, [1], BS * (6 - i) - 1, [9, 8, 7, 6, 5, 4][: 6 - i], True)
            for i in range(3)]
    bufs.fill(host_inputs(StepPlan(0, long), BS), 4, 4)
    short = [SeqChunk(0, [1], 1, [3], True), SeqChunk(1, [1], 5, [2, 1], True)]
    bufs.fill(host_inputs(StepPlan(1, short), BS), 4, 4)
    assert bufs.block_tables.tolist() == [[3, 0, 0, 0, 0, 0], [2, 1, 0, 0, 0, 0],
                                          [0] * 6, [0] * 6]
    assert bufs.seq_lens.tolist() == [2, 6, 0, 0]
    assert bufs.slot_mapping[:4].tolist() == [3 * BS + 1, 1 * BS + 1, -1, -1]


def test_input_buffers_upload_moves_every_field() -> None:
    """The device side is one byte buffer: every field the graphs read (tokens, positions,
    slots, rows, sampled rows, tables, lengths) arrives, padded, and the views keep their
    addresses from step to step. Of the tables only the columns the step wrote move."""
    from raygraph.graph.inputs import InputBuffers, host_inputs

    bufs = InputBuffers(16, 4, 3, torch.device("cpu"))
    ptrs = [t.data_ptr() for t in (bufs.input_ids, bufs.sample_idx, bufs.block_tables,
                                   bufs.seq_lens)]
    plan = StepPlan(0, [SeqChunk(0, [5, 6, 7], 0, [4], True),
                        SeqChunk(1, [8, 9], 5, [1, 2], False)])
    h = host_inputs(plan, BS)
    bufs.device_bytes.fill_(0x7F)  # stale bytes everywhere a field is not written
    bufs.fill(h, 8, 3)
    assert bufs.input_ids[:8].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert bufs.positions[:5].tolist() == [0, 1, 2, 5, 6]
    assert bufs.slot_mapping[:8].tolist() == [4 * BS, 4 * BS + 1, 4 * BS + 2, 2 * BS + 1,
                                              2 * BS + 2, -1, -1, -1]
    assert bufs.token_seq[:5].tolist() == [0, 0, 0, 1, 1]
    assert bufs.sample_idx[:1].tolist() == [2]  # only the first chunk samples
    assert bufs.block_tables[:3, :2].tolist() == [[4, 0], [1, 2], [0, 0]]
    assert (bufs.block_tables[:, 2] == 0x7F7F7F7F).all()  # past every table: not moved
    assert bufs.seq_lens[:3].tolist() == [3, 7, 0]
    assert bufs.query_start[:4].tolist() == [0, 3, 5, 5]  # the padding sequence is empty
    assert ptrs == [t.data_ptr() for t in (bufs.input_ids, bufs.sample_idx, bufs.block_tables,
                                           bufs.seq_lens)]


def test_table_copy_moves_the_leading_rows_and_columns_only() -> None:
    """A table upload moves the first rows x columns and leaves the rest of the device
    table as it was; tables of different shapes are refused."""
    from raygraph.graph.upload import TableCopy

    host = torch.arange(24, dtype=torch.int32).view(4, 6)
    dev = torch.full((4, 6), -1, dtype=torch.int32)
    copy = TableCopy(host, dev)
    copy(2, 3)
    expect = torch.full((4, 6), -1, dtype=torch.int32)
    expect[:2, :3] = host[:2, :3]
    assert torch.equal(dev, expect)
    copy(0, 5)  # nothing to move
    assert torch.equal(dev, expect)
    with pytest.raises(ValueError, match="differ"):
        TableCopy(host, torch.zeros(4, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="differ"):
        TableCopy(host, torch.zeros(4, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="5 x 3"):
        copy(5, 3)  # past the table's rows


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=6), min_size=1, max_size=8),
       st.data())
def test_input_buffers_device_tables_equal_the_zero_padded_tables(
        steps: list[list[int]], data: st.DataObject) -> None:
    """Whatever tables steps of any widths and row counts write, in any order, the device
    rows a step uses equal its tables padded with zeros to max_blocks (the upload moves
    only the columns a step changed: a longer table an earlier step left is cleared, on
    both sides), and the device equals the host mirror everywhere; also where writes went
    without an upload (one that failed before its upload): the next upload moves theirs."""
    from raygraph.graph.inputs import InputBuffers, host_inputs

    bufs = InputBuffers(8, 8, 16, torch.device("cpu"))
    for i, blocks in enumerate(steps):
        chunks = [SeqChunk(j, [1], max(0, n * BS - 1), list(range(1, n + 1)) or [9], True)
                  for j, n in enumerate(blocks)]
        rows = data.draw(st.integers(len(chunks), 8))
        bufs.write(host_inputs(StepPlan(i, chunks), BS), rows, rows)
        if i < len(steps) - 1 and data.draw(st.booleans()):
            continue  # this write's upload never runs
        bufs.upload()
        want = torch.zeros(rows, 16, dtype=torch.int32)
        for j, c in enumerate(chunks):
            want[j, : len(c.block_table)] = torch.tensor(c.block_table)
        assert torch.equal(bufs.block_tables[:rows], want)
        assert torch.equal(bufs.block_tables, bufs.host_tables)


def test_input_buffers_give_a_decode_step_its_query_starts() -> None:
    """With `decode_starts` a decode step's offsets are written too (one token a sequence;
    padding sequences empty): heads the decode kernel does not take decode through the
    prefill kernel."""
    from raygraph.graph.inputs import InputBuffers, host_inputs
    from raygraph.model.ops import decode_kernel_takes

    assert decode_kernel_takes(128) and not decode_kernel_takes(80)
    bufs = InputBuffers(8, 8, 2, torch.device("cpu"), decode_starts=True)
    bufs.fill(host_inputs(StepPlan(0, [SeqChunk(0, [5, 6, 7], 0, [4], True)]), BS), 8, 1)
    plan = StepPlan(1, [SeqChunk(i, [1], 1 + i, [i + 1], True) for i in range(3)])
    h = host_inputs(plan, BS)
    assert h.decode
    bufs.fill(h, 4, 4)
    assert bufs.query_start[:5].tolist() == [0, 1, 2, 3, 3]


def test_fused_linear_ops_equal_the_unfused_reference() -> None:
    """The CPU path of linear_rotary / linear_silu_and_mul is the unfused reference the GPU
    kernels are checked against: it must equal linear followed by rotary / silu_and_mul."""
    import torch.nn.functional as F

    from raygraph.model import ops

    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 32, generator=g)
    hq, hk, d = 4, 2, 8
    w = torch.randn((hq + 2 * hk) * d, 32, generator=g)
    b = torch.randn((hq + 2 * hk) * d, generator=g)
    pos = torch.tensor([0, 3, 7, 1, 30])
    freqs = torch.outer(torch.arange(32.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    q, k, v, rope = ops.linear_rotary(x, w, b, pos, freqs.cos(), freqs.sin(), d, hq, hk)
    assert rope is None  # off the kernels, rotated here, never left to attention
    y = F.linear(x, w, b)
    rq, rk = ops.rotary(y[:, : hq * d].view(5, hq, d), y[:, hq * d: (hq + hk) * d].view(5, hk, d),
                        freqs.cos(), freqs.sin(), pos)
    assert torch.equal(q, rq) and torch.equal(k, rk)
    assert torch.equal(v, y[:, (hq + hk) * d:].view(5, hk, d))
    assert not torch.equal(q, y[:, : hq * d].view(5, hq, d))  # rotation happened
    # and against HF's formula, written out independently: full-width tables, rotate_half
    emb = torch.cat([freqs, freqs], dim=-1)[pos]  # [T, D]

    def hf_rope(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t.chunk(2, dim=-1)
        return t * emb.cos()[:, None] + torch.cat((-t2, t1), dim=-1) * emb.sin()[:, None]

    torch.testing.assert_close(q, hf_rope(y[:, : hq * d].view(5, hq, d)))
    torch.testing.assert_close(k, hf_rope(y[:, hq * d: (hq + hk) * d].view(5, hk, d)))
    gu = torch.randn(2 * 16, 32, generator=g)
    assert torch.equal(ops.linear_silu_and_mul(x, gu), ops.silu_and_mul(F.linear(x, gu)))
    torch.testing.assert_close(ops.linear_silu_and_mul(x, gu),
                               F.silu(x @ gu[:16].T) * (x @ gu[16:].T))
