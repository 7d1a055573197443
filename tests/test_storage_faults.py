"""Storage faults degrade, never fail a round: a shard whose checkpoint folder fills up goes on
closing and serving rounds, says so once, counts it, keeps its newest intact checkpoint, leaves no
temporary files, and resumes from that checkpoint once space is freed."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
import torch

from dilocox.common.wire.checkpoint_format import checkpoint_path
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import slice_tensors
from dilocox.worker.status import format_table
from tests.ports import free_port
from tests.test_restart import PARAMS as SMALL_PARAMS
from tests.test_restart import RUN, _publish, _saved_checkpoint, _shard_cmd, _wait_listening

PARAMS = [("w", (256, 256)), ("b", (256,))]  # ≈ 0.8 MB a checkpoint: weights, momentum, the round's push


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in PARAMS}


@contextlib.contextmanager
def small_filesystem(path, megabytes: int):
    """A tmpfs of `megabytes` at `path`, unmounted after; skips where this machine cannot mount."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the injected-error test covers the logic")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path) -> None:
    """Write zeros to `path` until its filesystem is full."""
    with contextlib.suppress(OSError), open(path, "wb", buffering=0) as filler:
        while True:
            filler.write(b"\0" * 2**16)


def _events(log_path) -> list[dict]:
    out = []
    for line in open(log_path, encoding="utf-8"):
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_full_checkpoint_disk_never_fails_a_round_and_a_restart_resumes_from_the_newest_intact(tmp_path):
    with small_filesystem(tmp_path / "ckpt", 8) as folder:
        port, metrics_port, log = free_port(), free_port(), tmp_path / "shard.log"
        # The rounds kept for returning sites go elsewhere: this is the checkpoints' disk filling up (on a shared
        # disk the rounds' writer, refused first, deletes what it kept and so frees room: tests/test_rounds_on_disk.py).
        cmd = _shard_cmd(
            port,
            folder,
            "--checkpoint-keep",
            "2",
            "--metrics-port",
            str(metrics_port),
            "--keep-rounds-dir",
            str(tmp_path / "rounds"),
        )
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            _wait_listening(port, proc)
            with (
                AggregatorClient([f"127.0.0.1:{port}"], RUN, "a", shard_wait_s=0) as client,
                AggregatorClient([f"127.0.0.1:{port}"], RUN, "b", shard_wait_s=0) as other,
            ):
                client.join(PARAMS)
                other.join(PARAMS)
                for round_ in range(7):
                    if round_ == 3:  # the disk fills up (another tenant, logs, ...) after version 2 was saved
                        fill(folder / "filler")
                    for site in (client, other) if round_ else (client,):
                        site.push(round_, 1.0, slice_tensors(site.assignment, _tensors(round_)))
                    for site in (client, other):
                        version, _, _ = site.pull(round_, wait_seconds=20)
                        assert version == round_  # published and served at once: the waiting pulls were woken
                failures = _metric(metrics_port, "dilocox_checkpoint_failures_total")
                failing = _metric(metrics_port, "dilocox_checkpoint_failing_rounds")
                status = client.status_each()[0]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 1  # its last save was refused too: said by the exit status
        finally:
            if proc.poll() is None:
                proc.kill()
        events = _events(log)
        failed = [e for e in events if e.get("event") == "checkpoint_failed"]
        closed = [e["round"] for e in events if e.get("event") == "round_closed"]
        assert closed == [1, 2, 3, 4, 5, 6]  # every round closed, with both sites, and logged
        assert len(failed) == 1 and failed[0]["version"] == 3 and failed[0]["path"] == str(checkpoint_path(folder, 0))
        assert failed[0]["kept_version"] == 2 and failed[0]["reason"]
        assert failures >= 4 and failing >= 4  # versions 3–6 at least (the stop's save adds one)
        stopped = next(e for e in events if e.get("event") == "shard_stopped_unsaved")
        assert stopped["level"] == "error" and stopped["version"] == 6 and stopped["kept_version"] == 2
        assert status.checkpoint_failing_rounds >= 4 and status.checkpoint_error == failed[0]["reason"]
        assert not list(folder.glob("*.tmp"))  # a failed save leaves nothing behind
        assert checkpoint.load(checkpoint_path(folder, 0))["snapshot"]["version"] == 2  # the newest intact, untouched

        # Space freed; a save killed mid-write earlier left a temporary file: the restart removes it and
        # resumes from version 2, the newest intact checkpoint.
        os.remove(folder / "filler")
        (folder / "shard-0.ptk1ll3d.tmp").write_bytes(b"\0" * 4096)
        log2 = tmp_path / "shard2.log"
        with open(log2, "w") as err:
            proc = subprocess.Popen([*cmd, "--resume"], stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            _wait_listening(port, proc)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        events = _events(log2)
        assert next(e for e in events if e.get("event") == "checkpoint_restored")["version"] == 2
        assert next(e for e in events if e.get("event") == "checkpoint_temporary_removed")["files"] == [
            "shard-0.ptk1ll3d.tmp"
        ]
        assert not list(folder.glob("*.tmp"))


def test_a_final_version_the_disk_refuses_is_said_kept_served_and_saved_once_space_is_freed(tmp_path):
    """At the run's end a shard whose checkpoint disk is full used to stop at once, exit 1,
    `shard_stopped saved=false` at level info, its final version on no disk and no longer exportable. Now it
    says so at error level with the way out, keeps serving — an export from it gets the final version — and
    saves it and stops cleanly once space is freed."""
    from dilocox.common.cli import main
    from dilocox.common.config.run import RunConfig, as_dict

    final = 3
    run = json.dumps(
        as_dict(RunConfig(run_id=RUN, rounds=final, compress=RunConfig().compress.__class__(codec="fp32")))
    )
    with small_filesystem(tmp_path / "ckpt", 8) as folder:
        port, log = free_port(), tmp_path / "shard.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(_shard_cmd(port, folder), stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            _wait_listening(port, proc)
            with AggregatorClient([f"127.0.0.1:{port}"], RUN, "a", shard_wait_s=0) as client:
                client.join(PARAMS, run)
                for round_ in range(final + 1):
                    if round_ == final:  # the disk fills up before the final version
                        fill(folder / "filler")
                    client.push(round_, 1.0, slice_tensors(client.assignment, _tensors(round_)))
                    assert client.pull(round_, wait_seconds=20)[0] == round_
            deadline = time.monotonic() + 30
            while not any(e.get("event") == "final_checkpoint_failed" for e in _events(log)):
                assert proc.poll() is None and time.monotonic() < deadline, open(log).read()[-3000:]
                time.sleep(0.2)
            assert proc.poll() is None  # still serving: the final version can be read from it
            assert (
                main(["export", "--servers", f"127.0.0.1:{port}", "--out", str(tmp_path / "model"), "--insecure"]) == 0
            )
            assert json.loads((tmp_path / "model" / "provenance.json").read_text())["version"] == final
            os.remove(folder / "filler")
            assert proc.wait(timeout=30) == 0  # the retry saved it, then the shard stopped by itself
        finally:
            if proc.poll() is None:
                proc.kill()
        events = _events(log)
        failed = next(e for e in events if e.get("event") == "final_checkpoint_failed")
        assert (
            failed["level"] == "error"
            and failed["version"] == final
            and "dilocox export --servers" in failed["recover"]
        )
        assert any(e.get("event") == "final_checkpoint_saved" for e in events)
        assert next(e for e in events if e.get("event") == "shard_stopped")["saved"] is True
        assert checkpoint.load(checkpoint_path(folder, 0))["snapshot"]["version"] == final


def test_injected_write_errors_count_once_logged_retry_every_version_and_keep_the_newest(tmp_path, monkeypatch):
    """The same rules in process, where no filesystem can be mounted: EIO and torch's RuntimeError alike."""
    shard = _saved_checkpoint(tmp_path / "scratch", rounds=0)
    keeper = checkpoint.Checkpointer(shard, tmp_path, every=2, keep=3)
    real_save = checkpoint.save
    for round_ in (1, 2):
        _publish(shard, round_)
        keeper(shard.snapshot)
    assert checkpoint.load(checkpoint_path(tmp_path, 0))["snapshot"]["version"] == 2
    errors = iter(
        [OSError(errno.EIO, "Input/output error"), RuntimeError("PytorchStreamWriter failed writing file data/0")]
    )
    monkeypatch.setattr(checkpoint, "save", lambda *a: (_ for _ in ()).throw(next(errors)))
    for round_ in (3, 4):  # 3 is off the interval (every 2): only 4 tries, and fails
        _publish(shard, round_)
        keeper(shard.snapshot)
    assert shard.status()["checkpoint_failing_rounds"] == 1
    _publish(shard, 5)  # off the interval, but a save is owed: retried, fails again
    keeper(shard.snapshot)
    status = shard.status()
    assert (status["checkpoint_failures"], status["checkpoint_failing_rounds"]) == (2, 2)
    assert "PytorchStreamWriter" in status["checkpoint_error"]
    record = {"address": "a:1", "shard_index": 0, **status}
    assert "could not save its checkpoint for the last 2 version(s)" in format_table([_status_record(record)])
    assert checkpoint.load(checkpoint_path(tmp_path, 0))["snapshot"]["version"] == 2  # never removed before a successor
    assert sorted(p.name for p in tmp_path.glob("shard-0*.pt")) == [
        "shard-0.pt",
        "shard-0.v2.pt",
    ]  # kept by a link, not moved
    monkeypatch.setattr(checkpoint, "save", real_save)
    _publish(shard, 6)
    keeper(shard.snapshot)
    assert shard.status()["checkpoint_failing_rounds"] == 0 and shard.status()["checkpoint_failures"] == 2
    assert checkpoint.load(checkpoint_path(tmp_path, 0))["snapshot"]["version"] == 6
    assert sorted(p.name for p in tmp_path.glob("shard-0*.pt")) == ["shard-0.pt", "shard-0.v2.pt"]


def test_a_hook_that_raises_never_fails_the_round_it_reports():
    shard = Shard(0, 1, RUN)
    from dilocox.common.wire.assignment import model_digest

    shard.join(RUN, "c", model_digest(SMALL_PARAMS), SMALL_PARAMS, "{}")
    shard.on_publish = lambda snapshot: (_ for _ in ()).throw(ValueError("a metrics bug"))
    for round_ in range(3):
        _publish(shard, round_)
    assert shard.version == 2 and shard.last_round.round == 2


def _status_record(record: dict) -> dict:
    base = {
        "state": "waiting",
        "run_id": RUN,
        "num_shards": 1,
        "version": 5,
        "open_round": 6,
        "clusters": [],
        "contributed": [],
        "min_clusters": 1,
        "num_elements": 0,
        "initialised": True,
        "last_round_seconds": 0.0,
        "last_round_closed_at": 0.0,
        "bytes_in": 0,
        "bytes_out": 0,
        "final_version": None,
        "replay_mismatches": 0,
        "sites": [],
    }
    return {
        **base,
        **{k: v for k, v in record.items() if k in ("address", "shard_index") or k.startswith("checkpoint_")},
    }


def test_a_site_whose_checkpoint_disk_fills_up_trains_on_and_says_so(shard_set, tmp_path):
    """The site's `--checkpoint-dir` fills up mid-run: the run finishes with every round, each refused save
    is logged with its round and path, nothing half-written is left, and the committed ones stay."""
    import sys
    import time

    shards = shard_set(1, "site-disk")
    shard = shards.shards[0]
    rounds = 8
    with small_filesystem(tmp_path / "ckpt", 4) as folder:
        cmd = [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "worker",
            "--servers",
            shards.addresses[0],
            "--run-id",
            "site-disk",
            "--cluster",
            "solo",
            "--rounds",
            str(rounds),
            "--inner-steps",
            "2",
            "--n-layer",
            "1",
            "--n-embd",
            "32",
            "--block-size",
            "32",
            "--inner-batch-size",
            "4",
            "--eval-batches",
            "1",
            "--threads",
            "1",
            "--insecure",
            "--checkpoint-dir",
            str(folder),
            "--log-format",
            "json",
        ]
        site = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while shard.version < 2 and time.monotonic() < deadline and site.poll() is None:
                time.sleep(0.05)
            fill(folder / "filler")
            _, log = site.communicate(timeout=300)
        finally:
            if site.poll() is None:
                site.kill()
        assert site.returncode == 0, log[-3000:]
        assert shard.version == rounds + 1  # every round, then the flush
        events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        failed = [e for e in events if e["event"] in ("worker_checkpoint_failed", "worker_checkpoint_commit_failed")]
        assert failed and all(e["path"].startswith(str(folder)) and e["error"] for e in failed), failed
        left = sorted(p.name for p in (folder / "solo").iterdir())
        assert all((folder / "solo" / name / "COMMITTED").exists() for name in left), left  # no half-written round


def test_a_rotation_copy_cut_short_leaves_no_kept_file_and_no_temporary(tmp_path, monkeypatch):
    """Where hard links are not supported the newest file is copied to its kept name; a copy cut short by a
    full disk must not sit under that name (a retried rotation would take it for done)."""
    current = tmp_path / "shard-0.pt"
    current.write_bytes(b"x" * 4096)

    def no_links(*_):
        raise OSError(errno.EPERM, "links not supported")

    def short_copy(source, target):
        open(target, "wb").write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(checkpoint.shutil, "copy2", short_copy)
    with pytest.raises(OSError):
        checkpoint._keep_as(current, tmp_path / "shard-0.v2.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-0.pt"]
