"""Whether a site may start training a run, decided from the shards' join replies before any round.

Three refusals, each for a start that would otherwise waste a site's time or never end: the run is
over (the shards hold its final version and this site has trained nothing); the site would end the run
elsewhere than the shards record (more rounds: it would push past the end and wait for rounds no shard
closes; fewer: it would stop short); and a site new to the run arrives after rounds have closed (it
would train fewer rounds than it asked for). Each comes with its condition, so that a site's ranks can
agree on every one (they hold different shards, and may see different versions).
"""

from __future__ import annotations

from collections.abc import Iterator

from dilocox.common.config.run import final_version_of


class RunFinished(RuntimeError):
    """The shards already hold the run's final version: a cluster that starts now has nothing to train."""


class RunLengthMismatch(RunFinished):
    """The site was started to end at another version than the run's shards record."""


class LateJoin(RuntimeError):
    """A cluster new to the run arrives after rounds have closed: it would train fewer than it asked for."""


def admission_checks(
    run_id: str,
    rounds: int,
    own_config_json: str,
    run_config_json: str,
    held: int,
    fresh: bool,
    rejoin: bool,
    allow_late_join: bool,
) -> Iterator[tuple[bool, RuntimeError]]:
    """(refused here, the error) for each refusal in turn; `held`: the oldest version among the shards
    this rank joined; `fresh`: the site has trained no step yet; `rejoin`: the shards knew the site."""
    final = final_version_of(run_config_json)
    yield (
        final is not None and held >= final and fresh,
        RunFinished(
            f"run {run_id!r} has finished: the shards hold its final version {held} ({final} = its rounds and the "
            "end-of-run "
            "flush), so this cluster would train nothing. Get the model with `dilocox export`, train it longer "
            '(docs/deploy.md, "Train longer"), or start a new run (another --run-id, fresh shards)'
        ),
    )
    mine = final_version_of(own_config_json)
    longer = mine is not None and final is not None and mine > final
    yield (
        final is not None and mine is not None and mine != final,
        RunLengthMismatch(
            f"this site was started to end run {run_id!r} at version {mine} ({rounds} rounds), its shards end it at "
            "version "
            f"{final}: "
            + (
                f"to train longer, restart every shard with --resume --rounds {rounds} first, then this site with "
                '--resume (docs/deploy.md, "Train longer")'
                if longer
                else "start it with the run's --rounds"
            )
        ),
    )
    yield (
        not allow_late_join and not rejoin and fresh and held > 0,
        LateJoin(
            f"run {run_id!r} is at version {held}: its first {min(held, rounds)} rounds have closed, so this site "
            "would train "
            f"{max(0, rounds - held)} of its {rounds} rounds. Start every site together (shards first, --min-clusters "
            "= the "
            "number of sites), or pass --join-late to join anyway"
        ),
    )
