"""A site's verdict in one round of the update check (server/checks/update_check.py), and what a round's close
reads off the round's verdicts: who is left out, who is merged clipped and by how much, the weights that count
byte-identical updates once, and the margins logged per round.

Its own module because the verdict is the check's output, read by more than the check: the close
(server/rounds/shard_close.py: what to leave out or clip, the record the rounds chain keeps), a site's
record (server/rounds/round_close.py) and the faults bench (bench/faults.py) use it and these functions
without the judging itself, which is update_check.py's concern.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SiteVerdict:
    """One site's figures in one round and what the check made of them."""

    cluster: str
    norm: float
    norm_ratio: float | None
    cosine_others: float | None
    cosine_previous: float | None
    replayed: bool
    reasons: tuple[str, ...]  # why flagged: non_finite, outsized, disagrees, against_previous, replayed
    quarantined: bool  # flagged quarantine_rounds rounds in a row, and not yet passed as many (or readmitted)
    excluded: bool  # left out of the round (mode exclude, or clip for a flag other than size)
    scale: float = 1.0  # mode clip: merged as scale·Δ (< 1: clipped to the reference norm)
    overruled: bool = False  # more than max_flagged of the round flagged: nobody left out or clipped, no streak
    copies: int = 1  # sites whose contribution here is byte for byte this one's (> 1: a copy; counted once)

    def record(self) -> dict:
        """What the rounds chain keeps of it (server/state/provenance_chain.py): the figures and the outcome."""
        return {
            **self.figures(),
            "replayed": self.replayed,
            "reasons": list(self.reasons),
            "quarantined": self.quarantined,
            "excluded": self.excluded,
            **({"scale": self.scale} if self.scale != 1.0 else {}),
            **({"overruled": True} if self.overruled else {}),
            **({"copies": self.copies} if self.copies > 1 else {}),
        }

    def figures(self) -> dict:
        rounded = lambda x: None if x is None else round(x, 4) if math.isfinite(x) else str(x)  # noqa: E731 - JSON has no inf
        return {
            "norm": rounded(self.norm),
            "norm_ratio": rounded(self.norm_ratio),
            "cosine_others": rounded(self.cosine_others),
            "cosine_previous": rounded(self.cosine_previous),
        }


def copied_weights(
    verdicts: Iterable[SiteVerdict], weights: Mapping[str, float], digests: Mapping[str, bytes]
) -> dict[str, float]:
    """The weights that count each byte-identical update once (mode clip or exclude): every site of a group of
    k copies weighs the group's smallest weight / k, so together they weigh what one of them would."""
    groups: dict[bytes, list[str]] = {}
    for v in verdicts:
        if v.copies > 1 and not v.excluded and v.cluster in digests:
            groups.setdefault(digests[v.cluster], []).append(v.cluster)
    return {
        c: min(weights[d] for d in group) / len(group) for group in groups.values() if len(group) > 1 for c in group
    }


def excluded(verdicts: Iterable[SiteVerdict]) -> set[str]:
    return {v.cluster for v in verdicts if v.excluded}


def clipped(verdicts: Iterable[SiteVerdict]) -> dict[str, float]:
    """Clip factors of the sites merged clipped (mode clip), by cluster."""
    return {v.cluster: v.scale for v in verdicts if v.scale != 1.0}


def margins(verdicts: Iterable[SiteVerdict]) -> dict:
    """The round's closest figures to the thresholds (the lowest cosines, the largest norm ratio): one log
    line per round that shows how far honest sites are from a flag, what the defaults were set from."""
    verdicts = list(verdicts)

    def extreme(pick, values) -> float | None:  # noqa: ANN001
        values = [v for v in values if v is not None and math.isfinite(v)]
        return round(pick(values), 4) if values else None

    return {
        "max_norm_ratio": extreme(max, (v.norm_ratio for v in verdicts)),
        "min_cosine_others": extreme(min, (v.cosine_others for v in verdicts)),
        "min_cosine_previous": extreme(min, (v.cosine_previous for v in verdicts)),
        "flagged": sorted(v.cluster for v in verdicts if v.reasons),
    }
