"""What one bucket runs: a full graph (decode, and prefill by default) or a piecewise graph
(prefill with `prefill_graph = "piecewise"`).

Each comes in two backends with the same inputs and outputs: CUDA (captured graphs,
replayed) and eager (the same steps run live, on CPU or for debugging), so bucketing,
buffers, padding and the piecewise instruction sequence are exercised without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from raygraph.model.context import AttentionMetadata, ForwardContext
from raygraph.model.ops import paged_attention

Forward = Callable[[ForwardContext], Any]  # hidden states, or (logits, greedy ids) for decode


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream for every capture on a device (torch.cuda.graph keeps one too): cuBLAS
    allocates a workspace per stream on first use; a fresh stream per capture would put one
    into each graph's pool, and free it from under the graph on empty_cache()."""
    return torch.cuda.Stream(device)


@contextmanager
def capture_mode(device: torch.device):
    """GC off and the capture stream: the conditions every capture (and its warm-up,
    so per-stream state lands outside the graph pool) runs under. No collection runs while
    a graph is captured, so no finalizer can touch CUDA mid-capture; nor is one forced
    before it (torch.cuda.graph does): a full collection of a served worker's heap took
    0.10 s, 70% of a key's capture time in the background schedule."""
    enabled = gc.isenabled()
    gc.disable()
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        if enabled:
            gc.enable()


def new_graph() -> torch.cuda.CUDAGraph:
    """A graph that keeps its cudaGraph_t after capture, so its nodes can be counted."""
    return torch.cuda.CUDAGraph(keep_graph=True)


def end_capture(graph: torch.cuda.CUDAGraph) -> int | None:
    """End the capture, count the graph's nodes (None if the driver cannot tell), then
    instantiate it so the first replay pays nothing."""
    graph.capture_end()
    nodes = None
    try:
        from cuda.bindings import driver

        err, _, n = driver.cuGraphGetNodes(driver.CUgraph(graph.raw_cuda_graph()), 0)
        nodes = int(n) if err == driver.CUresult.CUDA_SUCCESS else None
    except Exception:  # an older cuda-python or torch: the count is informational only
        nodes = None
    graph.instantiate()
    return nodes


def abort_capture(graph: torch.cuda.CUDAGraph) -> None:
    """After an error mid-capture (e.g. the graph pool refused memory), take the stream out
    of capture so the process stays usable; the caller re-raises the error."""
    with contextlib.suppress(Exception):
        graph.capture_end()


class FullGraph:
    """The whole step, attention included, as one graph over the input buffers (decode, and
    full prefill)."""

    def __init__(self, forward: Forward, md: AttentionMetadata, cuda: bool, pool: Any) -> None:
        self.forward = forward
        self.md = md
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Any = None  # what forward returns (tensors the replay rewrites)
        self.num_nodes: int | None = None
        if cuda:
            device = md.slot_mapping.device
            with capture_mode(device):
                self.run(md)  # warm-up: allocator, Triton autotune and NCCL state settle eagerly
                self.graph = new_graph()
                self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    self.out = self.forward(ForwardContext(attn=md))
                except BaseException:
                    abort_capture(self.graph)
                    raise
                self.num_nodes = end_capture(self.graph)

    @property
    def num_pieces(self) -> int:
        return 0 if self.graph is None else 1

    def run(self, md: AttentionMetadata) -> Any:
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return self.forward(ForwardContext(attn=md))


@dataclass
class _Attn:
    """One captured split point: the static q/k/v the piece before it leaves behind."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    window: int


def run_attention(a: _Attn, md: AttentionMetadata, out: torch.Tensor) -> torch.Tensor:
    """Eager attention between pieces with this step's metadata, into the shared output
    (K/V stored for the whole bucket, padding slots are -1; padding rows come out zero)."""
    return paged_attention(a.q, a.k, a.v, a.k_cache, a.v_cache, a.scale, md,
                           out=out[: a.q.shape[0]], window=a.window)


class PiecewiseGraph:
    """Prefill: graphs between attention calls, attention run eagerly in between.

    Capture ends the current graph at each attention call (the split hook), records the
    static q/k/v, and begins the next graph; replay runs graph, attention, graph, ...
    `trace` records that instruction sequence on every run, for tests and logs.
    """

    def __init__(self, forward: Forward, md: AttentionMetadata, attn_out: torch.Tensor,
                 cuda: bool, pool: Any) -> None:
        self.forward = forward
        self.md = md
        self.attn_out = attn_out
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.attns: list[_Attn] = []
        self.out: torch.Tensor | None = None
        self.trace: list[str] = []
        self.num_nodes: int | None = None
        if cuda:
            self._capture(pool)

    @property
    def num_pieces(self) -> int:
        return len(self.graphs)

    def _capture(self, pool: Any) -> None:
        md = self.md
        num_tokens = md.slot_mapping.shape[0]
        graph = new_graph()
        nodes: list[int | None] = []

        def split(q, k, v, k_cache, v_cache, scale, window) -> torch.Tensor:
            nonlocal graph
            nodes.append(end_capture(graph))
            self.graphs.append(graph)
            self.attns.append(_Attn(q, k, v, k_cache, v_cache, scale, window))
            graph = new_graph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            return self.attn_out[:num_tokens]

        with capture_mode(md.slot_mapping.device):
            self.run(md)  # warm-up, eagerly, on the capture stream
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.out = self.forward(ForwardContext(attn=md, split=split))
            except BaseException:
                abort_capture(graph)
                raise
            nodes.append(end_capture(graph))
            self.graphs.append(graph)
        self.num_nodes = None if None in nodes else sum(nodes)

    def run(self, md: AttentionMetadata) -> torch.Tensor:
        self.trace = []
        if not self.graphs:  # eager backend: the same split points, run live
            def split(q, k, v, k_cache, v_cache, scale, window) -> torch.Tensor:
                self.trace += ["piece", "attention"]
                return run_attention(_Attn(q, k, v, k_cache, v_cache, scale, window), md,
                                     self.attn_out)

            out = self.forward(ForwardContext(attn=md, split=split))
            self.trace.append("piece")
            return out
        for i, graph in enumerate(self.graphs):
            graph.replay()
            self.trace.append("piece")
            if i < len(self.attns):
                run_attention(self.attns[i], md, self.attn_out)
                self.trace.append("attention")
        return self.out

