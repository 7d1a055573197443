"""The median of the *other* sites' values, for every site at once: the leave-one-out reference that the
shards' weight cap (common/wire/staleness.py), clipped mean (server/checks/robust_mean.py) and update check
(server/checks/update_check.py) all judge a site against, so that no site can move its own bound.

Why its own module: the three computed it each their own way, each re-sorting the others per site —
quadratic in sites, in the round's close, where 256 sites are a measured case. Here one sort serves every
site: removing one value from a sorted list shifts the middle by at most one place.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence


def _middle(ordered: Sequence[float], skip: int) -> float:
    """The median of `ordered` (sorted) without its element at `skip`, as `statistics.median` gives it."""
    n = len(ordered) - 1
    at = lambda k: ordered[k if k < skip else k + 1]  # noqa: E731 - the k-th of the list without `skip`
    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def medians_of_others(values: Mapping[str, float]) -> dict[str, float | None]:
    """For each key, the median of the other keys' values (None where there is no other)."""
    ordered = sorted(values.values())
    if len(ordered) < 2:
        return dict.fromkeys(values)
    return {key: _middle(ordered, bisect.bisect_left(ordered, value)) for key, value in values.items()}


def median_without(ordered: Sequence[float], own: Sequence[float]) -> float | None:
    """The median of sorted `ordered` with each of `own`'s values (a multiset in it) taken out once; None
    where nothing remains."""
    if not own:
        rest = ordered
    else:
        rest = list(ordered)
        for value in own:
            del rest[bisect.bisect_left(rest, value)]
    if not rest:
        return None
    n = len(rest)
    return rest[n // 2] if n % 2 else (rest[n // 2 - 1] + rest[n // 2]) / 2
