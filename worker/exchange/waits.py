"""The site's waits, from the shortest to the longest, in one place (docs/deploy.md, "Waits and timeouts").

One rank can legitimately be inside an exchange for a long time: the communicator waits for a round's
result up to `PULL_WAIT_S` (re-pushing its part meanwhile), and each call to a shard that is down waits up
to the site's `--shard-wait-s` more. Its peers, meanwhile, wait for it in the boundary's next collective —
always an agreement, on a gloo group of its own (`SiteMesh.agreement_group`) — so the site's collective
timeout must outlast both: `collective_timeout_for`.
"""

from __future__ import annotations

PULL_WAIT_S = 3600.0  # a round's result, after the push
MARGIN_S = 600.0  # a boundary's own work on top (reshard, checkpoint staging, eval)


def collective_timeout_for(shard_wait_s: float, pull_wait_s: float = PULL_WAIT_S) -> float:
    """The site's collective timeout: longer than the longest legitimate exchange wait of one rank."""
    if shard_wait_s < 0 or pull_wait_s <= 0:
        raise ValueError(f"waits must be positive: shard wait {shard_wait_s}, pull wait {pull_wait_s}")
    return pull_wait_s + shard_wait_s + MARGIN_S
