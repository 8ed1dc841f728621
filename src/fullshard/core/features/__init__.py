"""Side roads of the engine, each off unless asked for: tensor-subclass parameters,
hpZ, int8 communication, parameters on disk, tensor parallelism and SPMD meshes, the
delayed update's pending shard, norms measured before the host copy, and the FSDP1
front's state-dict types."""
