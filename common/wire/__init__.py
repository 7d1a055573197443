"""The wire: everything a shard and a cluster must decode and compute identically, byte for byte.

Framing and bundles, codecs (dense, quantised, low rank), the adaptive compressor, the deterministic
shard assignment, the weighted mean and the outer Nesterov step. Pure functions and small classes over
tensors and bytes; nothing here imports configuration, deployment or gRPC servers.
"""
