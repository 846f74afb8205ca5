"""What the workers and the parameter server share: the wire format and its schema, the keys that secure it,
the shared-memory segments of pushes on one machine, the checkpoint format, and the partition of a model over
the shards of a sharded PS. Nothing here imports a worker's or the PS's modules, torch or Lightning."""
