"""What a shard records of its run beyond the model's parameter list, and how it may change: the run's
tokenizer (fixed by the first joiner, checked at every join) and its length (raised on purpose only).

Plain functions over the recorded values, so that the rules are testable without a shard; `Shard`
calls them under its lock and keeps the results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dilocox.common.config.run import final_version_of, flush_version_of
from dilocox.common.wire.assignment import tokenizer_digest_of
from dilocox.common.wire.errors import InvalidFrame, TokenizerMismatch
from dilocox.common.wire.staleness import STALE_WEIGHTINGS


@dataclass(frozen=True)
class RecordedRun:
    """What the shard reads from the run configuration its first cluster sent, parsed once per recorded
    configuration (every pull asks for the final version, every close for the other two)."""

    source: str
    final_version: int | None  # the run's last version; None if unknown
    flush_version: int | None  # the end-of-run flush's version: not judged by training rounds' rules
    stale_rule: str  # how the run weighs late work (its sites' --stale-weighting)

    @classmethod
    def of(cls, run_config_json: str) -> RecordedRun:
        try:
            rule = json.loads(run_config_json or "{}").get("stale_weighting", "inverse")
        except (ValueError, AttributeError):
            rule = "inverse"
        rule = rule if rule in STALE_WEIGHTINGS else "inverse"
        return cls(run_config_json, final_version_of(run_config_json), flush_version_of(run_config_json), rule)


def admit_tokenizer(recorded: tuple[str, str], cluster: str, digest: str, definition: str) -> tuple[str, str]:
    """The run's (digest, tokenizer.json) after `cluster` joins with its own: the first joiner's becomes
    the run's; another digest is refused naming both; a definition that is not its digest's is refused.
    A join without a digest (a client from before the check) changes and checks nothing."""
    if not digest:
        return recorded
    if definition and digest != tokenizer_digest_of(definition):
        raise InvalidFrame(f"tokenizer digest {digest[:19]}… does not match the tokenizer.json sent with it")
    if not recorded[0]:
        return digest, definition
    if digest != recorded[0]:
        raise TokenizerMismatch(
            f"cluster {cluster!r} tokenizes with {digest}, this run with {recorded[0]}: its token ids would mean other "
            "text in the same model. Give every site the run's tokenizer.json (--tokenizer PATH, or data prepared "
            'with it; docs/deploy.md, "Your data at each site")'
        )
    return recorded


def extended_run_config(run_config_json: str, rounds: int) -> tuple[str, int]:
    """(the recorded run configuration with `rounds` rounds, the rounds it had): `dilocox server --resume
    --rounds N`. Refuses a run with no recorded configuration, and a shorter run."""
    try:
        recorded = json.loads(run_config_json or "{}")
    except ValueError:
        recorded = {}
    if not isinstance(recorded, dict) or "rounds" not in recorded:
        raise ValueError("no recorded run configuration to extend (no cluster has joined this run yet)")
    before = int(recorded["rounds"])
    if rounds < before:
        raise ValueError(
            f"--rounds {rounds}: the run already has {before} rounds; a run can be extended, not shortened"
        )
    return json.dumps({**recorded, "rounds": rounds}), before
