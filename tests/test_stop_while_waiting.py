"""A stop honours its bound in every state of the round loop.

A site whose round cannot close (the shards wait for a second site that never comes) sits at its round
boundary waiting for the round's result: before, a SIGTERM there was acted on only once the wait ended —
up to the pull wait, an hour — and a second SIGTERM did not end it either (the interpreter joined the
exchange thread). Now the wait looks at the signal, gives the exchange `--stop-grace-s`, and the site
leaves, committing the round whose push reached the shards; a second signal exits at once; Ctrl-C (SIGINT)
is a stop like SIGTERM, exit 130, no traceback. Real processes: shards and a worker."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.tiny_worker import worker_argv

RUN = "stop-waiting"
GRACE_S = 1.5


def _waiting_site(shard_set, tmp_path, grace_s: float = GRACE_S):  # noqa: ANN001, ANN202
    """A site alone in a run whose shards wait for two: round 1 is pushed and never closes, so the site
    waits at round 2's boundary for round 1's result. Returns the process once it says it waits there."""
    shards = shard_set(1, RUN, min_clusters=2)
    cmd = worker_argv(
        shards.addresses,
        RUN,
        "--cluster",
        "alone",
        "--rounds",
        "6",
        "--inner-steps",
        "2",
        "--stop-grace-s",
        str(grace_s),
        "--checkpoint-dir",
        str(tmp_path),
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, "the worker exited early: " + "".join(lines[-30:])
        lines.append(line)
        if '"round_result_waiting"' in line:  # round 2's two steps are done; its boundary waits for round 1's result
            assert json.loads(line)["round"] == 1, line
            return proc, lines
    proc.kill()
    proc.wait()
    raise AssertionError("the worker's boundary did not wait for round 1's result: " + "".join(lines[-30:]))


def _finish(proc: subprocess.Popen, lines: list[str], within_s: float) -> tuple[float, list[dict]]:
    started = time.monotonic()
    try:
        _, rest = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, rest = proc.communicate()
        raise AssertionError(
            f"the worker was still running {within_s:.0f} s after the signal: " + (rest or "")[-3000:]
        ) from None
    lines.append(rest)
    events = [json.loads(line) for line in "".join(lines).splitlines() if line.startswith("{")]
    return time.monotonic() - started, events


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "sigint"])
def test_a_stop_while_the_boundary_waits_for_a_result_ends_within_its_grace(shard_set, tmp_path, signum, code):
    from dilocox.worker.checkpoint import COMMITTED

    proc, lines = _waiting_site(shard_set, tmp_path)
    proc.send_signal(signum)
    seconds, events = _finish(proc, lines, within_s=GRACE_S + 30)
    text = "".join(lines)
    assert proc.returncode == code and "Traceback" not in text, text[-3000:]
    assert seconds < GRACE_S + 15, seconds  # the grace, the boundary's leaving and the checkpoint's close
    waiting = [e for e in events if e["event"] == "worker_stop_waiting"]
    assert waiting and waiting[0]["grace_s"] == GRACE_S and waiting[0]["signal"] == signal.Signals(signum).name
    assert any(e["event"] == "worker_stopping" for e in events)
    # Round 1's part reached the shard (its result never came): its checkpoint is committed, a resume starts there.
    assert (tmp_path / "alone" / "round-000001" / COMMITTED).exists(), text[-3000:]


def test_a_second_signal_exits_at_once(shard_set, tmp_path):
    # A grace far past the bound: the second signal surely comes while the first is honoured, and costs nothing.
    proc, lines = _waiting_site(shard_set, tmp_path, grace_s=30.0)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    seconds, _ = _finish(proc, lines, within_s=10)
    assert proc.returncode == 143 and seconds < 5, seconds
    assert "second SIGTERM: exiting now" in "".join(lines)
