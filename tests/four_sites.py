"""Four clusters against real shards, one of them faulty on demand: the update check's real-shard tests
(test_update_check.py, test_readmit.py) drive their rounds through this one script."""

from __future__ import annotations

import torch

from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import slice_tensors
from tests.test_downlink import PARAMS, low_rank_delta

FAULTY = 3  # the site whose update is × 100 in a faulty round


def start(clients: list[AggregatorClient]) -> None:
    """Every cluster joins, the first pushes the initial weights (zeros), every cluster pulls version 0."""
    for c in clients:
        c.join(PARAMS)
    clients[0].push(0, 1.0, slice_tensors(clients[0].assignment, {n: torch.zeros(s) for n, s in PARAMS}))
    for c in clients:
        assert c.pull(0, wait_seconds=10)[0] == 0


def play(clients: list[AggregatorClient], round_: int, faulty: bool, lasting: bool = True) -> None:
    """One round: each site pushes the round's common direction plus 0.3 × its own part (site FAULTY's
    update × 100 where `faulty`), then every site pulls the round. `lasting`: the direction is mostly the
    same from round to round, as training's is (else half the honest rounds point against the last one);
    otherwise a new one each round."""
    fresh = low_rank_delta(100 + round_)
    if lasting:
        base = low_rank_delta(100)
        fresh = {n: base[n] + 0.5 * t for n, t in fresh.items()}
    for i, c in enumerate(clients):
        own = low_rank_delta(10 * round_ + i)
        delta = {n: fresh[n] + 0.3 * own[n] for n, _ in PARAMS}
        if faulty and i == FAULTY:
            delta = {n: 100 * t for n, t in delta.items()}
        c.push(round_, 100.0, slice_tensors(c.assignment, delta))
    for c in clients:
        assert c.pull(round_, wait_seconds=10)[0] == round_
