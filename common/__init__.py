"""Pieces both sides of a run share; no gRPC servers and no process state.

* `wire/`   — what a shard and a cluster must compute identically: framing, codecs, compression,
  shard assignment, the outer optimiser.
* `config/` — the run's typed configuration and where flag values come from (flags, environment, file).
* `deploy/` — how a run is put on machines: topology, docker-compose, certificates, link shaping.
* root     — the `dilocox` console script (`cli.py`) and small process helpers (logs, metrics, TLS
  channels, atomic files, subprocesses); they import nothing from the subpackages.
"""
