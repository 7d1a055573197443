"""The training thread's tokens/s with a cluster's exchange running beside it, against the same training alone:
what the GIL and core contention cost, for `dilocox bench exchange`.

Its own module because it is a different measurement from the per-stage timings (exchange.py): it runs
the default GPT's inner steps and only asks the exchange for whole rounds, beside it on a thread of its
own, and sets that against floors that are not the exchange at all (idle, in-cache, memory streaming).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import torch

from dilocox.worker.exchange.threads import use_exchange_threads


class ClusterRound(Protocol):
    """What runs beside training: one round of a cluster's exchange (exchange.LayerExchange), or a floor."""

    def round_of_cluster(self) -> None: ...


class FloorWork:
    """What any work on the exchange's core costs the trainer on this machine, measured beside it the same
    way: `stream` adds two model-sized tensors (memory traffic and nothing else), `cache` adds small
    ones that stay in the core's L2 (compute and nothing else), `idle` sleeps."""

    def __init__(self, kind: str, params: int) -> None:
        self.kind = kind
        self.big = [torch.randn(params), torch.randn(params), torch.empty(params)] if kind == "stream" else []
        self.small = [torch.randn(1 << 16) for _ in range(3)]

    def round_of_cluster(self) -> None:
        if self.kind == "stream":
            torch.add(self.big[0], self.big[1], out=self.big[2])
        elif self.kind == "cache":
            for _ in range(100):
                torch.add(self.small[0], self.small[1], out=self.small[2])
        else:
            time.sleep(0.01)


def training_beside_exchange(
    layer: ClusterRound, seconds: float, train_threads: int, exchange_threads: int, pace_s: float = 0.0
) -> dict:
    """tokens/s of the default GPT's inner steps at `train_threads`, alone and with a cluster's exchange
    beside it on its own thread budget: one round after the other without rest (`pace_s` 0, the worst
    case), or one round every `pace_s` seconds (a round's exchange beside a round's training). Each side
    trains for `seconds`, in batches of steps; alone is measured before and after, and the better kept.
    `lost_s_per_round`: the training time the exchange cost, per exchange round."""
    from dilocox.common.config.run import RunConfig
    from dilocox.worker.data.token_data import load_run_data
    from dilocox.worker.train.inner_trainer import InnerTrainer

    torch.set_num_threads(train_threads)
    config = RunConfig()
    trainer = InnerTrainer(config, load_run_data(config.tokenizer, None))
    trainer.train_steps(2)

    def tokens_per_s() -> float:
        started, tokens = time.perf_counter(), 0
        while time.perf_counter() - started < seconds:
            tokens += trainer.train_steps(5)[1]
        return tokens / (time.perf_counter() - started)

    alone = tokens_per_s()
    stop, rounds = threading.Event(), [0]

    def exchange() -> None:
        use_exchange_threads(exchange_threads)
        while not stop.is_set():
            began = time.perf_counter()
            layer.round_of_cluster()
            rounds[0] += 1
            stop.wait(max(0.0, pace_s - (time.perf_counter() - began)))

    beside = threading.Thread(target=exchange, name="exchange", daemon=True)
    beside.start()
    try:
        with_exchange = tokens_per_s()
    finally:
        stop.set()
        beside.join()
    alone = max(alone, tokens_per_s())  # alone once more: the machine's drift over the run
    kept = with_exchange / alone
    return {
        "train_threads": train_threads,
        "exchange_threads": exchange_threads,
        "pace_s": pace_s,
        "tokens_per_s_alone": round(alone),
        "tokens_per_s_with_exchange": round(with_exchange),
        "share_kept": round(kept, 3),
        "exchange_rounds_meanwhile": rounds[0],
        "lost_s_per_round": round(seconds * (1 - kept) / max(1, rounds[0]), 4),
    }
