"""The leave-one-out medians (common/wire/peer_median.py): bit for bit `statistics.median` of the others."""

from __future__ import annotations

import random
import statistics

from dilocox.common.wire.peer_median import median_without, medians_of_others


def test_one_sort_gives_every_sites_median_of_the_others_exactly():
    rng = random.Random(0)
    for _ in range(500):
        values = {f"s{i}": float(rng.choice([rng.randint(0, 4), rng.random()])) for i in range(rng.randint(1, 9))}
        got = medians_of_others(values)
        for key in values:
            others = [x for k, x in values.items() if k != key]
            assert got[key] == (statistics.median(others) if others else None), (values, key)
        ordered = sorted(values.values())
        own = rng.sample(ordered, rng.randint(0, len(ordered)))
        rest = list(ordered)
        for value in own:
            rest.remove(value)
        assert median_without(ordered, sorted(own)) == (statistics.median(rest) if rest else None)
