"""The local simulation: shards and clusters on one machine, wired together.

The one place besides `bench/` that imports both `server/` and `worker/`: `dilocox sim` (subprocesses
on localhost, `main.py`) and the in-process form that tests and benchmarks use (`inprocess.py`).
"""
