"""Checkpoints carry their own integrity: a digest over everything a shard checkpoint holds,
checked on every load; a damaged newest file is refused and `--resume` and the offline export fall back
to the newest intact kept version; a site's DCP checkpoint commits a manifest of its files' SHA-256."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.checkpoint_format import (
    CheckpointCorrupt,
    CheckpointError,
    checkpoint_path,
    kept_path,
    load_state,
    save_state,
    shard_files,
)
from dilocox.common.wire.checkpoint_integrity import seal, state_digest
from dilocox.common.wire.framing import EncodedSlice
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint, resume
from dilocox.worker.export.model import ExportError, from_checkpoints

RUN = "integrity-run"
PARAMS = [("w", (8, 6)), ("b", (6,))]


def _publish(shard: Shard, round_: int, cluster: str = "cluster-aaaa") -> None:
    g = torch.Generator().manual_seed(1000 * shard.shard_index + round_)
    full = {n: torch.randn(s, generator=g) for n, s in PARAMS}
    shard.commit_push(
        cluster, round_, 1.0, [EncodedSlice.exact(k, s.view(full[s.name]).clone()) for k, s in shard.owned.items()]
    )


def _shard(index: int = 0, num_shards: int = 1, rounds: int = 2) -> Shard:
    shard = Shard(index, num_shards, RUN)
    shard.join(RUN, "cluster-aaaa", model_digest(PARAMS), PARAMS, "{}")
    for round_ in range(rounds + 1):
        _publish(shard, round_)
    return shard


def _flip(path: pathlib.Path, needle: bytes, offset: int = 0) -> None:
    """Flip the bits of one byte inside the only occurrence of `needle` in the file."""
    data = bytearray(path.read_bytes())
    assert data.count(needle) == 1, "the pattern must locate one place"
    data[data.find(needle) + offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _replace(path: pathlib.Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert len(old) == len(new) and data.count(old) == 1
    path.write_bytes(data.replace(old, new))


# ------------------------------------------------------------------------------------------ the digest
def test_state_digest_is_canonical_and_tells_values_apart():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = {"x": t, "y": [1, "s", None, b"ab", (2.5, True)], ("w", 0, 3): torch.tensor(7.0)}
    b = {
        ("w", 0, 3): torch.tensor(7.0),
        "y": [1, "s", None, bytearray(b"ab"), (2.5, True)],
        "x": t.t().contiguous().t(),
    }
    assert state_digest(a) == state_digest(b)  # key order, bytes/bytearray, memory layout do not matter
    assert state_digest(seal(a)) == state_digest(a) == seal(a)["integrity"]
    assert state_digest(torch.zeros(2, dtype=torch.bfloat16)).startswith("sha256:")
    different = [
        ["ab"],
        ["a", "b"],
        [1],
        [True],
        ["1"],
        [1.0],
        [b"1"],
        [torch.ones(1)],
        [torch.ones(1, dtype=torch.float64)],
        [torch.ones(1, 1)],
        [(1,)],
        [{1: 1}],
        [None],
        [torch.tensor([1.0, 2.0])],
        [torch.tensor([2.0, 1.0])],
    ]
    assert len({state_digest(v) for v in different}) == len(different)
    with pytest.raises(TypeError, match="cannot digest a object"):
        state_digest({"x": object()})


# ------------------------------------------------------------------------------------------ shard files
@pytest.fixture
def saved(tmp_path):
    shard = _shard()
    return shard, checkpoint.save(shard, tmp_path)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


@pytest.mark.parametrize("where", ["weights", "momentum", "payload", "run_id", "member"])
def test_a_flipped_byte_anywhere_is_refused_with_one_line(saved, where):
    shard, path = saved
    key = next(iter(shard.snapshot.tensors))
    if where == "weights":
        _flip(path, _tensor_bytes(shard.snapshot.tensors[key]), 5)
    elif where == "momentum":
        _flip(path, _tensor_bytes(shard.snapshot.momentum[key]), 9)
    elif where == "payload":
        _flip(path, bytes(shard.snapshot.contributions[key]["cluster-aaaa"].slice.payload), 3)
    elif where == "run_id":
        _replace(path, RUN.encode(), b"integrity-rum")
    else:
        _replace(path, b"cluster-aaaa", b"cluster-aaab")
    with pytest.raises(CheckpointCorrupt) as refused:
        checkpoint.load(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: damaged: content does not match its digest") and "\n" not in message


@pytest.mark.parametrize("damage", ["truncated", "empty", "not a zip", "no digest"])
def test_unreadable_files_are_refused_with_one_line(saved, damage):
    _, path = saved
    data = path.read_bytes()
    if damage == "no digest":  # a format-2 file whose digest field is gone
        state = load_state(path)
        del state["integrity"]
        torch.save(state, path)
    else:
        path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "not a zip": b"\x80\x04K\x01."}[damage])
    with pytest.raises(CheckpointCorrupt) as refused:
        checkpoint.load(path)
    assert str(refused.value).startswith(str(path)) and "\n" not in str(refused.value) and len(str(refused.value)) < 300


def test_another_run_shard_or_format_is_refused_but_not_as_damage(saved, tmp_path):
    _, path = saved
    with pytest.raises(CheckpointError, match="is for run_id='integrity-run', this shard has 'other'") as refused:
        checkpoint.load(path, {"run_id": "other"})
    assert not isinstance(refused.value, CheckpointCorrupt)
    with pytest.raises(CheckpointError, match="is for shard_index=0, this shard has 1"):
        checkpoint.load(path, {"shard_index": 1})
    state = load_state(path)
    save_state(dict(state, format=9), tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="checkpoint format 9, this build reads"):
        checkpoint.load(tmp_path / "future.pt")


def test_a_format_1_file_loads_as_unverified(saved, tmp_path, capsys):
    _, path = saved
    state = {k: v for k, v in load_state(path).items() if k != "integrity"}
    torch.save(dict(state, format=1), tmp_path / "old.pt")
    restored = Shard(0, 1, RUN)
    checkpoint.restore(restored, checkpoint.load(tmp_path / "old.pt"))
    assert restored.version == 2 and "checkpoint_unverified" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ resume
def _kept_folder(folder: pathlib.Path, shard: Shard, upto: int) -> None:
    """Checkpoints of versions upto-2 … upto, as a running shard's Checkpointer leaves them (keep 3)."""
    keeper = checkpoint.Checkpointer(shard, folder, keep=3)
    for round_ in range(shard.version + 1, upto + 1):
        _publish(shard, round_)
        keeper(shard.snapshot)


def test_resume_falls_back_to_the_newest_intact_version_and_rotation_goes_on(tmp_path, capsys):
    shard = _shard(rounds=0)
    _kept_folder(tmp_path, shard, 5)
    current = checkpoint_path(tmp_path, 0)
    _flip(current, _tensor_bytes(next(iter(shard.snapshot.tensors.values()))), 2)
    expect = {"run_id": RUN, "shard_index": 0, "num_shards": 1}
    assert "damaged checkpoint" in resume.describe_refusal(tmp_path, 0, expect)
    assert "the newest intact one is shard-0.v4.pt (version 4)" in resume.describe_refusal(tmp_path, 0, expect)

    path, state = resume.load_for_resume(tmp_path, 0, expect)
    assert path == current and state["snapshot"]["version"] == 4
    assert "checkpoint_fallback" in capsys.readouterr().out
    refused = list(tmp_path.glob("shard-0.pt.refused-*"))
    assert len(refused) == 1 and sorted(p.name for p in tmp_path.glob("shard-0*.pt")) == ["shard-0.pt", "shard-0.v3.pt"]
    assert shard_files(tmp_path) == {0: [current, kept_path(tmp_path, 0, 3)]}  # the refused file is nobody's

    restarted = Shard(0, 1, RUN)
    checkpoint.restore(restarted, state)
    keeper = checkpoint.Checkpointer(restarted, tmp_path, keep=3)
    for round_ in (5, 6):  # the clusters re-push; rotation goes on from version 4, never through the bad file
        _publish(restarted, round_)
        keeper(restarted.snapshot)
    assert sorted(p.name for p in tmp_path.glob("shard-0*.pt")) == ["shard-0.pt", "shard-0.v4.pt", "shard-0.v5.pt"]
    assert [load_state(p)["snapshot"]["version"] for p in shard_files(tmp_path)[0]] == [6, 5, 4]
    assert refused[0].exists()


def test_resume_with_nothing_intact_stops_and_moves_nothing(tmp_path):
    shard = _shard(rounds=0)
    _kept_folder(tmp_path, shard, 2)
    for file in shard_files(tmp_path)[0]:
        file.write_bytes(file.read_bytes()[:100])
    before = sorted(p.name for p in tmp_path.iterdir())
    nothing = r"--resume: no intact checkpoint of shard 0 in .*shard-0.pt: unreadable .*shard-0.v1.pt"
    with pytest.raises(CheckpointCorrupt, match=nothing):
        resume.load_for_resume(tmp_path, 0, {"run_id": RUN})
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        resume.load_for_resume(tmp_path / "empty", 0, {})


def test_shard_process_resumes_from_the_intact_kept_version(tmp_path):
    """A real `dilocox server --resume` over a folder whose newest file has a flipped weight: it logs
    `checkpoint_fallback`, serves the kept version's weights exactly, and saves that at SIGTERM."""
    from test_restart import _free_port, _wait_listening

    from dilocox.common.subprocesses import stop_gracefully
    from dilocox.worker.exchange.aggregator_client import AggregatorClient

    shard = _shard(rounds=0)
    _kept_folder(tmp_path, shard, 4)
    _flip(checkpoint_path(tmp_path, 0), _tensor_bytes(next(iter(shard.snapshot.tensors.values()))), 1)
    want = load_state(kept_path(tmp_path, 0, 3))["snapshot"]["tensors"]
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "server",
        "--port",
        str(port),
        "--run-id",
        RUN,
        "--round-deadline-s",
        "0",
        "--checkpoint-dir",
        str(tmp_path),
        "--log-format",
        "json",
        "--insecure",
        "--resume",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_listening(port, proc)
        with AggregatorClient([f"127.0.0.1:{port}"], RUN, "observer", shard_wait_s=0) as client:
            client.join(PARAMS)
            version, pulled, _ = client.pull(0, wait_seconds=10)
        assert version == 3
        for key, tensor in pulled.items():
            assert torch.equal(tensor, want[(key.name, key.row_start, key.row_stop)])
    finally:
        stop_gracefully(proc, grace_s=10)
    events = [json.loads(line) for line in proc.stdout.read().splitlines() if line.startswith("{")]
    fallback = next(e for e in events if e["event"] == "checkpoint_fallback")
    assert (
        fallback["refused"] == str(checkpoint_path(tmp_path, 0)) and "does not match its digest" in fallback["reason"]
    )
    assert (
        fallback["used"] == str(kept_path(tmp_path, 0, 3))
        and fallback["version"] == 3
        and fallback["level"] == "warning"
    )
    assert load_state(checkpoint_path(tmp_path, 0))["snapshot"]["version"] == 3  # re-saved from the intact state


# ------------------------------------------------------------------------------------------ export
def _two_shard_folders(tmp_path, upto: int = 5) -> list[pathlib.Path]:
    folders = [tmp_path / f"shard-{i}" for i in range(2)]
    for i, folder in enumerate(folders):
        _kept_folder(folder, _shard(i, 2, rounds=0), upto)
    return folders


def test_export_from_folders_with_kept_versions_uses_the_newest_common_intact_one(tmp_path):
    folders = _two_shard_folders(tmp_path)
    lines: list[str] = []
    assert from_checkpoints(folders, report=lines.append).version == 5
    assert lines == [f"shard {i}: {folders[i] / f'shard-{i}.pt'} (version 5)" for i in range(2)]

    _flip_weights(folders[1] / "shard-1.pt")
    lines.clear()
    model = from_checkpoints(folders, report=lines.append)
    assert model.version == 4
    assert lines[0].startswith(f"shard 1: skipped {folders[1] / 'shard-1.pt'}: damaged")
    assert lines[1:] == [f"shard {i}: {folders[i] / f'shard-{i}.v4.pt'} (version 4)" for i in range(2)]
    want = from_checkpoints(
        [folders[0] / "shard-0.v4.pt", folders[1] / "shard-1.v4.pt"]
    )  # explicit files, one per shard
    assert all(torch.equal(model.tensors[n], want.tensors[n]) for n in want.tensors)

    for file in (folders[1] / "shard-1.v4.pt", folders[1] / "shard-1.v3.pt"):
        _flip_weights(file)
    none_intact = r"shard 1: no intact checkpoint: .*shard-1.pt: damaged.*shard-1.v4.pt: damaged.*shard-1.v3.pt"
    with pytest.raises(ExportError, match=none_intact):
        from_checkpoints(folders)
    with pytest.raises(ExportError, match="not a usable shard checkpoint: .*shard-1.v3.pt: damaged"):
        from_checkpoints([folders[0] / "shard-0.v3.pt", folders[1] / "shard-1.v3.pt"])


def _flip_weights(file: pathlib.Path) -> None:
    state = load_state(file)
    _flip(file, _tensor_bytes(next(iter(state["snapshot"]["tensors"].values()))), 0)


def test_export_command_names_the_files_it_used(tmp_path, capsys):
    from dilocox.common.cli import main

    folders = _two_shard_folders(tmp_path, upto=3)
    _flip_weights(folders[0] / "shard-0.pt")
    assert main(["export", "--checkpoints", ",".join(map(str, folders)), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert (
        f"shard 0: {folders[0] / 'shard-0.v2.pt'} (version 2)" in out and "exported run integrity-run version 2" in out
    )


# ------------------------------------------------------------------------------------------ a site's DCP checkpoint
def _tiny_trainers():
    """A maker of one-layer, 16-wide trainers on the bundled corpus (each a fresh one, as a restarted site's),
    and the names of the parameters a site checkpoint saves."""
    from dilocox.common.config.run import InnerConfig, ModelConfig, RunConfig
    from dilocox.worker.data.corpus import load_corpus
    from dilocox.worker.data.token_data import EVAL_FRACTION, TokenData
    from dilocox.worker.train.inner_trainer import InnerTrainer

    config = RunConfig(
        rounds=2, model=ModelConfig(n_layer=1, n_embd=16, block_size=16), inner=InnerConfig(steps=1, batch_size=2)
    )
    tokens = TokenData.from_bytes(load_corpus(None), EVAL_FRACTION)
    new_trainer = lambda: InnerTrainer(config, tokens)  # noqa: E731
    return new_trainer, [n for n, _ in new_trainer().named_parameters()]


def test_site_checkpoint_commits_a_manifest_and_resume_falls_back_past_a_damaged_one(tmp_path, capsys):
    from dilocox.worker.checkpoint import COMMITTED, SiteCheckpoint

    new_trainer, names = _tiny_trainers()
    trainer = new_trainer()
    site = SiteCheckpoint(tmp_path, "c", keep=3)
    for round_ in (1, 2, 3):
        trainer.train_steps(1)
        site.capture(round_, trainer, None, names)
        site.commit(round_)
    site.close()
    root = tmp_path / "c"
    manifest = json.loads((root / "round-000003" / COMMITTED).read_text())
    assert (
        manifest["round"] == 3
        and ".metadata" in manifest["files"]
        and any(f.endswith(".distcp") for f in manifest["files"])
    )

    part = max((root / "round-000003").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    fresh = new_trainer()
    assert SiteCheckpoint(tmp_path, "c").restore(fresh, None, names) == 2 and fresh.step == 2
    out = capsys.readouterr().out
    assert "worker_checkpoint_fallback" in out and f"{part.name} does not match its SHA-256" in out
    assert not (root / "round-000003").exists() and len(list(root.glob("round-000003.refused-*"))) == 1

    (root / "round-000002" / COMMITTED).write_text("2\n")  # a COMMITTED from before the manifest
    assert SiteCheckpoint(tmp_path, "c").restore(new_trainer(), None, names) == 2
    assert "worker_checkpoint_unverified" in capsys.readouterr().out

    # An empty marker (what a crash leaves of one written without fsync) commits nothing: refused by name.
    empty = SiteCheckpoint(tmp_path, "c")
    (root / "round-000002" / COMMITTED).write_text("")
    assert empty.restore(new_trainer(), None, names) == 1
    out = capsys.readouterr().out
    assert "worker_checkpoint_fallback" in out and "COMMITTED is empty" in out
    refused = sorted(root.glob("round-000002.refused-*"))
    assert len(refused) == 1
    os.replace(refused[0], root / "round-000002")
    (root / "round-000001" / ".metadata").write_bytes(b"")
    (root / "round-000002" / COMMITTED).write_text('{"format": "dilocox-site-checkpoint/1", "round": 2, "fil')
    with pytest.raises(
        ValueError,
        match=r"no intact committed worker checkpoint under .*round-000002: COMMITTED is not a "
        r"manifest this build reads; round-000001: .metadata holds 0 bytes",
    ):
        SiteCheckpoint(tmp_path, "c").restore(new_trainer(), None, names)
    assert sorted(p.name for p in root.iterdir() if "refused" not in p.name) == ["round-000001", "round-000002"]


@pytest.mark.parametrize("staging", ["async", "sync"])
def test_site_checkpoints_reuse_their_staging_buffers_or_stage_nothing(tmp_path, staging):
    """Async checkpoints refill the buffers the first one staged into (DCP's stager
    kept by the site: no new allocation, and on a GPU no new pinning, per checkpoint); sync ones stage
    nothing. Either way the newest committed checkpoint restores the trainer bit for bit."""
    from dilocox.worker.checkpoint import SiteCheckpoint

    new_trainer, names = _tiny_trainers()
    trainer = new_trainer()
    site = SiteCheckpoint(tmp_path, "c", staging=staging)
    staged = []
    for round_ in (1, 2, 3):
        trainer.train_steps(1)
        site.capture(round_, trainer, None, names)
        site.commit(round_)
        cache = site._stager._state_dict_stager._cached_storage_mapping if site._stager is not None else {}
        staged.append(sorted(s.data_ptr() for s in cache.values()))
    site.close()
    if staging == "async":
        assert staged[0] and staged[0] == staged[1] == staged[2]  # the same host buffers, refilled
        assert site.staged_bytes > 0
    else:
        assert staged == [[], [], []] and site.staged_bytes == 0
    fresh = new_trainer()
    assert SiteCheckpoint(tmp_path, "c").restore(fresh, None, names) == 3 and fresh.step == 3
    want = dict(trainer.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in fresh.named_parameters())


def test_site_checkpoints_by_time_and_a_part_whose_seal_is_missing_is_checked_by_size(tmp_path, capsys):
    """`--checkpoint-every-s`: only boundaries that long after the last checkpoint save one. A seal never
    written (the rank stopped while hashing) leaves its files checked by size: the resume takes the
    checkpoint with a warning; a file of another size is still refused."""
    import time

    from dilocox.worker.checkpoint import COMMITTED, SiteCheckpoint
    from dilocox.worker.checkpoint_manifest import seal_name

    new_trainer, names = _tiny_trainers()
    trainer = new_trainer()
    hourly = SiteCheckpoint(tmp_path / "hourly", "c", every_s=3600)
    for round_ in (1, 2):
        hourly.capture(round_, trainer, None, names)
        hourly.commit(round_)
    hourly.close()
    assert hourly.rounds() == []
    often = SiteCheckpoint(tmp_path, "c", every_s=1.0, keep=3)
    for round_ in (1, 2, 3):
        time.sleep(1.1 if round_ != 2 else 0)
        trainer.train_steps(1)
        often.capture(round_, trainer, None, names)
        often.commit(round_)
    often.close()
    assert often.rounds() == [1, 3]  # round 2's boundary came too soon after round 1's checkpoint
    folder = tmp_path / "c" / "round-000003"
    assert json.loads((folder / COMMITTED).read_text())["seals"] == [seal_name(0)]
    (folder / seal_name(0)).unlink()
    fresh = new_trainer()
    assert SiteCheckpoint(tmp_path, "c").restore(fresh, None, names) == 3 and fresh.step == 3
    assert "worker_checkpoint_partly_verified" in capsys.readouterr().out
    part = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with part.open("ab") as f:
        f.write(b"x")
    assert SiteCheckpoint(tmp_path, "c").restore(new_trainer(), None, names) == 1
    assert f"{part.name} holds" in capsys.readouterr().out
