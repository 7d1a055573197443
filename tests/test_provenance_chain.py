"""The rounds chain: each shard hash-chains one record per published version — the sites
merged, their tokens and payload digests, the resulting state digest — keeps it in its checkpoints, serves
it (`Provenance`), and `dilocox export` writes it into provenance.json, where `dilocox verify` recomputes it
and names a changed record by shard and version."""

from __future__ import annotations

import copy
import json
import pathlib

import grpc
import pytest
import torch

from dilocox.common.cli import main
from dilocox.common.wire import checkpoint_integrity
from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.checkpoint_format import CheckpointCorrupt
from dilocox.common.wire.framing import EncodedSlice, own_contribution_digest
from dilocox.common.wire.rounds_chain import check_chain, genesis, link
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.server.serving.grpc_server import start_server
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint
from dilocox.server.state.provenance_chain import RoundsChain
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import slice_tensors
from dilocox.worker.export.chain import check_section, fetch_chain
from dilocox.worker.export.export_folder import write_export
from dilocox.worker.export.model import from_checkpoints, from_servers

pytest.importorskip("safetensors")

RUN = "chain-run"
PARAMS = [("emb", (24, 8)), ("w", (8, 12)), ("b", (12,)), ("gain", ())]


def _delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: 0.01 * torch.randn(s, generator=g) for n, s in PARAMS}


def _push(shard: Shard, cluster: str, round_: int, tokens: float, full: dict[str, torch.Tensor]) -> list[EncodedSlice]:
    slices = [EncodedSlice.exact(k, s.view(full[s.name]).clone()) for k, s in shard.owned.items()]
    shard.commit_push(cluster, round_, tokens, slices)
    return slices


def _three_rounds(shard: Shard) -> dict[tuple[int, str], str]:
    """Clusters a and b, round 0 and three rounds; returns each (round, cluster)'s payload digest as pushed."""
    for cluster in ("a", "b"):
        shard.join(RUN, cluster, model_digest(PARAMS), PARAMS, "{}")
    _push(shard, "a", 0, 1.0, {n: torch.randn(s) for n, s in PARAMS})
    pushed = {}
    for round_ in (1, 2, 3):
        for i, cluster in enumerate(("a", "b")):
            slices = _push(shard, cluster, round_, 100.0 * (i + 1), _delta(10 * round_ + i))
            pushed[round_, cluster] = own_contribution_digest({s.key: s.sha256 for s in slices}).hex()
    return pushed


# ------------------------------------------------------------------ the chain itself
def _chain(n: int = 4) -> RoundsChain:
    chain = RoundsChain(RUN, 1, 2)
    chain.append({"kind": "init", "version": 0, "initialiser": "a"})
    for v in range(1, n):
        chain.append({"kind": "round", "version": v, "sites": [{"cluster": "a", "tokens": 10.0 * v}]})
    return chain


def test_append_links_each_record_to_the_one_before_and_recomputes():
    chain = _chain()
    entries = chain.as_state()["records"]
    assert entries[0]["hash"] == link(genesis(RUN, 1, 2), {"kind": "init", "version": 0, "initialiser": "a"})
    assert all(
        entries[i]["hash"] == link(entries[i - 1]["hash"], {k: v for k, v in entries[i].items() if k != "hash"})
        for i in range(1, 4)
    )
    assert chain.head == entries[-1]["hash"] and chain.version == 3
    assert check_chain(RUN, 1, 2, entries, chain.head, end_version=3) == []
    # Bound to the run and the shard: the same records are another chain elsewhere.
    assert check_chain("other-run", 1, 2, entries, chain.head) and check_chain(RUN, 0, 2, entries, chain.head)
    assert [len(chain.page(0, max_bytes=1)), len(chain.page(2)), len(chain.page(4))] == [1, 2, 0]


def test_a_changed_removed_or_reordered_record_fails_by_version():
    chain = _chain(5)
    entries = chain.as_state()["records"]
    changed = copy.deepcopy(entries)
    changed[2]["sites"][0]["tokens"] = 999.0
    found = [str(p) for p in check_chain(RUN, 1, 2, changed, chain.head)]
    assert len(found) == 2 and "shard 1 version 2: record changed" in found[0] and "head does not recompute" in found[1]
    dropped = entries[:2] + entries[3:]
    assert any(
        "version 3: a round record after version 1" in str(p) for p in check_chain(RUN, 1, 2, dropped, chain.head)
    )
    swapped = [entries[0], entries[2], entries[1], *entries[3:]]
    assert any("version 2: record changed" in str(p) for p in check_chain(RUN, 1, 2, swapped, chain.head))
    assert "ends at version 4, the export is version 3" in str(
        check_chain(RUN, 1, 2, entries, chain.head, end_version=3)[-1]
    )
    for malformed in (
        [],
        [{"version": 0}],
        [{**entries[0], "hash": "zz"}],
        [{**entries[0], "kind": "other"}],
        "nonsense",
    ):
        assert check_chain(RUN, 1, 2, malformed, chain.head)  # a problem each, never an exception
    with pytest.raises(ValueError):  # NaN is not JSON: refused when appended, not hashed as something else
        chain.append({"kind": "round", "version": 5, "tokens": float("nan")})


# ------------------------------------------------------------------ the shard's records and checkpoints
def test_each_version_is_recorded_with_its_sites_tokens_payloads_and_state():
    shard = Shard(0, 1, RUN, min_clusters=2)
    pushed = _three_rounds(shard)
    records = shard.chain.as_state()["records"]
    assert [(r["kind"], r["version"]) for r in records] == [("init", 0), ("round", 1), ("round", 2), ("round", 3)]
    assert records[0]["initialiser"] == "a"
    for record in records[1:]:
        sites = {s["cluster"]: s for s in record["sites"]}
        assert sites.keys() == {"a", "b"} and (sites["a"]["tokens"], sites["b"]["tokens"]) == (100.0, 200.0)
        for cluster, site in sites.items():  # the digest a site computes over what it pushed
            assert site["payload_sha256"] == pushed[record["version"], cluster]
            assert site["weight"] == site["tokens"] and site["staleness"] == 0 and site["slices"] == len(shard.owned)
    # The state digest is the one a replay check is answered with (computed at the close, cached for the pulls).
    assert (
        shard.snapshot.digests
        and records[-1]["state_digest"]
        == "xxh3-128:" + shard.state_digest(shard.snapshot, list(shard.owned), "xxh3-128").hex()
    )


def test_the_chain_survives_a_checkpoint_and_a_tampered_one_is_refused(tmp_path):
    shard = Shard(0, 1, RUN, min_clusters=2)
    _three_rounds(shard)
    path = checkpoint.save(shard, tmp_path)
    restored = Shard(0, 1, RUN, min_clusters=2)
    checkpoint.restore(restored, checkpoint.load(path))
    assert restored.chain.as_state() == shard.chain.as_state()
    for s in (shard, restored):  # and goes on the same way
        for i, cluster in enumerate(("a", "b")):
            _push(s, cluster, 4, 50.0, _delta(40 + i))
    assert restored.chain.version == 4 and [e["state_digest"] for e in restored.chain.entries] == [
        e["state_digest"] for e in shard.chain.entries
    ]

    state = torch.load(path, weights_only=False)
    state["rounds_chain"]["records"][2]["sites"][1]["tokens"] = 1.0
    torch.save(state, path)  # the integrity digest covers the chain …
    with pytest.raises(CheckpointCorrupt, match="content does not match its digest"):
        checkpoint.load(path)
    torch.save(checkpoint_integrity.seal(state), path)  # … and a recomputed digest does not hide a changed record
    with pytest.raises(ValueError, match="rounds chain of shard 0 version 2: record changed"):
        checkpoint.restore(Shard(0, 1, RUN), checkpoint.load(path))


def test_a_checkpoint_without_a_chain_restores_to_a_new_segment_that_says_so(tmp_path):
    shard = Shard(0, 1, RUN, min_clusters=2)
    _three_rounds(shard)
    state = checkpoint.load(checkpoint.save(shard, tmp_path))
    del state["rounds_chain"]  # as a checkpoint written before the chain
    restored = Shard(0, 1, RUN, min_clusters=2)
    checkpoint.restore(restored, state)
    first = restored.chain.entries[0]
    assert (first["kind"], first["version"], len(restored.chain.entries)) == ("restored", 3, 1)
    assert (
        "without a rounds chain" in first["note"] and first["state_digest"] == shard.chain.entries[-1]["state_digest"]
    )
    for i, cluster in enumerate(("a", "b")):
        _push(restored, cluster, 4, 50.0, _delta(40 + i))
    assert check_chain(RUN, 0, 1, restored.chain.entries, restored.chain.head, end_version=4) == []


# ------------------------------------------------------------------ served, exported, verified
def _stub(address: str) -> pb_grpc.AggregatorStub:
    return pb_grpc.AggregatorStub(grpc.insecure_channel(address))


def _run_three_rounds(addresses) -> dict[tuple[int, int, str], str]:
    """Two clusters over gRPC, round 0 and three rounds; (shard, round, cluster) -> payload digest pushed."""
    a, b = (AggregatorClient(addresses, RUN, name, connect_timeout=10, rpc_timeout=30) for name in ("a", "b"))
    pushed = {}
    try:
        for c in (a, b):
            c.join(PARAMS)
        a.push(0, 1.0, slice_tensors(a.assignment, {n: torch.randn(s) for n, s in PARAMS}))
        for round_ in (1, 2, 3):
            for i, c in enumerate((a, b)):
                c.push(round_, 100.0 * (i + 1), slice_tensors(c.assignment, _delta(10 * round_ + i)))
                for shard in range(len(addresses)):
                    mine = {s.key: c._own[s.key].sha256 for s in c.assignment if s.shard == shard}
                    pushed[shard, round_, c.cluster] = own_contribution_digest(mine).hex()
            for c in (a, b):
                assert c.pull(round_, wait_seconds=10)[0] == round_
    finally:
        a.close()
        b.close()
    return pushed


def test_shards_serve_their_chains_and_the_chain_survives_a_restore(shard_set, tmp_path):
    shards = shard_set(2, RUN, min_clusters=2)
    pushed = _run_three_rounds(shards.addresses)
    for index, address in enumerate(shards.addresses):
        chain = fetch_chain(_stub(address), RUN, timeout=10)
        records = chain["records"]
        assert (chain["shard_index"], chain["num_shards"]) == (index, 2) and [r["version"] for r in records] == [
            0,
            1,
            2,
            3,
        ]
        for record in records[1:]:
            assert [s["cluster"] for s in record["sites"]] == ["a", "b"]
            assert all(s["payload_sha256"] == pushed[index, record["version"], s["cluster"]] for s in record["sites"])
        assert check_chain(RUN, index, 2, records, records[-1]["hash"], end_version=3) == []
        assert records[-1]["hash"] == shards.shards[index].chain.head
        paged = _stub(address).Provenance(pb.ProvenanceRequest(run_id=RUN, start=1, max_bytes=1), timeout=10)
        assert (paged.total_records, paged.start, len(json.loads(paged.records_json))) == (4, 1, 1)
    with pytest.raises(grpc.RpcError) as refused:
        _stub(shards.addresses[0]).Provenance(pb.ProvenanceRequest(run_id="someone-else"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not 'someone-else'" in refused.value.details()
    with pytest.raises(grpc.RpcError) as beyond:
        _stub(shards.addresses[0]).Provenance(pb.ProvenanceRequest(run_id=RUN, start=9), timeout=10)
    assert beyond.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # Checkpointed, stopped, restored into a new process's shard: the same chain is served.
    path = checkpoint.save(shards.shards[1], tmp_path)
    before = fetch_chain(_stub(shards.addresses[1]), RUN, timeout=10)
    shards.servers[1].stop(grace=None).wait(timeout=10)
    restored = Shard(1, 2, RUN, min_clusters=2)
    checkpoint.restore(restored, checkpoint.load(path))
    server, port = start_server(restored, "127.0.0.1", 0)
    try:
        assert fetch_chain(_stub(f"127.0.0.1:{port}"), RUN, timeout=10) == before
    finally:
        server.stop(grace=None).wait(timeout=10)


def test_a_live_export_carries_the_chains_and_verify_recomputes_them(shard_set, tmp_path, capsys):
    shards = shard_set(2, RUN, min_clusters=2)
    _run_three_rounds(shards.addresses)
    model = from_servers(shards.addresses, RUN)
    out = write_export(model, tmp_path / "live")
    record = json.loads((out / "provenance.json").read_text())
    section = record["rounds_chain"]
    assert [s["shard_index"] for s in section["shards"]] == [0, 1]
    assert all(s["head"] == shards.shards[s["shard_index"]].chain.head for s in section["shards"])
    assert main(["verify", str(out), "--unsigned"]) == 0
    said = capsys.readouterr().out
    assert (
        "rounds chain: 2 of 2 shard(s), versions 0–3" in said and "exported weights are the state they end in" in said
    )

    # The weights check: weights that are not the chains' last state fail by shard (provenance.json unchanged).
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    tensors["b"][0] += 1.0  # "b" is split by rows or owned whole: some shard owns element 0
    save_file(tensors, str(tmp_path / "other.safetensors"))
    problems = check_section(record, tmp_path / "other.safetensors").problems
    owner = next(s.shard for s in model_slices(shards) if s.name == "b" and s.row_start == 0)
    assert (
        len(problems) == 1
        and f"shard {owner} version 3: the exported weights of its slices are not the state" in problems[0]
    )


def model_slices(shards):
    return shards.shards[0].assignment


def _exported_from_checkpoints(tmp_path, extra: list[str]) -> pathlib.Path:
    for index in range(2):
        shard = Shard(index, 2, RUN, min_clusters=2)
        _three_rounds(shard)
        checkpoint.save(shard, tmp_path / "ckpt")
    out = tmp_path / ("signed" if extra else "unsigned")
    assert main(["export", "--checkpoints", str(tmp_path / "ckpt"), "--out", str(out), *extra]) == 0
    return out


def _change_a_record(out: pathlib.Path) -> None:
    path = out / "provenance.json"
    record = json.loads(path.read_text())
    record["rounds_chain"]["shards"][1]["records"][2]["sites"][0]["tokens"] = 1e6  # shard 1, version 2, site a
    path.write_text(json.dumps(record, indent=2) + "\n")


def test_an_unsigned_export_fails_verify_by_shard_and_version_after_a_record_is_changed(tmp_path, capsys):
    out = _exported_from_checkpoints(tmp_path, [])
    assert main(["verify", str(out), "--unsigned"]) == 0
    assert "versions 0–3, every record and head recomputes" in capsys.readouterr().out
    assert from_checkpoints([tmp_path / "ckpt"]).rounds_chain["shards"][1]["records"][-1]["version"] == 3
    _change_a_record(out)
    assert main(["verify", str(out), "--unsigned"]) == 1
    err = capsys.readouterr().err
    assert "FAILED provenance.json: rounds chain of shard 1 version 2: record changed" in err
    assert "shard 0" not in err and "(2 problem(s))" in err  # the record, and shard 1's head


def test_a_signed_export_covers_the_chain(tmp_path, capsys):
    from dilocox.common.deploy.certs import issue, load_ca, make_dev_certificates

    made = make_dev_certificates(tmp_path / "pki")
    issued = issue(load_ca(tmp_path / "pki"), tmp_path / "pki", "signer", "signer", ("exporter",))
    out = _exported_from_checkpoints(
        tmp_path, ["--sign-key", str(issued["signer-key"]), "--sign-cert", str(issued["signer"])]
    )
    assert main(["verify", str(out), "--cert", str(made["ca"])]) == 0
    assert "rounds chain: 2 of 2 shard(s)" in capsys.readouterr().out
    _change_a_record(out)
    assert main(["verify", str(out), "--cert", str(made["ca"])]) == 1
    err = capsys.readouterr().err
    assert "FAILED provenance.json: provenance record changed" in err  # the signature catches it
    assert "rounds chain of shard 1 version 2: record changed" in err  # and the chain names the record
