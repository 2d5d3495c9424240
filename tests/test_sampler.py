"""Sampler: greedy, temperature, top-k, top-p, and per-request seeded streams."""

from __future__ import annotations

import msgspec
import torch

from raygraph.protocol import SeqChunk
from raygraph.worker.sampler import sample


def chunk(seed: int | None = None, temperature: float = 1.0, top_k: int = 0,
          top_p: float = 1.0, num_generated: int = 0) -> SeqChunk:
    return SeqChunk(seq_id=0, token_ids=[1], start_pos=0, block_table=[0], sample=True,
                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    num_generated=num_generated)


def draws(logits: torch.Tensor, n: int, **kw: object) -> list[int]:
    """n seeded draws (seeds 0..n-1) of one logits row, batched as n rows."""
    chunks = [chunk(seed=i, **kw) for i in range(n)]
    return sample(logits.expand(n, -1).clone(), chunks, torch.Generator().manual_seed(0))


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [chunk(temperature=0.0) for _ in range(6)], torch.Generator())
    assert out == logits.argmax(-1).tolist()


def test_greedy_rows_mixed_with_sampled_rows() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g)
    chunks = [chunk(temperature=0.0), chunk(seed=1, temperature=5.0), chunk(temperature=0.0),
              chunk(seed=2, temperature=5.0)]
    out = sample(logits, chunks, g)
    assert [out[0], out[2]] == logits[[0, 2]].argmax(-1).tolist()


def test_device_greedy_ids_are_used_and_left_unwritten() -> None:
    """A graph's argmax output is taken as the greedy tokens; sampled rows go to a copy
    (the tensor is the graph's static output, rewritten by the next replay only)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 50, generator=g)
    greedy = torch.tensor([7, 8, 9])  # not logits' argmax: proves which one is read
    chunks = [chunk(temperature=0.0), chunk(seed=1, temperature=5.0), chunk(temperature=0.0)]
    out = sample(logits, chunks, g, greedy)
    assert [out[0], out[2]] == [7, 9]
    assert out[1] == sample(logits, chunks, g)[1]  # the seeded row draws the same either way
    assert greedy.tolist() == [7, 8, 9]


def test_top_k_1_is_argmax_at_any_temperature() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3))
    chunks = [chunk(seed=i, temperature=3.0, top_k=1) for i in range(8)]
    assert sample(logits, chunks, torch.Generator()) == logits.argmax(-1).tolist()


def test_top_k_restricts_to_the_k_largest() -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(4)) * 0.3  # near flat
    top = set(logits.topk(5).indices.tolist())
    got = draws(logits, 600, temperature=1.0, top_k=5)
    assert set(got) == top  # every draw is inside, and every top-k token is reachable
    # without the filter the same seeds reach far outside the top 5
    assert len(set(draws(logits, 600, temperature=1.0)) - top) > 10


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()  # shuffled: order must not matter
    assert set(draws(logits, 1000, top_p=0.7)) == {1, 3}
    assert set(draws(logits, 1000, top_p=0.85)) == {1, 3, 2}
    assert set(draws(logits, 1000, top_p=0.3)) == {1}  # the top token always stays
    assert set(draws(logits, 1000, top_p=1.0)) == {0, 1, 2, 3}


def test_top_k_and_top_p_together() -> None:
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # top_k=3 renormalises to [4/9, 3/9, 2/9] before top-p (as HF and vLLM do): the mass
    # before token 2 is 7/9 > 0.75, so it goes (without renormalising it would be 0.7: kept)
    assert set(draws(logits, 1000, top_k=3, top_p=0.75)) == {0, 1}
    assert set(draws(logits, 1000, top_k=3, top_p=0.8)) == {0, 1, 2}


def test_seeded_draw_ignores_the_rest_of_the_batch() -> None:
    g = torch.Generator().manual_seed(5)
    row = torch.randn(1, 100, generator=g)
    mine = chunk(seed=1234, temperature=1.5, num_generated=7)
    alone = [sample(row.clone(), [mine], torch.Generator().manual_seed(s))[0] for s in range(3)]
    assert len(set(alone)) == 1
    for others in range(1, 5):
        batch = torch.cat([torch.randn(others, 100, generator=g), row])
        chunks = [chunk(seed=None if i % 2 else i, temperature=0.7 + i, top_k=i * 3)
                  for i in range(others)] + [mine]
        assert sample(batch, chunks, g)[-1] == alone[0]
        # the seeded row first instead of last
        assert sample(batch.roll(1, 0), [mine] + chunks[:-1], g)[0] == alone[0]


def test_num_generated_moves_the_stream() -> None:
    row = torch.zeros(1, 1000)  # uniform: every index is a fresh draw
    stream = [sample(row.clone(), [chunk(seed=9, num_generated=i)], torch.Generator())[0]
              for i in range(20)]
    assert len(set(stream)) >= 15  # not one repeated draw
    again = [sample(row.clone(), [chunk(seed=9, num_generated=i)], torch.Generator())[0]
             for i in range(20)]
    assert stream == again
    other = [sample(row.clone(), [chunk(seed=10, num_generated=i)], torch.Generator())[0]
             for i in range(20)]
    assert other != stream


def test_unseeded_rows_use_the_batch_generator() -> None:
    logits = torch.zeros(16, 1000)
    chunks = [chunk() for _ in range(16)]
    a = sample(logits, chunks, torch.Generator().manual_seed(11))
    b = sample(logits, chunks, torch.Generator().manual_seed(11))
    c = sample(logits, chunks, torch.Generator().manual_seed(12))
    assert a == b and a != c and len(set(a)) > 10


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


def test_frequencies_follow_softmax_over_temperature() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    n = 4000
    for temperature in (0.6, 1.0, 2.0):
        got = draws(logits, n, temperature=temperature)
        counts = [got.count(i) for i in range(5)]
        expect = (logits / temperature).softmax(-1).tolist()
        # 4 degrees of freedom: P(chi2 > 25) < 1e-4; the draws are seeded, so no flakes
        assert chi_square(counts, expect) < 25, (temperature, counts)
        wrong = logits.softmax(-1).tolist() if temperature != 1.0 else (logits / 2).softmax(
            -1).tolist()
        assert chi_square(counts, wrong) > 25  # the test can tell temperatures apart


def test_staged_rows_sample_exactly_what_host_lists_do() -> None:
    """The served worker moves the sampled rows' parameters through a staging buffer (no
    host sync on CUDA): the draws must be the same, seeded and unseeded, greedy rows kept."""
    from raygraph.worker.sampler import SamplingRows, sample_tokens

    torch.manual_seed(4)
    logits = torch.randn(6, 50)
    chunks = [chunk(temperature=0.0), chunk(temperature=0.7, top_k=5, seed=3),
              chunk(temperature=1.3, top_p=0.8), chunk(temperature=0.0),
              chunk(temperature=0.9, top_k=2, top_p=0.5, seed=8), chunk(temperature=1.0)]
    staging = SamplingRows(8, logits.device)
    for trial in range(3):
        plain = sample_tokens(logits, chunks, torch.Generator().manual_seed(trial))
        staged = sample_tokens(logits, chunks, torch.Generator().manual_seed(trial),
                               staging=staging)
        assert torch.equal(plain, staged)
    assert staged[0] == logits[0].argmax() and staged[3] == logits[3].argmax()


def test_logits_in_the_model_dtype_sample_as_their_float32_copy() -> None:
    """A graph hands the sampler bfloat16 logits: sampled rows (temperature, top-k, top-p,
    seeds) and a verifying chunk's distribution are those of the float32 copy, exactly."""
    from raygraph.worker.sampler import chunk_probs

    logits = (torch.randn(8, 500, generator=torch.Generator().manual_seed(3)) * 4
              ).to(torch.bfloat16)
    chunks = [chunk(seed=i, temperature=0.7, top_k=40 * (i % 2), top_p=0.9) for i in range(8)]
    for _ in range(3):
        assert sample(logits, chunks, torch.Generator()) == \
            sample(logits.float(), chunks, torch.Generator())
        chunks = [msgspec.structs.replace(c, num_generated=c.num_generated + 1) for c in chunks]
    assert torch.equal(chunk_probs(logits, chunks[0]), chunk_probs(logits.float(), chunks[0]))


def test_top_p_1_keeps_every_token_of_a_large_vocabulary() -> None:
    """top_p == 1 turns the nucleus off: a float32 running sum reaches 1 long before a
    peaked row's tail, and every token there must still be drawable."""
    from raygraph.worker.sampler import _filter_top_k_top_p

    logits = torch.zeros(2, 152_064)
    logits[:, 7] = 30.0  # the rest: e^-30 each, ~1e-8 of the mass together
    kept = _filter_top_k_top_p(logits, torch.ones(2), torch.tensor([0, 0]),
                               torch.tensor([1.0, 0.5]))
    assert torch.isfinite(kept[0]).all()
    assert torch.isfinite(kept[1]).sum() == 1  # a nucleus of 0.5: the top token alone


def nucleus_margin(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """[R] how far each row's top_p is from every mass before a token of its top-k (float64;
    inf with top_p 1): past float32's rounding of the sums, ranking the candidates or the
    whole row must agree on the nucleus exactly, though their sums run over other widths."""
    ranked = (logits.double() / temperature.double().unsqueeze(1)).sort(-1, descending=True)
    ranked = ranked.values
    k = torch.where(top_k > 0, top_k, ranked.shape[-1]).unsqueeze(1)
    kth = ranked.gather(1, k - 1)
    mass = (ranked - ranked[:, :1]).exp().masked_fill(ranked < kth, 0.0)
    before = (mass.cumsum(-1) - mass) / mass.sum(-1, keepdim=True)
    gap = (before - top_p.double().unsqueeze(1)).abs().masked_fill(ranked < kth, float("inf"))
    return torch.where(top_p < 1, gap.amin(-1), float("inf"))


def test_a_top_k_filter_ranks_only_its_candidates_and_keeps_what_a_full_sort_keeps() -> None:
    """Rows that all keep at most RANKED_TOP_K tokens by top-k are ranked by `topk`; the kept
    logits are those of the whole-row sort, top-p applied within the top-k alike; tied
    logits at a cut stay together."""
    from raygraph.worker.sampler import RANKED_TOP_K, _filter_top_k_top_p

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 3000, generator=g) * 2  # distinct values: one ranking
    top_k = torch.tensor([1, 7, 50, RANKED_TOP_K, 200])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.93, 1.0])
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0])
    assert (nucleus_margin(logits, temperature, top_k, top_p) > 1e-4).all()
    whole = _filter_top_k_top_p(logits, temperature, top_k, top_p, (False, True))
    ranked = _filter_top_k_top_p(logits, temperature, top_k, top_p, (True, False))
    assert torch.equal(ranked, whole)
    assert torch.isfinite(whole).sum(-1).tolist()[0] == 1
    assert torch.isfinite(whole[2]).sum() < 50 and torch.isfinite(whole[4]).sum() == 200


def test_filter_paths_rank_the_least_the_rows_need() -> None:
    from raygraph.worker.sampler import RANKED_TOP_K, filter_paths

    def paths(*params: tuple[int, float], vocab: int = 5000) -> tuple[bool, bool]:
        chunks = [chunk(top_k=k, top_p=p) for k, p in params]
        return filter_paths(chunks, list(range(len(chunks))), vocab)

    assert paths((0, 1.0), (5000, 1.0), (9000, 1.0)) == (False, False)  # no ranking
    assert paths((40, 1.0), (7, 0.9), (0, 1.0)) == (True, False)
    assert paths((40, 1.0), (0, 0.9)) == (True, True)  # top-p alone: the whole row
    assert paths((RANKED_TOP_K + 1, 1.0)) == (False, True)
    assert paths((100, 0.5), vocab=50) == (False, True)  # a top-k past a small vocabulary


def test_each_row_keeps_in_a_batch_what_it_keeps_alone() -> None:
    """Each row takes the path its own parameters pick, whatever the batch computes for the
    others: a row without a filter keeps every token beside rows that rank candidates; a
    top-k row ranked by candidates, with tokens tied at its k-th past them, keeps what the
    sort of its whole row keeps (their mass counts in the nucleus' bound)."""
    from raygraph.worker.sampler import _filter_top_k_top_p, filter_paths

    g = torch.Generator().manual_seed(12)
    tied = torch.zeros(4096)
    tied[0] = 7.0  # the top token (a fifth of the mass), then 4,095 tied logits
    rows = torch.stack([torch.randn(4096, generator=g), tied, torch.randn(4096, generator=g),
                        torch.randn(4096, generator=g) * 3])
    params = [(0, 1.0), (2, 0.5), (5, 1.0), (0, 0.8)]  # none, ties, top-k, top-p alone
    chunks = [chunk(top_k=k, top_p=p) for k, p in params]
    t = torch.ones(4)
    k, p = torch.tensor([k for k, _ in params]), torch.tensor([p for _, p in params])

    def kept(r: torch.Tensor, i: list[int]) -> list[int]:
        out = _filter_top_k_top_p(r, t[i], k[i], p[i], filter_paths(chunks, i, 4096))
        return torch.isfinite(out).sum(-1).tolist()

    alone = [kept(rows[[i]], [i])[0] for i in range(4)]
    assert alone[0] == 4096 and alone[1] == 4096 and alone[2] == 5 and alone[3] < 4096
    assert kept(rows[:3], [0, 1, 2]) == alone[:3]  # candidates ranked, no sort
    assert kept(rows, [0, 1, 2, 3]) == alone  # both paths
    # the tie row ranked by candidates alone against its whole-row sort
    one = [1]
    assert torch.equal(_filter_top_k_top_p(rows[one], t[one], k[one], p[one], (True, False)),
                       _filter_top_k_top_p(rows[one], t[one], k[one], p[one], (False, True)))


def test_rows_without_a_filter_sample_from_the_whole_distribution() -> None:
    """No row filters, so no ranking runs: every token stays reachable (a near-flat row
    drawn 600 times reaches most of its 40 tokens), greedy rows untouched."""
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(7)) * 0.1
    got = draws(logits[0], 600, temperature=1.0, top_k=0, top_p=1.0)
    assert len(set(got)) > 35


def test_tokens_tied_at_a_cut_stay_together_and_bf16_rows_rank_as_their_float32_copy() -> None:
    """A cut is a threshold on the logits: every token tied with the last one kept stays
    (top-k 2 of [3, 2, 2, 2, 1] keeps four). bf16 rows, ranked in bf16, keep what their
    float32 copy keeps, and their kept logits are the float32 copy's over the temperature."""
    from raygraph.worker.sampler import _filter_top_k_top_p

    tied = torch.tensor([[2.0, 3.0, 2.0, 1.0, 2.0]])
    kept = _filter_top_k_top_p(tied, torch.ones(1), torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(kept).tolist() == [[True, True, True, False, True]]
    # top-p 0.5: the top token holds < 0.5, so the tied group after it stays whole
    kept = _filter_top_k_top_p(tied, torch.ones(1), torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isfinite(kept).tolist() == [[True, True, True, False, True]]
    g = torch.Generator().manual_seed(8)
    rows = (torch.randn(6, 4000, generator=g) * 3).to(torch.bfloat16)  # many ties
    t = torch.tensor([0.6, 1.0, 1.7, 0.3, 0.9, 1.2])
    k, p = torch.tensor([0, 10, 0, 200, 0, 3]), torch.tensor([0.9, 1.0, 0.5, 0.8, 0.99, 0.7])
    assert torch.equal(_filter_top_k_top_p(rows, t, k, p),
                       _filter_top_k_top_p(rows.float(), t, k, p))
