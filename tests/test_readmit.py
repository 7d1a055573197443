"""`dilocox readmit` against real shards: a quarantined site stays out while it passes, until it has passed
`--update-check-quarantine-rounds` rounds in a row or an operator with the shards' operator token releases
it; a site (run token only) cannot release itself, and every replica stays bit-exact throughout."""

from __future__ import annotations

import pytest
import structlog

from dilocox.common import cli
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.server.checks.update_check import UpdateCheckConfig

RUN = "run-downlink"
OPERATOR = "op-secret"


@pytest.fixture(autouse=True)
def _restore_logging():
    """The command points structlog at this test's captured stderr, which closes after it (as in test_status)."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _readmit(addresses: list[str], capsys, *extra: str) -> tuple[int, str]:  # noqa: ANN001
    capsys.readouterr()
    code = cli.main(
        ["readmit", "--servers", ",".join(addresses), "--run-id", RUN, "--site", "site3", "--insecure", *extra]
    )
    return code, capsys.readouterr().out


def test_an_operator_readmits_a_quarantined_site_and_a_site_cannot(shard_set, capsys, monkeypatch):
    from tests import four_sites
    from tests.test_downlink import assert_replica_equals_shards, client

    shards = shard_set(2, RUN, min_clusters=4, update_check=UpdateCheckConfig(mode="exclude", quarantine_rounds=3))
    shards.shards[0].operator_token = shards.shards[1].operator_token = OPERATOR
    clients = [client(shards.addresses, f"site{i}") for i in range(4)]
    # The faulty site keeps no error feedback: a fixed site restarts without the residual of its × 100 rounds,
    # which would otherwise keep its next updates outsized.
    no_feedback = CompressionConfig(rank_max=4, target_energy=0.5, min_lowrank_numel=256, error_feedback=False)
    clients[four_sites.FAULTY].compressor = TensorCompressor(no_feedback, seed=1)
    left_out = {}

    def play(round_: int, faulty: bool) -> None:
        four_sites.play(clients, round_, faulty)
        left_out[round_] = {shard.last_round.excluded for shard in shards.shards}

    try:
        four_sites.start(clients)
        for round_ in (1, 2):
            play(round_, faulty=False)
        for round_ in (3, 4, 5):  # flagged three rounds in a row: quarantined
            play(round_, faulty=True)
        play(6, faulty=False)  # passes, but one passing round does not end a quarantine
        assert left_out[6] == {("site3",)} and all(s.update_check.quarantined == {"site3"} for s in shards.shards)

        monkeypatch.delenv("DILOCOX_OPERATOR_TOKEN", raising=False)
        with pytest.raises(SystemExit, match="no operator token"):  # refused before any call
            _readmit(shards.addresses, capsys)
        code, out = _readmit(shards.addresses, capsys, "--operator-token", "what-a-site-might-guess")
        assert code == 1 and out.count("PERMISSION_DENIED: wrong operator token") == 2, out
        assert all(s.update_check.quarantined == {"site3"} for s in shards.shards)  # nothing released
        code, out = _readmit(shards.addresses, capsys, "--operator-token", OPERATOR)
        assert code == 0 and out.count("site3 released from quarantine") == 2, out
        assert all(not s.update_check.quarantined for s in shards.shards)
        assert all(not site["quarantined"] for s in shards.shards for site in s.status()["sites"])

        play(7, faulty=False)  # released: merged again (two rounds before its own passes would have released it)
        assert left_out[7] == {()}
        code, out = _readmit(shards.addresses, capsys, "--operator-token", OPERATOR)
        assert code == 0 and out.count("was not quarantined here") == 2, out  # idempotent
        for c in clients:
            assert_replica_equals_shards(c, shards)
            assert c.replay_check.mismatches == 0
    finally:
        for c in clients:
            c.close()


def test_a_shard_without_an_operator_token_refuses_every_readmission(shard_set, capsys):
    shards = shard_set(1, RUN)
    code, out = _readmit(shards.addresses, capsys, "--operator-token", "anything")
    assert code == 1 and "PERMISSION_DENIED: this shard takes no operator requests" in out, out
    off = shard_set(1, RUN, update_check=UpdateCheckConfig(mode="off"))
    off.shards[0].operator_token = OPERATOR
    code, out = _readmit(off.addresses, capsys, "--operator-token", OPERATOR)
    assert code == 1 and "FAILED_PRECONDITION" in out and "update check is off" in out, out
