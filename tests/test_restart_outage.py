"""Sites ride out a shard outage longer than the old give-up time: a PP=2 gloo site
and a single-process site keep training through a 70 s restart of their shard, and the first push the
restarted shard accepts comes within a second of it serving."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time

import grpc

from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from tests.test_restart import RUN, _free_port, _shard_cmd, _wait_listening

OUTAGE_S = 70  # longer than the ~55 s after which workers used to give up
ROUNDS = 8


def _events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _at(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["timestamp"]).timestamp()


def _version(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            return pb_grpc.AggregatorStub(channel).Status(pb.StatusRequest(), timeout=5).version
        except grpc.RpcError:
            return -1


def _site(address: str, index: int, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "worker",
        "--servers",
        address,
        "--run-id",
        RUN,
        "--cluster",
        f"site-{index}",
        "--cluster-index",
        str(index),
        "--num-clusters",
        "2",
        "--rounds",
        str(ROUNDS),
        "--inner-steps",
        "2",
        "--n-layer",
        "2",
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
        "--log-format",
        "json",
        "--insecure",
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_restart_sites_ride_out_a_70s_shard_outage(tmp_path):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    shard_cmd = _shard_cmd(port, tmp_path / "ckpt", "--min-clusters", "2", "--keep-serving")
    first = subprocess.Popen(shard_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    second = None
    sites = []
    try:
        _wait_listening(port, first)
        sites = [_site(address, 0, "--pp", "2"), _site(address, 1)]
        deadline = time.monotonic() + 240
        while _version(address) < 2:
            assert time.monotonic() < deadline and all(s.poll() is None for s in sites), (
                "the run did not reach version 2"
            )
            time.sleep(0.2)
        first.terminate()
        assert first.wait(timeout=30) == 0
        stopped_at = time.monotonic()
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped_at)))
        gone = [s for s in sites if s.poll() is not None]
        assert not gone, "a site gave up during the outage: " + gone[0].stderr.read()[-5000:]
        second = subprocess.Popen(
            [*shard_cmd, "--resume"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        logs = [s.communicate(timeout=300)[1] for s in sites]
        for site, log in zip(sites, logs):
            assert site.returncode == 0, log[-4000:]
        final = _version(address)
    finally:
        for proc in [*sites, first, second]:
            if proc is not None and proc.poll() is None:
                proc.kill()
    second.terminate()
    shard_log = _events(second.communicate(timeout=30)[1])
    serving = min(_at(e) for e in shard_log if e["event"] == "shard_serving")
    site_events = [e for log in logs for e in _events(log)]
    assert any(e["event"] == "shard_unavailable_waiting" for e in site_events)  # one line per attempt
    accepted = [_at(e) for e in shard_log if e["event"] == "push_accepted" and e["slices"] > 0]
    around = [
        (e["event"], e.get("call"), e.get("cluster"), e.get("rank"), e["timestamp"][11:23])
        for e in site_events
        if e["event"]
        in (
            "shard_back",
            "repushed_after_outage",
            "repush_after_outage_refused",
            "round_result_late_repushing",
            "cluster_rejoining",
        )
    ]
    assert accepted, f"no push reached the restarted shard: {around}"
    first_push_after = min(accepted) - serving
    print(
        f"outage {OUTAGE_S}s: first accepted push {first_push_after:.3f}s after the shard served; final version {final}"
    )
    assert first_push_after < 1.0, f"first accepted push {first_push_after:.2f}s after the shard served: {around}"
    assert final == ROUNDS + 1  # every round and the end-of-run flush closed: nothing was lost to the outage
