"""What the engine refuses, and in which words: torch's error types where torch's FSDP2
raises, modules sharded by torch's own fully_shard, a state dict that does not fit, a
parameter's own grad_dtype."""
