"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws from a generator keyed by (seed, output index), so the same
request gives the same tokens whatever it is batched with and after preemption.
"""

from __future__ import annotations

from functools import partial

import msgspec
import torch

from raygraph.model import ops
from raygraph.protocol import SeqChunk, TokenLogprobs

# a row whose top-k keeps at most RANKED_TOP_K tokens ranks its CANDIDATES largest logits
# (`topk`); any other row that filters (top-p alone, or a larger top-k) sorts its whole
# vocabulary. The room past the top-k keeps the tokens tied with its last one (a run of
# 16-bit logits can be long) in the mass top-p renormalises over.
RANKED_TOP_K = 256
CANDIDATES = 1024


def _cut(ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         rows: torch.Tensor | None = None) -> torch.Tensor:
    """[R] the smallest logit each row keeps, from its largest logits in descending order
    [R, W]: its top-k, then the nucleus of top-p renormalised within the top-k (every token
    tied with its k-th counted in). `rows`: the whole rows, when `ranked` holds only their
    candidates: tokens tied with the k-th past them count in the nucleus' bound too."""
    width = ranked.shape[-1]
    k = torch.where(top_k > 0, top_k, width).clamp(max=width)
    kth = ranked.gather(1, (k - 1).unsqueeze(1))
    top = ranked[:, :1]
    mass = (ranked - top).exp().masked_fill(ranked < kth, 0.0)
    total = mass.sum(-1)
    if rows is not None:
        beyond = (rows == kth).sum(-1) - (ranked == kth).sum(-1)
        total = total + beyond * (kth - top).squeeze(1).exp()
    # the tokens kept by top-p, in rank order: those whose mass before them is below top_p
    # (the top token always; past the top-k the mass before is all of it)
    kept = ((mass.cumsum(-1) - mass) < (top_p * total).unsqueeze(1)).sum(-1)
    nucleus = ranked.gather(1, (kept - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    # top_p 1 keeps every token, though a float32 sum reaches 1 before a long tail
    return torch.where(top_p < 1, torch.maximum(nucleus, kth.squeeze(1)), kth.squeeze(1))


def filter_paths(chunks: list[SeqChunk], rows: list[int], vocab: int) -> tuple[bool, bool]:
    """(whether a row ranks its top-k's candidates, whether a row sorts its vocabulary):
    the work a step's sampled rows need; (False, False) when none filters."""
    by_top_k = by_sort = False
    for i in rows:
        k, p = chunks[i].top_k, chunks[i].top_p
        small = 0 < k <= RANKED_TOP_K and k < vocab
        by_top_k |= small
        by_sort |= (0 < k < vocab or p < 1) and not small
    return by_top_k, by_sort


def _filter_top_k_top_p(logits: torch.Tensor, temperature: torch.Tensor,
                        top_k: torch.Tensor, top_p: torch.Tensor,
                        paths: tuple[bool, bool] = (True, True)) -> torch.Tensor:
    """The rows' float32 logits over their temperatures [R], with the tokens outside each
    row's top-k and top-p nucleus at -inf. Every token at or above a row's cut stays
    (tokens tied at a cut stay together, as a threshold on the logits keeps them). Each row
    takes one path by its own parameters (`filter_paths`), so its cut does not depend on
    the rows beside it: a top-k of at most RANKED_TOP_K ranks CANDIDATES candidates, any
    other filter sorts the row. Rows are ranked in their own dtype (a bf16 sort is half a
    float32's work) and only the ranked values scaled: dividing by a temperature keeps
    their order."""
    t = temperature.unsqueeze(1)
    scaled = logits / t
    vocab = logits.shape[-1]
    by_top_k, by_sort = paths
    small = (top_k > 0) & (top_k <= RANKED_TOP_K) & (top_k < vocab)
    cut = None
    if by_top_k:  # float32: the ranked rows / t as `scaled` has them
        cut = _cut(logits.topk(min(CANDIDATES, vocab), dim=-1).values / t, top_k, top_p,
                   scaled)
    if by_sort:
        whole = _cut(logits.sort(dim=-1, descending=True).values / t, top_k, top_p)
        cut = whole if cut is None else torch.where(small, cut, whole)
    if cut is None:
        return scaled
    filters = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    cut = torch.where(filters, cut, float("-inf"))
    return scaled.masked_fill(scaled < cut.unsqueeze(1), float("-inf"))


class SamplingRows:
    """The sampled rows' indices and parameters, moved to the device with no host sync: a
    tensor built from a list is a pageable, synchronous copy on CUDA, which would make the
    worker wait for the step it just queued. Rows go through a pinned staging buffer in one
    async copy; the staging is rewritten only once the previous copy has run."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        # [row, (index, temperature, top_k, top_p)]: a prefix of rows is contiguous
        self.host = torch.zeros(max_rows, 4, dtype=torch.float32, pin_memory=cuda)
        self.device = torch.zeros(max_rows, 4, dtype=torch.float32, device=device)
        self.copied = torch.cuda.Event() if cuda else None
        self._np = self.host.numpy()

    def upload(self, chunks: list[SeqChunk], rows: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row indices, temperatures, top_k, top_p) on the device, dtypes as `torch.tensor`
        of the lists would give."""
        if self.copied is not None:
            self.copied.synchronize()
        n = len(rows)
        self._np[:n] = [(i, chunks[i].temperature, chunks[i].top_k, chunks[i].top_p)
                        for i in rows]
        d = self.device[:n]
        d.copy_(self.host[:n], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return d[:, 0].long(), d[:, 1], d[:, 2].long(), d[:, 3]


def constrain(logits: torch.Tensor, greedy: torch.Tensor, sel: torch.Tensor,
              allowed: torch.Tensor, masked_logits: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax taken again for each grammar row with its disallowed tokens at -inf (sel:
    [R] row indices, allowed: [R, vocab] bool, on the logits' device), and the logits with
    those rows masked (or as given, when not `masked_logits`: no row samples from them).
    New tensors: a graph's outputs are read, never written."""
    masked = logits[sel].masked_fill(~allowed, float("-inf"))
    if masked_logits:
        logits = logits.index_copy(0, sel, masked)
    greedy = greedy.clone()
    greedy[sel] = ops.argmax(masked)
    return logits, greedy


def chunk_generator(chunk: SeqChunk, generator: torch.Generator, device: torch.device
                    ) -> torch.Generator:
    """The generator a chunk's draws come from: its own, keyed by (seed, output index), for
    a seeded request; else the worker's (every TP rank's advances alike)."""
    if chunk.seed is None:
        return generator
    gen = torch.Generator(device=device)
    gen.manual_seed(hash((chunk.seed, chunk.num_generated)) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


def chunk_probs(logits: torch.Tensor, chunk: SeqChunk) -> torch.Tensor:
    """The distribution [R, vocab] a chunk's request samples from at each of its logits rows
    [R, vocab]: temperature, then top-k and top-p. Built on the device (no host copy)."""
    return _chunk_scaled(logits, chunk).softmax(-1)


def _chunk_scaled(logits: torch.Tensor, chunk: SeqChunk) -> torch.Tensor:
    """`_filter_top_k_top_p` of rows that all take one chunk's parameters."""
    n, dev = logits.shape[0], logits.device
    full = partial(torch.full, (n,), device=dev)
    paths = filter_paths([chunk], [0], logits.shape[-1])
    return _filter_top_k_top_p(logits, full(chunk.temperature, dtype=torch.float32),
                               full(chunk.top_k, dtype=torch.long),
                               full(chunk.top_p, dtype=torch.float32), paths)


def sample_keyed(logits: torch.Tensor, chunk: SeqChunk, generator: torch.Generator
                 ) -> torch.Tensor:
    """Tokens [n] for a seeded chunk's n logits rows, each drawn as plain sampling draws
    its output index num_generated + i (same filter, same keyed noise): a verify step then
    keeps a draft where the request, decoding without drafts, would have drawn it, and
    emits the tokens it would have emitted, however its steps were cut or preempted."""
    keyed = [msgspec.structs.replace(chunk, num_generated=chunk.num_generated + i)
             for i in range(logits.shape[0])]
    return _race(_chunk_scaled(logits, chunk), keyed, list(range(len(keyed))), generator)


def _race(scaled: torch.Tensor, chunks: list[SeqChunk], rows: list[int],
          generator: torch.Generator) -> torch.Tensor:
    """A token from each row of `scaled` [len(rows), vocab] (filtered logits over their
    temperatures). Unseeded rows draw from the worker's generator in one call; a seeded row
    redraws its own from its (seed, output index) stream."""
    noise = torch.empty_like(scaled)
    if any(chunks[i].seed is None for i in rows):
        noise.exponential_(generator=generator)
    for j, i in enumerate(rows):
        if chunks[i].seed is not None:
            noise[j].exponential_(generator=chunk_generator(chunks[i], generator, scaled.device))
    # exponential race == multinomial draw: argmax p / E = argmax logit / t - log E
    return torch.sub(scaled, noise.log_(), out=noise).argmax(dim=-1)


def sample(logits: torch.Tensor, chunks: list[SeqChunk], generator: torch.Generator,
           greedy: torch.Tensor | None = None) -> list[int]:
    return sample_tokens(logits, chunks, generator, greedy).tolist()


def sample_tokens(logits: torch.Tensor, chunks: list[SeqChunk], generator: torch.Generator,
                  greedy: torch.Tensor | None = None, staging: SamplingRows | None = None,
                  masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Tokens [S] on the logits' device, with no host sync when `staging` is given or every
    row is greedy (the served loop keeps them there for the next step). logits: [S, vocab]
    in float32 or the model's dtype (sampled rows are widened to float32), one row per chunk
    (all chunks here sample); greedy: their argmax when the step already took it (a graph's
    output: read, never written). `masks`: (rows, allowed) of the rows that follow a grammar
    (`constrain`), which sample among its tokens only."""
    out = ops.argmax(logits) if greedy is None else greedy
    rows = [i for i, c in enumerate(chunks) if c.temperature > 0]
    if masks:
        logits, out = constrain(logits, out, *masks, masked_logits=bool(rows))
        greedy = None  # out is a new tensor already
    if rows:
        if greedy is not None:
            out = out.clone()
        dev = logits.device
        if staging is not None:
            sel, temp, top_k, top_p = staging.upload(chunks, rows)
        else:
            sel = torch.tensor(rows, device=dev)
            temp = torch.tensor([chunks[i].temperature for i in rows], device=dev)
            top_k = torch.tensor([chunks[i].top_k for i in rows], device=dev)
            top_p = torch.tensor([chunks[i].top_p for i in rows], device=dev)
        # float32 temperatures: the model's-dtype rows divide into float32
        paths = filter_paths(chunks, rows, logits.shape[-1])
        scaled = _filter_top_k_top_p(logits[sel], temp, top_k, top_p, paths)
        out[sel] = _race(scaled, chunks, rows, generator)
    return out


def logprob_rows(chunks: list[SeqChunk]) -> list[int]:
    """The rows that asked for logprobs (usually none: the step then does no logprob work)."""
    return [i for i, c in enumerate(chunks) if c.logprobs >= 0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[S, 1 + 2k] float32 on the logits' device: each row's sampled token's logprob, then
    its top-k logprobs (descending) and their ids (exact as float32 below 2**24), from the
    raw distribution (log_softmax of the float32 logits, before temperature or filters).
    Every row is computed, so no index tensor has to reach the device (no host sync); one
    tensor, so one copy to the host."""
    lsm = logits.float().log_softmax(-1)
    chosen = lsm.gather(1, tokens.view(-1, 1).long())
    if k == 0:
        return chosen
    values, ids = lsm.topk(k, dim=-1)
    return torch.cat([chosen, values, ids.float()], dim=1)


def unpack_logprobs(packed: list[list[float]], rows: list[int],
                    chunks: list[SeqChunk]) -> dict[int, TokenLogprobs]:
    """`token_logprobs` on the host -> row -> TokenLogprobs, each with its own k."""
    k = (len(packed[0]) - 1) // 2 if packed else 0
    out = {}
    for i in rows:
        row, n = packed[i], chunks[i].logprobs
        out[i] = TokenLogprobs(row[0], [int(t) for t in row[1 + k : 1 + k + n]], row[1 : 1 + n])
    return out
