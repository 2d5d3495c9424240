"""The per-GPU worker: device, process group, model shard, KV cache, executor."""
