"""A pp 1 × dp 2 site that is late at the end of a quorum run, against two shards
of which one answers later than the other, so its two ranks can hold different versions when the run
ends. It finishes (or refuses) cleanly within its timeouts — never hangs in a barrier one rank entered
and the other skipped — and both ranks end alike."""

from __future__ import annotations

import json
import subprocess
import time

from tests.tiny_worker import worker_argv

RUN = "late-ranks"


def _worker(addresses: list[str], cluster: str, index: int, log, *extra: str) -> subprocess.Popen:
    cmd = worker_argv(
        addresses,
        RUN,
        "--cluster",
        cluster,
        "--cluster-index",
        str(index),
        "--num-clusters",
        "2",
        "--rounds",
        "4",
        "--inner-steps",
        "2",
        "--shard-wait-s",
        "60",
        *extra,
    )
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True)


def test_a_late_two_rank_site_ends_a_quorum_run_cleanly_with_one_shard_slower(shard_set, tmp_path):
    # A quorum of 1 with a short grace window; the first round waits for both sites to have joined.
    shards = shard_set(2, RUN, min_clusters=1, grace_s=(0.1, 0.1), added_latency_s=[0.0, 0.4], expect_clusters=2)
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("fast", "late")}
    late = _worker(shards.addresses, "late", 1, logs["late"], "--dp", "2", "--simulate-slowdown", "4")
    procs = [late]
    try:
        fast = _worker(shards.addresses, "fast", 0, logs["fast"])
        procs.append(fast)
        deadline = time.monotonic() + 420
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        hung = [p.args[p.args.index("--cluster") + 1] for p in procs if p.poll() is None]
        assert not hung, f"{hung} still running after 420 s: " + (tmp_path / "late.log").read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                from tests.test_checkpoint import kill_tree

                kill_tree(p.pid)
        for f in logs.values():
            f.close()
    assert fast.returncode == 0, (tmp_path / "fast.log").read_text()[-3000:]
    text = (tmp_path / "late.log").read_text()
    assert late.returncode == 0, text[-4000:]
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    done = {e["rank"]: e for e in events if e.get("event") == "cluster_done"}
    assert sorted(done) == [0, 1], sorted(done)
    assert done[0]["version"] == done[1]["version"] and done[0]["rounds"] == done[1]["rounds"]  # decided alike
    assert all(s.version == 5 for s in shards.shards)  # 4 rounds and the flush, on both shards
