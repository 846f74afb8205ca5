"""The worker's side of a sharded PS: which modes and codecs work sharded and the shards' addresses
(``config``), the client that pushes to every shard at once (``client``), the addresses of one shard per node
(``per_node``), and reading the shards' checkpoints as one model (``checkpoint``)."""
