"""The GPU attention kernels run by Triton's interpreter on CPU tensors, against the torch
reference: decode (splits, the step's own K/V stored, padding rows, a window, the cascade
over a shared prefix) and prefill. Small shapes: the interpreter runs every program in
numpy."""

from __future__ import annotations

import random

import pytest
import torch

from raygraph.graph.inputs import prepare_batch
from raygraph.model.ops import paged_attention_ref, store_kv
from raygraph.protocol import SeqChunk, StepPlan
from tests.conftest import verify_rows_case

BS, HKV, GROUP, D = 16, 2, 4, 64

SLOW = pytest.mark.slow  # another dtype or split count of a case the default run covers


def tolerance(dtype: torch.dtype) -> dict:
    # a few roundings of p and of the sums, as the GPU tests allow
    eps = torch.finfo(dtype).eps
    return dict(atol=8 * eps, rtol=8 * eps)


def decode_seqs(lens: list[int], shared: int, blocks: int, rng: random.Random
                ) -> list[SeqChunk]:
    """One decode token per sequence of the given kv lengths; each table starts with the
    same `shared` blocks (a cached system prompt), then blocks of its own."""
    perm = list(range(blocks))
    rng.shuffle(perm)
    prefix, used, seqs = perm[:shared], shared, []
    for i, n in enumerate(lens):
        own = -(-n // BS) - shared
        assert own >= 1, "the newest key sits in a block of the sequence's own"
        seqs.append(SeqChunk(i, [1], n - 1, prefix + perm[used: used + own], True))
        used += own
    return seqs


def packed_chunks(chunks: list[tuple[int, int]], blocks: int, rng: random.Random
                  ) -> list[SeqChunk]:
    """(new tokens, cached prefix) per sequence, each on shuffled blocks of its own."""
    perm = list(range(blocks))
    rng.shuffle(perm)
    seqs, used = [], 0
    for i, (n, ctx) in enumerate(chunks):
        nb = -(-(ctx + n) // BS)
        assert used + nb <= blocks, f"{blocks} blocks do not hold these chunks"
        seqs.append(SeqChunk(i, [1] * n, ctx, perm[used: used + nb], True))
        used += nb
    return seqs


def decode_case(dtype: torch.dtype, lens: list[int], shared: int, pad: int, seed: int,
                d: int = D):
    """Caches, a batch with `pad` padding rows (kv length 0, a zero table row), queries and
    the step's K/V; the reference output over the cache with the step's K/V stored."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks = shared + sum(-(-n // BS) - shared for n in lens)
    kc = torch.randn(blocks + 1, BS, HKV, d, dtype=dtype)
    vc = torch.randn_like(kc)
    md = prepare_batch(StepPlan(0, decode_seqs(lens, shared, blocks, rng)), BS,
                       torch.device("cpu")).ctx.attn
    tables = torch.cat([md.block_tables, md.block_tables.new_zeros(pad, md.block_tables.shape[1])])
    seq_lens = torch.cat([md.seq_lens, md.seq_lens.new_zeros(pad)])
    b = len(lens) + pad
    q = torch.randn(b, HKV * GROUP, d, dtype=dtype)
    k_new, v_new = torch.randn(2, b, HKV, d, dtype=dtype)
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k_new[: len(lens)], v_new[: len(lens)], ref_k, ref_v, md.slot_mapping)
    ref = paged_attention_ref(q[: len(lens)], ref_k, ref_v, md, d**-0.5)
    return kc, vc, tables, seq_lens, q, k_new, v_new, ref_k, ref_v, ref


@pytest.mark.parametrize("dtype,d,splits", [(torch.float16, 64, 4), (torch.float32, 64, 4),
                                            (torch.float16, 256, 4), (torch.float32, 64, 1)])
def test_decode_kernel_stores_and_attends(interpreted, dtype, d, splits):
    """Splits over each sequence's keys, the newest key stored and folded in, padding rows
    zero and storing nothing; a 256-wide head takes its own tiles (32 keys). At one split
    each program writes the output itself (no merge)."""
    attn = interpreted("triton_attention")
    lens = [1, 17, 64, 65, 150]
    kc, vc, tables, seq_lens, q, k_new, v_new, ref_k, ref_v, ref = decode_case(
        dtype, lens, 0, 2, seed=1, d=d)
    got = attn.paged_decode_attention(q, kc, vc, tables, seq_lens, d**-0.5, k_new, v_new,
                                      splits=splits)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    torch.testing.assert_close(got[: len(lens)], ref, **tolerance(dtype))
    assert (got[len(lens):] == 0).all()


@pytest.mark.parametrize("shared_len,dtype,prefix_splits,splits", [
    pytest.param(0, torch.float16, 2, 2, marks=SLOW), (64, torch.float32, 2, 2),
    pytest.param(80, torch.float16, 1, 2, marks=SLOW),
    pytest.param(160, torch.float32, 1, 2, marks=SLOW),
    pytest.param(176, torch.float16, 4, 2, marks=SLOW), (176, torch.float32, 4, 1),
    (80, torch.float16, 2, 1), pytest.param(0, torch.float32, 2, 1, marks=SLOW)])
def test_decode_cascade_over_a_shared_prefix(interpreted, dtype, shared_len, prefix_splits,
                                             splits):
    """Cascade programs attend over the first `shared_len` keys of every row once, the
    splits over the rest: the same output as the reference, with padding rows and a batch
    of more rows than one cascade program holds (group 4 x 20 sequences = 80 > 64). 0 turns
    the cascade off inside the same launch; 80 is not a whole tile of keys; the prefix in
    fewer splits than the sequences' own leaves some partials unused, and in more (4 after
    2: 6 of 8 partial lanes) leaves the last lanes unused. At one split of their own, the
    sequences' programs merge the prefix's partials themselves."""
    attn = interpreted("triton_attention")
    rng = random.Random(shared_len)
    lens = [177 + rng.randrange(0, 60) for _ in range(20)]  # 11 shared blocks: 176 keys
    kc, vc, tables, seq_lens, q, k_new, v_new, ref_k, ref_v, ref = decode_case(
        dtype, lens, 11, 3, seed=shared_len)
    shared = torch.tensor([shared_len], dtype=torch.int32)
    got = attn.paged_decode_attention(q, kc, vc, tables, seq_lens, D**-0.5, k_new, v_new,
                                      splits=splits, shared_len=shared,
                                      prefix_splits=prefix_splits)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    torch.testing.assert_close(got[: len(lens)], ref, **tolerance(dtype))
    assert (got[len(lens):] == 0).all()


@pytest.mark.parametrize("dtype,splits,shared_blocks", [
    (torch.float32, 2, 0), pytest.param(torch.float16, 1, 0, marks=SLOW),
    pytest.param(torch.float32, 1, 11, marks=SLOW), (torch.float16, 2, 11)])
def test_decode_kernel_rotates_q_and_the_new_key(interpreted, dtype, splits, shared_blocks):
    """With the rotary tables given, q and the step's K come unrotated: the kernels rotate
    them at each row's position (seq_len - 1), so the output and the stored key equal the
    rotary op's followed by the unrotated kernel; with the cascade, the prefix programs
    rotate their rows too."""
    from raygraph.model.ops import rotary

    attn = interpreted("triton_attention")
    lens = [177 + 7 * i for i in range(6)] if shared_blocks else [3, 40, 100, 190]
    kc, vc, tables, seq_lens, q, k_new, v_new, _, _, unrotated = decode_case(
        dtype, lens, shared_blocks, 2, seed=5)
    cos, sin = torch.randn(2, 512, D // 2)  # any tables: the kernels read, not derive them
    pos = (seq_lens.long() - 1).clamp(min=0)
    rq, rk = rotary(q, k_new, cos, sin, pos)  # the torch path: fp32 math, cast back
    shared = torch.tensor([shared_blocks * BS], dtype=torch.int32) if shared_blocks else None
    want_k, want_v = kc.clone(), vc.clone()
    want = attn.paged_decode_attention(rq, want_k, want_v, tables, seq_lens, D**-0.5, rk,
                                       v_new, splits=splits, shared_len=shared)
    got = attn.paged_decode_attention(q, kc, vc, tables, seq_lens, D**-0.5, k_new, v_new,
                                      splits=splits, shared_len=shared, rope=(cos, sin))
    n = len(lens)
    # one bf16/fp16 rounding of a rotated element may differ (fma contraction)
    torch.testing.assert_close(kc, want_k, **tolerance(dtype))
    torch.testing.assert_close(got[:n], want[:n], **tolerance(dtype))
    assert (got[n:] == 0).all()
    # the rotation is not a no-op here: the output is not the unrotated reference's
    assert not torch.allclose(got[:n], unrotated, **tolerance(dtype))


def test_large_batches_split_less():
    """Splits per sequence: more for few sequences, fewer once the (sequence, KV head)
    pairs alone pass MAX_PROGRAMS, never under MIN_SPLITS with the cascade, and one (no
    merge) for a plain batch of ONE_SPLIT_PAIRS pairs (at a 4096-key table)."""
    attn = pytest.importorskip("raygraph.model.triton_attention")
    assert [attn.num_splits(4096, b, 8, cascade=True) for b in (1, 8, 32, 64, 256)] == \
        [32, 16, 4, 2, 2]
    assert [attn.num_splits(4096, b, 8) for b in (1, 8, 32, 64, 256)] == [32, 16, 4, 1, 1]
    assert attn.num_splits(4096, 64, 4) == 4  # 256 pairs: still split
    assert attn.num_splits(256, 1, 8) == 4  # a short table: one tile a split
    assert attn.MIN_SPLITS == 2 and attn.ONE_SPLIT_PAIRS == 512


def test_decode_window_ignores_the_cascade(interpreted):
    """With a window the splits start at the window's first key; a shared prefix is not
    used (the window's keys differ per row)."""
    attn = interpreted("triton_attention")
    lens = [40, 100, 190]
    kc, vc, tables, seq_lens, q, _, _, _, _, _ = decode_case(torch.float32, lens, 0, 0, seed=3)
    md = prepare_batch(StepPlan(0, [SeqChunk(i, [1], n - 1, tables[i, : -(-n // BS)].tolist(),
                                             True) for i, n in enumerate(lens)]),
                       BS, torch.device("cpu")).ctx.attn
    ref = paged_attention_ref(q, kc, vc, md, D**-0.5, window=37)
    shared = torch.tensor([32], dtype=torch.int32)
    got = attn.paged_decode_attention(q, kc, vc, tables, seq_lens, D**-0.5, window=37,
                                      splits=2, shared_len=shared)
    torch.testing.assert_close(got, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_kernel_matches_reference(interpreted, dtype):
    """Packed chunks over cached prefixes, GQA, padding rows zeroed."""
    attn = interpreted("triton_attention")
    torch.manual_seed(7)
    blocks = 64
    seqs = packed_chunks([(5, 0), (40, 70), (1, 33), (70, 0)], blocks, random.Random(7))
    kc = torch.randn(blocks + 1, BS, HKV, D, dtype=dtype)
    vc = torch.randn_like(kc)
    md = prepare_batch(StepPlan(0, seqs), BS, torch.device("cpu")).ctx.attn
    q = torch.randn(md.num_tokens + 9, HKV * GROUP, D, dtype=dtype)
    ref = paged_attention_ref(q[: md.num_tokens], kc, vc, md, D**-0.5)
    out = torch.full_like(q, float("nan"))  # every row must be written
    got = attn.paged_prefill_attention(q, kc, vc, md.block_tables, md.seq_lens, md.query_start,
                                       D**-0.5, out=out)
    torch.testing.assert_close(got[: md.num_tokens], ref, **tolerance(dtype))
    assert (got[md.num_tokens:] == 0).all()


def test_a_head_the_decode_kernel_does_not_take_decodes_through_the_prefill_kernel(
        interpreted, monkeypatch):
    """The decode kernel's heads are a power of two wide; a decode step of 80-wide heads
    goes through the prefill kernel (the step's K/V stored first), equal to the reference."""
    from raygraph.model import ops

    interpreted("triton_attention")
    interpreted("triton_ops")
    monkeypatch.setattr(ops, "kernels", lambda x: True)
    torch.manual_seed(4)
    lens, d = [40, 100, 190], 80
    blocks = sum(-(-n // BS) for n in lens)
    md = prepare_batch(StepPlan(0, decode_seqs(lens, 0, blocks, random.Random(4))), BS,
                       torch.device("cpu")).ctx.attn
    assert md.decode
    kc = torch.randn(blocks + 1, BS, HKV, d, dtype=torch.float16)
    vc = torch.randn_like(kc)
    q = torch.randn(len(lens), HKV * GROUP, d, dtype=torch.float16)
    k, v = torch.randn(2, len(lens), HKV, d, dtype=torch.float16)
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k, v, ref_k, ref_v, md.slot_mapping)
    ref = paged_attention_ref(q, ref_k, ref_v, md, d**-0.5)
    got = ops.paged_attention(q, k, v, kc, vc, d**-0.5, md)
    torch.testing.assert_close(got, ref, **tolerance(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.float32, marks=SLOW)])
def test_a_mixed_step_gives_its_leading_decode_rows_to_the_decode_kernel(interpreted,
                                                                         monkeypatch, dtype):
    """A step that is not all decode: its leading one-token sequences (row b holds sequence
    b's token) go through the decode kernel, the prompt chunks and a one-token chunk after
    them through the prefill kernel, which leaves the decode rows as they are; together
    equal to the reference, padding rows zero."""
    from raygraph.model import ops

    attn = interpreted("triton_attention")
    interpreted("triton_ops")
    monkeypatch.setattr(ops, "kernels", lambda x: True)
    torch.manual_seed(9)
    blocks = 96
    seqs = packed_chunks([(1, 39), (1, 99), (40, 70), (1, 33), (70, 0)], blocks,
                         random.Random(9))
    kc = torch.randn(blocks + 1, BS, HKV, D, dtype=dtype)
    vc = torch.randn_like(kc)
    md = prepare_batch(StepPlan(0, seqs), BS, torch.device("cpu")).ctx.attn
    assert not md.decode
    assert ops.decode_rows(md).tolist() == [40, 100, 0, 0, 0]
    t = md.num_tokens + 9  # padding rows after the real ones
    q, k, v = torch.randn(3, t, HKV * GROUP, D, dtype=dtype)
    k, v = k[:, :HKV], v[:, :HKV]
    md.slot_mapping = torch.cat([md.slot_mapping, md.slot_mapping.new_full((9,), -1)])
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k[: md.num_tokens], v[: md.num_tokens], ref_k, ref_v,
             md.slot_mapping[: md.num_tokens])
    ref = paged_attention_ref(q[: md.num_tokens], ref_k, ref_v, md, D**-0.5)
    got = ops.paged_attention(q, k, v, kc, vc, D**-0.5, md)
    torch.testing.assert_close(got[: md.num_tokens], ref, **tolerance(dtype))
    assert (got[md.num_tokens:] == 0).all()
    # the prefill kernel alone leaves the decode kernel's rows untouched
    out = torch.full_like(q, float("nan"))
    attn.paged_prefill_attention(q, kc, vc, md.block_tables, md.seq_lens, md.query_start,
                                 D**-0.5, out=out, skip_one=True)
    assert out[:2].isnan().all() and not out[2:].isnan().any()


def test_a_mixed_step_through_the_graph_buffers_equals_eager_bit_for_bit(interpreted,
                                                                         monkeypatch):
    """The mixed split as a full prefill graph runs it (InputBuffers: sequences padded to
    min(max_seqs, bucket) with kv length 0 and starts at the real token count, a padded
    bucket, full-width tables, so the decode kernel takes other split counts than eager's)
    gives the eager metadata's rows bit for bit and zero padding rows; torch.empty is
    NaN-poisoned, as a GPU's reused memory would be, so a row neither kernel writes shows."""
    from raygraph.graph.inputs import InputBuffers, host_inputs
    from raygraph.model import ops

    attn = interpreted("triton_attention")
    interpreted("triton_ops")
    monkeypatch.setattr(ops, "kernels", lambda x: True)
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))
    rng, hkv, group, d = random.Random(3), 2, 2, 64  # the built-in model's heads
    torch.manual_seed(3)
    lens = [(1, rng.randint(10, 107)) for _ in range(12)] + [(23, 0), (11, 40), (1, 60),
                                                              (30, 0)]
    blocks = 120
    plan = StepPlan(0, packed_chunks(lens, blocks, rng))
    kc0 = torch.randn(blocks + 1, BS, hkv, d)
    vc0 = torch.randn_like(kc0)

    def run(md, t):
        torch.manual_seed(11)  # q, k, v strided views of one qkv row, as the model's
        q, k, v = torch.randn(t, (hkv * group + 2 * hkv) * d).split(
            [hkv * group * d, hkv * d, hkv * d], -1)
        return ops.paged_attention(q.view(t, -1, d), k.view(t, hkv, d), v.view(t, hkv, d),
                                   kc0.clone(), vc0.clone(), d**-0.5, md)

    eager = prepare_batch(plan, BS, torch.device("cpu")).ctx.attn
    n = eager.num_tokens
    assert (ops.decode_rows(eager) > 0).sum() == 12
    want = run(eager, n)
    h = host_inputs(plan, BS)
    bufs = InputBuffers(128, 24, 40, torch.device("cpu"))
    bufs.fill(h, 80, 24)  # a bucket of 80 rows, 24 sequence rows (16 real)
    graph = bufs.metadata(80, 24, n, h.max_q_len, max(h.seq_lens), False)
    splits = (attn.num_splits(40 * BS, 24, hkv),
              attn.num_splits(eager.block_tables.shape[1] * BS, eager.block_tables.shape[0], hkv))
    assert splits[0] != splits[1]
    # bit for bit by construction, not by luck: in both layouts a split holds at most one
    # tile of a decode row's keys (a split is whole tiles), so each tile is a partial of its
    # own and the merges differ only by exact zeros (the larger count's empty lanes)
    assert min(splits) > 1
    assert max(ctx + 1 for n_, ctx in lens if n_ == 1) <= attn.TILE * min(splits)
    got = run(graph, 80)
    assert torch.equal(got[:n], want) and not want.isnan().any()
    assert (got[n:] == 0).all()


@pytest.mark.parametrize("dtype,splits,rope,group", [
    (torch.float32, 1, False, 4), (torch.float16, 2, True, 4), (torch.float16, 1, True, 8),
    pytest.param(torch.float16, 4, False, 4, marks=SLOW)])
def test_decode_kernel_verifies_drafts_as_rows(interpreted, dtype, splits, rope, group):
    """A sequence verifying drafts runs a decode row per token, consecutive, each a query at
    its own position: a row takes its chunk's earlier keys from those rows' K/V (their
    programs store them in the same launch, so the cache cannot be read for them), its own
    as before. Equal to the reference over the cache with every key stored; plain decode
    rows and padding rows beside them; chunks that straddle tiles and splits. At one split
    a chunk's rows attend in one program (up to 32 query rows: with 8 query heads a KV head,
    4 rows, so the 5-row chunk takes two). (The
    interpreter runs programs one by one, so a read of the cache there would find the key
    already stored: the race itself is the GPU test's, tests/gpu/test_graphs_gpu.py.)"""
    attn = interpreted("triton_attention")
    case = verify_rows_case(dtype, torch.device("cpu"), rope, group=group)
    assert case["verify_row"] == [0, 1, 2, 3, 4, 0, 0, 1, 2, 0, 1, 0]
    a, rows = case["args"], case["rows"]
    got = attn.paged_decode_attention(**a, scale=D**-0.5, splits=splits)
    torch.testing.assert_close(a["k_cache"], case["ref_k"], **tolerance(dtype))
    torch.testing.assert_close(a["v_cache"], case["ref_v"], **tolerance(dtype))
    torch.testing.assert_close(got[:rows], case["ref"], **tolerance(dtype))
    assert (got[rows:] == 0).all()


@pytest.mark.parametrize("case", ["one split", "merged splits", "verify chunks"])
def test_decode_kernel_stores_float16_rows_standing_for_q(interpreted, case):
    """half=True (attention feeding an FP8 output projection at decode rows): the rows
    computed as without it, rounded to q's dtype (here float32: the interpreter has no
    bfloat16), then stored in float16 clamped to its range (65504, not inf): by the split
    that writes them itself, by the merge, by a verify chunk's program."""
    attn = interpreted("triton_attention")
    if case == "verify chunks":
        a = verify_rows_case(torch.float32, torch.device("cpu"), True)["args"] | dict(splits=1)
    else:
        kc, vc, tables, seq_lens, q, k_new, v_new, *_ = decode_case(
            torch.float32, [1, 17, 150], 0, 1, seed=4)
        a = dict(q=q, k_cache=kc, v_cache=vc, block_tables=tables, seq_lens=seq_lens,
                 k_new=k_new, v_new=v_new, splits=1 if case == "one split" else 4)
    a["v_cache"][..., :3] *= 1e5  # dims 0-2 past float16's range
    a["v_new"][..., :3] *= 1e5
    caches = (a["k_cache"].clone(), a["v_cache"].clone())
    whole = attn.paged_decode_attention(**a, scale=D**-0.5)
    a["k_cache"], a["v_cache"] = caches  # as before the first call stored the step's keys
    half = attn.paged_decode_attention(**a, scale=D**-0.5, half=True)
    assert half.dtype == torch.float16 and whole.dtype == torch.float32
    assert whole.abs().max() > 65504 and not torch.equal(whole, whole.half().float())
    assert torch.equal(half, whole.clamp(-65504, 65504).half())


def test_decode_cascade_from_the_batch_metadata(interpreted):
    """The host's shared-prefix length (prepare_batch) drives the kernel: a cached 272-key
    system prompt under 8 sequences, the step's K/V stored through the same call."""
    attn = interpreted("triton_attention")
    lens = [273 + 9 * i for i in range(8)]  # 17 shared blocks, then each sequence's own
    kc, vc, tables, seq_lens, q, k_new, v_new, ref_k, ref_v, ref = decode_case(
        torch.float16, lens, 17, 0, seed=11)
    plan = StepPlan(0, [SeqChunk(i, [1], n - 1, tables[i, : -(-n // BS)].tolist(), True)
                        for i, n in enumerate(lens)])
    md = prepare_batch(plan, BS, torch.device("cpu"), cascade=True).ctx.attn
    assert md.shared_len.tolist() == [272]
    got = attn.paged_decode_attention(q, kc, vc, md.block_tables, md.seq_lens, D**-0.5, k_new,
                                      v_new, shared_len=md.shared_len)
    assert torch.equal(kc, ref_k)
    torch.testing.assert_close(got, ref, **tolerance(torch.float16))
