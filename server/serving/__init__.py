"""How a shard is served over gRPC: the servicer and its grpc.aio host (`servicer`, `aio_servicer`,
`grpc_server`), the bounds on a push's intake (`push_intake`) and its commit into the round (`shard_pushes`),
pulls and their framing (`shard_pulls`, `pull_framing`), and health that says whether the shard can take work
(`health`, `health_watch`)."""
