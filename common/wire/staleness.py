"""How much work trained for an earlier round weighs when it is merged into a later one.

A round's mean is Σ w_i Δ_i / Σ w_i over the clusters that made it, w_i the tokens each trained. Work can
arrive *late*: a part a shard closed its round without is carried into the site's next push
(`worker/exchange/carry.py`), and a site that fell behind — stalled, preempted, restarted — pushes what
it trained for a closed round to the open one (`round_caught_up`). That work was computed from a model
`age` rounds older than the one it is merged into; at full weight it once took 95 % of a round (an
84-step pseudo-gradient from a start three rounds old against the other site's 4 steps) and blew the
model up. Two guards, one on each side of the wire:

* the site discounts what it sends late by its age, `stale_discount` (1 / (1 + age), the staleness
  weighting of asynchronous SGD): a carried part enters its next push scaled by it (and by no more than
  the push's own tokens), a caught-up push declares its age and is weighted by it;
* the shard caps any contribution that says it is stale at the mean weight of the round's on-time ones
  (`cap_stale_weights`), so one late site never outweighs those that kept time, whatever tokens it
  claims. The capped weights are the ones forwarded, so the clusters' replay stays bit-exact.

A third guard is not about age: **tokens are a claim, not a fact**. A site that says it trained
1000× the others' tokens would take over the mean; the shard caps each site's weight at `multiple` × the
median of the *other* sites' said tokens (`cap_claimed_weights`, the shards' `--max-weight-multiple`,
default 4: a site four times the size of the others' median still counts whole). Leave-one-out, so a site
cannot raise its own cap; with one site there is nothing to compare with. Forwarded like the stale cap.

`lenient` forgives one round (a part carried past a grace window by a hair counts whole, as before)
and discounts older work by 1/age; `full` keeps the weights as they were (the shard's cap still holds):
the comparisons `dilocox bench uneven --modes stall` measures.
"""

from __future__ import annotations

from collections.abc import Mapping

from dilocox.common.wire.peer_median import medians_of_others

STALE_WEIGHTINGS = ("inverse", "lenient", "full")
DEFAULT_MAX_WEIGHT_MULTIPLE = 4.0  # a site's weight: at most this × the median of the other sites' tokens


def check_rule(rule: str) -> str:
    if rule not in STALE_WEIGHTINGS:
        raise ValueError(f"stale weighting must be one of {', '.join(STALE_WEIGHTINGS)}, got {rule!r}")
    return rule


def stale_discount(age: int, rule: str = "inverse") -> float:
    """The factor on the tokens of work `age` rounds older than the round it is merged into."""
    if age < 0:
        raise ValueError(f"a staleness is a number of rounds ≥ 0, got {age}")
    rule = check_rule(rule)
    if rule == "full" or age == 0:
        return 1.0
    if rule == "lenient":  # a round late (a grace window's miss, carried) counts whole; older work 1/age
        return 1.0 if age == 1 else 1.0 / age
    return 1.0 / (1 + age)


def cap_stale_weights(weights: Mapping[str, float], ages: Mapping[str, int]) -> dict[str, float]:
    """Each contribution's weight in the round's mean: an on-time one (age 0) keeps its tokens; a stale one
    weighs at most the mean tokens of the round's on-time contributions (as it said, when none was on
    time: nothing to be fair to)."""
    on_time = [w for cluster, w in weights.items() if ages.get(cluster, 0) == 0]
    if not on_time or len(on_time) == len(weights):
        return dict(weights)
    fair = sum(on_time) / len(on_time)
    return {cluster: (min(w, fair) if ages.get(cluster, 0) > 0 else w) for cluster, w in weights.items()}


def cap_claimed_weights(weights: Mapping[str, float], multiple: float) -> dict[str, float]:
    """Each site's weight at most `multiple` × the median of the other sites' (0: no cap; one site: as said)."""
    if multiple <= 0 or len(weights) < 2:
        return dict(weights)
    others = medians_of_others(weights)
    return {cluster: min(w, multiple * others[cluster]) for cluster, w in weights.items()}
