"""Process-level first-use costs of the Triton kernels, paid while the weights load.

The first Triton launch in a process imports triton and hashes its own libraries for the
kernel-cache key: ~0.6 s on an H200 host with a warm kernel cache, all of it on the path
from "weights loaded" to the first token (the sizing forward paid it). A thread pays it
while the weights are still being read; the compiled kernels themselves are per kernel and
come from Triton's on-disk cache.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

log = logging.getLogger("raygraph.worker")


def start_triton_warmup(device: torch.device) -> threading.Thread | None:
    """A started thread that launches one small fused kernel on `device` (None off CUDA);
    join it before the first forward."""
    if device.type != "cuda":
        return None

    def run() -> None:
        t0 = time.perf_counter()
        try:
            torch.cuda.set_device(device)
            from raygraph.model.ops import rms_norm

            # two rows: launched in stream order (at one row the kernel would read its
            # weight before waiting for the fill that writes it)
            x = torch.ones(2, 64, device=device)
            rms_norm(x, torch.ones(64, device=device), 1e-6)
            torch.cuda.synchronize(device)
        except Exception as e:  # only a head start: the first forward pays it instead
            log.warning("Triton warm-up failed (%s: %s)", type(e).__name__, e)
            return
        log.info("Triton warmed up in %.2fs, while the weights loaded", time.perf_counter() - t0)

    thread = threading.Thread(target=run, name="raygraph-triton-warmup", daemon=True)
    thread.start()
    return thread
