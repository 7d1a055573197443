"""The exchange with the shards: the round loop (`DilocoCluster`), the background `Communicator`, the
`AggregatorClient` (parallel streams, compression, replay of the outer step) and adaptive H."""
