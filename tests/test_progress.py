"""The worker's round progress bar: drawn on a terminal for key=value logs, never into JSON logs or pipes."""

from __future__ import annotations

import io

from dilocox.worker.exchange.cluster import RoundReport
from dilocox.worker.progress import chain, progress_for


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def report(round_: int, eval_loss: float) -> RoundReport:
    return RoundReport(round_, 2.5, eval_loss, 1024, 10, 10, 1.0, 0.2, 0.05, 1.1, 0.9)


def test_bar_follows_versions_and_shows_losses_on_a_terminal():
    screen = Terminal()
    bar = progress_for(10, "site-a", "kv", screen)
    assert bar is not None
    bar(report(1, 3.25), 50, 1)
    bar(report(4, float("nan")), 50, 4)  # a rejoin skipped rounds 2-3: the bar jumps with the round number
    bar.close()
    text = screen.getvalue()
    assert "site-a" in text and "4/10" in text and "eval=3.250" in text and "train=2.500" in text


def test_no_bar_in_pipes_or_with_json_logs():
    assert progress_for(10, "site-a", "kv", io.StringIO()) is None
    assert progress_for(10, "site-a", "json", Terminal()) is None


def test_chain_calls_every_observer_in_order():
    calls = []
    observe = chain(lambda *a: calls.append(("metrics", a)), None, lambda *a: calls.append(("bar", a)))
    observe("r", 50, 3)
    assert calls == [("metrics", ("r", 50, 3)), ("bar", ("r", 50, 3))]
    assert chain(None, None) is None
