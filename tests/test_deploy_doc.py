"""docs/deploy.md's worked example, run as written on localhost: certificates, two TLS shards, two
torchrun sites, status, metrics. Only the `step=setup` variables (hosts, sizes) and the listening
ports are replaced, so the guide's commands cannot rot."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from dilocox.common.cli import build_parser
from tests.ports import listening

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
STEP = re.compile(r"```bash step=(?P<name>[\w-]+)\n(?P<body>.*?)```", re.S)


def doc_steps() -> dict[str, str]:
    return {m["name"]: m["body"] for m in STEP.finditer(DOC.read_text())}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_every_dilocox_command_in_the_guide_parses():
    """Every `dilocox …` line and every `torchrun … -m dilocox.common.cli …` parses with the CLI's parser."""
    text = DOC.read_text().replace("\\\n", " ")
    setup = subprocess.run(
        ["bash", "-c", doc_steps()["setup"] + "\nenv -0"], capture_output=True, text=True, check=True
    )
    example = dict(item.split("=", 1) for item in setup.stdout.split("\0") if "=" in item)
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: example.get(m[1], m[0]), text)
    commands = []
    for block in re.findall(r"```bash[^\n]*\n(.*?)```", text, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["dilocox"]:
                commands.append(words[1:])
            elif words[:1] == ["torchrun"]:
                commands.append(words[words.index("dilocox.common.cli") + 1 :])
    assert len(commands) >= 8
    for argv in commands:
        build_parser(argv).parse_args(argv)


@pytest.mark.timeout(300)
def test_worked_example_runs_on_localhost(tmp_path):
    steps = doc_steps()
    assert {"setup", "certs", "shard-0", "shard-1", "site-a", "site-b", "status", "metrics", "export"} <= steps.keys()
    grpc0, grpc1, m0, m1, m2, m3, rdzv_a, rdzv_b = free_ports(8)
    ports = {"50051": grpc0, "50052": grpc1, "9100": m0, "9101": m1, "9102": m2, "9103": m3}

    def localised(step: str) -> str:
        return re.sub(r"\b(50051|50052|9100|9101|9102|9103)\b", lambda m: str(ports[m[1]]), steps[step])

    env = {
        **os.environ,
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "RUN_ID": "doc-run",
        "AGG_HOST": "localhost",
        "SHARDS": f"localhost:{grpc0},localhost:{grpc1}",
        "DILOCOX_TOKEN": "doc-test-token",
        "NODES": "1",
        "GPUS_PER_NODE": "2",
        "PP": "2",
        "DP": "1",
        "ROUNDS": "2",
        "SITE_A_RDZV": f"127.0.0.1:{rdzv_a}",
        "SITE_B_RDZV": f"127.0.0.1:{rdzv_b}",
        "DILOCOX_INNER_STEPS": "10",
        "DILOCOX_EVAL_BATCHES": "2",
        "OMP_NUM_THREADS": "1",
    }

    def shell(step: str, extra: str = "", name: str | None = None, **kwargs) -> subprocess.Popen:
        """Run a step as written; `extra`: flags the guide says to add to its command (step 6)."""
        log = open(tmp_path / f"{name or step}.log", "w")
        command = localised(step).rstrip() + extra
        return subprocess.Popen(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kwargs,
        )

    def output(step: str) -> str:
        return (tmp_path / f"{step}.log").read_text()

    def stop(procs: list) -> None:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    def wait_listening(*steps: str) -> None:
        for port in (grpc0, grpc1):
            deadline = time.monotonic() + 60
            while not listening(port):
                assert time.monotonic() < deadline, "".join(output(s) for s in steps)
                time.sleep(0.2)

    assert shell("certs").wait(timeout=60) == 0, output("certs")
    shards = [shell("shard-0"), shell("shard-1")]
    sites = []
    try:
        wait_listening("shard-0", "shard-1")
        sites = [shell("site-a"), shell("site-b")]
        for name, proc in zip(("site-a", "site-b"), sites):
            assert proc.wait(timeout=240) == 0, output(name)[-4000:]
        assert shell("status").wait(timeout=60) == 0, output("status")
        rows = [line.split() for line in output("status").splitlines() if line[:1].isdigit()]
        # shard, version, clusters: 2 rounds, then the end-of-run flush of the error-feedback residuals
        assert [(r[0], r[3], r[5]) for r in rows] == [("0/2", "3/3", "2"), ("1/2", "3/3", "2")], output(
            "status"
        )  # version 3 of 3
        assert shell("metrics").wait(timeout=60) == 0, output("metrics")
        assert "dilocox_rounds_closed_total 3.0" in output("metrics"), output("metrics")  # 2 rounds + the flush
        assert shell("export").wait(timeout=120) == 0, output("export")
        exported = json.loads((tmp_path / "model" / "export.json").read_text())
        assert (
            exported["run_id"] == "doc-run"
            and exported["version"] == 3
            and (tmp_path / "model" / "model.safetensors").is_file()
        )
        # 6. Train longer. A site asking for more rounds than the shards record is refused at once (no hang) ...
        env["ROUNDS"] = "4"
        early = shell("site-a", " --resume", name="site-a-early")
        assert early.wait(timeout=120) != 0, output("site-a-early")[
            -3000:
        ]  # its ranks exit 3; torchrun reports a failure
        assert "restart every shard with --resume --rounds 4" in output("site-a-early")
        stop(shards)
        assert [p.returncode for p in shards] == [0, 0], output("shard-0")[-2000:] + output("shard-1")[-2000:]
        # ... the offline export reads the stopped shards' folders (kept versions beside the newest) ...
        assert shell("export-offline").wait(timeout=120) == 0, output("export-offline")
        assert "shard 1: state/shard-1/shard-1.pt (version 3)" in output("export-offline"), output("export-offline")
        # ... then the shards and sites restarted as the guide says go on with all their state.
        shards = [
            shell("shard-0", ' --resume --rounds "$ROUNDS"', name="shard-0-longer"),
            shell("shard-1", ' --resume --rounds "$ROUNDS"', name="shard-1-longer"),
        ]
        wait_listening("shard-0-longer", "shard-1-longer")
        sites = [shell("site-a", " --resume", name="site-a-longer"), shell("site-b", " --resume", name="site-b-longer")]
        for name, proc in zip(("site-a-longer", "site-b-longer"), sites):
            assert proc.wait(timeout=240) == 0, output(name)[-4000:]
        events = [json.loads(line) for line in output("site-a-longer").splitlines() if line.startswith("{")]
        restored = [e for e in events if e.get("event") == "worker_checkpoint_restored"]
        assert (
            restored and {e["round"] for e in restored} == {3} and {e["step"] for e in restored} == {20}
        )  # 2 rounds × 10 steps
        done = [e for e in events if e.get("event") == "cluster_done"]
        assert (
            done and {e["version"] for e in done} == {5} and {e["rounds"] for e in done} == {1}
        )  # round 4, then the flush (5)
    finally:
        stop([*sites, *shards])
    assert [p.returncode for p in shards] == [0, 0], output("shard-0-longer")[-2000:] + output("shard-1-longer")[-2000:]
    assert (tmp_path / "state" / "shard-0").is_dir() and any((tmp_path / "state" / "shard-0").iterdir())


def test_your_data_at_each_site_prepares_one_tokenizer_for_every_site(tmp_path):
    """The guide's "Your data at each site": the tokenizer trained once and shipped, each site's data
    prepared with it; the workers' flags are checked by the parse test above."""
    pytest.importorskip("tokenizers")
    from dilocox.worker.data.sources import default_corpus_path
    from dilocox.worker.data.tokenizer import load_tokenizer_file

    text = default_corpus_path().read_text()
    (tmp_path / "corpus-a.txt").write_text(text[: len(text) // 2])
    (tmp_path / "corpus-b.txt").write_text(text[len(text) // 2 :])
    steps = doc_steps()
    env = {
        **os.environ,
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "SITE_A_DATA": str(tmp_path / "corpus-a.txt"),
        "SITE_B_DATA": str(tmp_path / "corpus-b.txt"),
        "DILOCOX_CACHE_DIR": str(tmp_path / "cache"),
    }
    for step in ("data-site-a", "data-site-b"):
        done = subprocess.run(
            ["bash", "-ec", steps[step]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    a, b = (json.loads((tmp_path / f"prepared-{x}" / "manifest.json").read_text()) for x in "ab")
    assert a["tokenizer_digest"] == b["tokenizer_digest"] == load_tokenizer_file(tmp_path / "tokenizer.json").digest
