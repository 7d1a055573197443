"""`dilocox export`: the global model out of live shards (a read-only observer) or their checkpoints,
checked whole and at one version, written as files the project's model and Hugging Face both load."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from dilocox.common.config.run import InnerConfig, ModelConfig, RunConfig
from dilocox.common.wire.checkpoint_format import checkpoint_path, save_state
from dilocox.server.state import checkpoint
from dilocox.sim.inprocess import run_in_process
from dilocox.worker.export.export_folder import evaluate_export, write_export
from dilocox.worker.export.model import ExportError, from_checkpoints, from_servers, served_run_id

pytest.importorskip("safetensors")


def _config(model: str = "gpt") -> RunConfig:
    return RunConfig(
        run_id="export-run",
        rounds=2,
        eval_batches=1,
        model=ModelConfig(model=model, n_layer=1, n_embd=32, block_size=32),
        inner=InnerConfig(steps=3, batch_size=4, warmup_steps=2),
    )


def _shards_weights(result) -> dict:
    """{name: full tensor} assembled from the in-process shards' own published snapshots."""
    slices = {k: t for shard in result.shards for k, t in shard.snapshot.tensors.items()}
    names = {k.name for k in slices}
    return {
        name: torch.cat([slices[k] for k in sorted((k for k in slices if k.name == name), key=lambda k: k.row_start)])
        for name in names
    }


def _trained(model: str, tmp_path):
    """A two-cluster, two-shard run; exported live before the shards stop, and checkpointed."""
    live = {}

    def before_stop(addresses):
        live["model"] = from_servers(addresses, "export-run")

    result = run_in_process(_config(model), num_clusters=2, num_shards=2, before_stop=before_stop, timeout_s=300)
    for shard in result.shards:
        checkpoint.save(shard, tmp_path / "ckpt")
    return result, live["model"]


def test_export_from_live_shards_and_from_checkpoints_are_the_shards_weights(tmp_path):
    result, live = _trained("gpt", tmp_path)
    assert all(
        shard.members.keys() == {"cluster-0", "cluster-1"} for shard in result.shards
    )  # the observer joined nothing
    offline = from_checkpoints([tmp_path / "ckpt"])
    want = _shards_weights(result)
    assert live.version == offline.version == result.shards[0].version
    assert live.tensors.keys() == offline.tensors.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(live.tensors[name], tensor) and torch.equal(offline.tensors[name], tensor), name
    out = write_export(live, tmp_path / "model")
    record = json.loads((out / "export.json").read_text())
    assert record["version"] == live.version and record["num_params"] == live.num_params and not record["huggingface"]
    # The exported model's eval loss is the run's final one (every cluster ends on the shards' model).
    assert evaluate_export(out) == pytest.approx(result.clusters[0].final_eval_loss, abs=1e-4)


def test_export_of_a_tiny_llama_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    result, live = _trained("llama-tiny", tmp_path)
    out = write_export(live, tmp_path / "model")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    for name, p in loaded.named_parameters():
        assert torch.equal(p, live.tensors[name]), name
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert loaded(x).logits.shape == (2, 16, 256)
    assert evaluate_export(out) == pytest.approx(result.clusters[0].final_eval_loss, abs=1e-4)
    # Its record holds the model's own fields, not the built-in GPT's shape.
    model_fields = json.loads((out / "export.json").read_text())["run_config"]["model"]
    assert model_fields["model"] == "llama-tiny" and "block_size" in model_fields
    assert not {"n_layer", "n_head", "n_embd", "dropout", "vocab_size"} & set(model_fields)
    # For the people who use it: generate() keeps its key/value cache, and the files are as readable as any
    # this user writes (safetensors makes 0600 files; teammates on a shared file system could not read them).
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    umask = os.umask(0o022)
    os.umask(umask)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask for f in out.iterdir()), {
        f.name: oct(f.stat().st_mode) for f in out.iterdir()
    }


def test_export_refuses_a_missing_shard_a_missing_slice_and_mixed_versions(tmp_path):
    result, _ = _trained("gpt", tmp_path)
    files = [checkpoint_path(tmp_path / "ckpt", i) for i in range(2)]
    with pytest.raises(ExportError, match=r"no weights from shard\(s\) \[1\]"):
        from_checkpoints([files[0]])
    state = checkpoint.load(files[1])
    older = dict(state, snapshot=dict(state["snapshot"], version=state["snapshot"]["version"] - 1))
    save_state(older, tmp_path / "older.pt")
    with pytest.raises(ExportError, match="different versions"):
        from_checkpoints([files[0], tmp_path / "older.pt"])
    tensors = dict(state["snapshot"]["tensors"])
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_state(dict(state, snapshot=dict(state["snapshot"], tensors=tensors)), tmp_path / "holed.pt")
    with pytest.raises(ExportError, match=rf"slice {dropped[0]}\[.*\] of shard 1 is missing"):
        from_checkpoints([files[0], tmp_path / "holed.pt"])
    save_state(dict(state, run_id="another-run"), tmp_path / "other.pt")
    with pytest.raises(ExportError, match="from another run"):
        from_checkpoints([files[0], tmp_path / "other.pt"])
    write_export(from_checkpoints(files), tmp_path / "done")
    with pytest.raises(FileExistsError):
        write_export(from_checkpoints(files), tmp_path / "done")


def test_export_command_errors_are_clear(tmp_path, shard_set):
    cli = [sys.executable, "-m", "dilocox.common.cli", "export", "--out", str(tmp_path / "out")]
    missing = subprocess.run(
        [*cli, "--checkpoints", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 1 and "no shard checkpoint at" in missing.stderr
    empty = shard_set(1, "export-run")  # a shard no cluster has joined yet
    fresh = subprocess.run(
        [*cli, "--servers", empty.addresses[0], "--run-id", "export-run", "--insecure"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fresh.returncode == 1 and "holds no model yet" in fresh.stderr
    wrong = subprocess.run(
        [*cli, "--servers", empty.addresses[0], "--run-id", "other", "--insecure"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.returncode == 1 and "PERMISSION_DENIED" in wrong.stderr
    # Without --run-id the shards say which run they serve (deploy and sim default to different ids).
    asked = subprocess.run(
        [*cli, "--servers", empty.addresses[0], "--insecure"], capture_output=True, text=True, timeout=120
    )
    assert asked.returncode == 1 and "holds no model yet" in asked.stderr  # it got as far as the run's weights
    other = shard_set(1, "another-run")
    with pytest.raises(ExportError, match="the shards serve different runs"):
        served_run_id([empty.addresses[0], other.addresses[0]])
    assert served_run_id(empty.addresses) == "export-run"
    assert not (tmp_path / "out").exists()


def test_the_readmes_export_commands_work_as_written_with_and_without_the_shards_running(tmp_path):
    """The two `dilocox export` lines of docs/operations.md, only the shards'
    addresses and `$W` replaced: live while the shards serve, and offline from the one folder both shards
    checkpoint into once they stopped."""
    import pathlib
    import re
    import shlex

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    live_line, offline_line = (
        next(line for line in page.splitlines() if line.startswith(f"dilocox export --{source}"))
        for source in ("servers", "checkpoints")
    )
    config = dataclasses.replace(_config(), run_id=RunConfig().run_id)  # the page's commands name no run id
    done = {}

    def run_line(line: str, addresses: list[str] | None = None) -> subprocess.CompletedProcess:
        if addresses:
            line = re.sub(r"agg\.example\.org:5005(\d)", lambda m: addresses[int(m[1]) - 1], line)
        argv = shlex.split(line.replace("$W", "--insecure"), comments=True)
        return subprocess.run(
            [sys.executable, "-m", "dilocox.common.cli", *argv[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def before_stop(addresses):
        done["live"] = run_line(live_line, addresses)

    result = run_in_process(config, num_clusters=2, num_shards=2, before_stop=before_stop, timeout_s=300)
    for shard in result.shards:  # the one folder both of the page's servers checkpoint into
        checkpoint.save(shard, tmp_path / "ckpt")
    offline = run_line(offline_line)
    for name, outcome in [*done.items(), ("offline", offline)]:
        assert outcome.returncode == 0, (name, outcome.stdout[-2000:], outcome.stderr[-2000:])
    versions = {
        json.loads((tmp_path / folder / "export.json").read_text())["version"] for folder in ("model", "model-offline")
    }
    assert versions == {config.final_version}
    assert "shard 0:" in offline.stdout and "shard 1:" in offline.stdout
