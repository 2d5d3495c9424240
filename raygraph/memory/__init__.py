"""Memory: KV page pool (pure Python bookkeeping), VMM pool, offload engine."""
