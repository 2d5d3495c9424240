"""One engine = one replica: its own actor with the step loop, schedulers, KV page pools,
capture policy, sleep and worker group."""
