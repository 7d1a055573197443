"""The round's start on local disk between boundaries (`--spill-dir`,
worker/exchange/spill.py) — out of host memory, back with the same bits, and a run that ends on the same
global model as one that keeps it in memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dilocox.worker.exchange.host_buffers import HostBuffers
from dilocox.worker.exchange.spill import SpillBuffer, SpillError, check_spill_dir
from tests.tiny_worker import worker_argv

RUN = "spill"
CLI = [sys.executable, "-m", "dilocox.common.cli"]


def test_a_spilled_buffer_leaves_memory_between_uses_and_comes_back_bit_for_bit(tmp_path):
    n = 4 * 2**20  # 16 MB
    spill = SpillBuffer(tmp_path, n)
    values = torch.randn(n, generator=torch.Generator().manual_seed(0))
    values[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])  # every bit pattern survives, not just numbers
    spill.tensor.copy_(values)
    assert spill.resident_bytes() >= spill.nbytes * 0.9  # written: in memory
    spill.rest()
    spill.settle()
    assert spill.resident_bytes() <= spill.nbytes * 0.05, spill.resident_bytes()  # written out and handed back
    assert torch.equal(spill.tensor.view(torch.int32), values.view(torch.int32))
    assert os.listdir(tmp_path) == []  # unlinked once mapped: nothing outlives the process


def test_host_buffers_keep_a_spilled_start_out_of_memory_until_the_next_boundary(tmp_path):
    buffers = HostBuffers({"w": (512, 1024), "b": (1024,)}, spill_dir=str(tmp_path))
    buffers.start["w"].fill_(0.5)
    buffers.rest_start()
    buffers.spill.settle()  # the page-out runs in a thread; wait for it before measuring
    assert buffers.resident_nbytes <= buffers.outgoing["w"].numel() * 4 * 1.1 + 2**16
    assert float(buffers.start["w"].sum()) == 0.5 * 512 * 1024  # `start` waits for the page-out and reads it back
    assert buffers.holds(buffers.start["b"]) and not buffers.pinned


def test_a_spill_dir_in_memory_is_refused_by_name(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    with pytest.raises(SpillError, match="tmpfs.*saves no host memory"):
        check_spill_dir("/dev/shm/dilocox-spill-test")
    refused = subprocess.run(
        [*CLI, "worker", "--servers", "127.0.0.1:1", "--insecure", "--spill-dir", "/dev/shm/dilocox-spill-test"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        refused.returncode != 0
        and "dilocox worker: --spill-dir /dev/shm/dilocox-spill-test is on tmpfs" in refused.stderr
    )


def _site(shards, log, *extra: str) -> subprocess.CompletedProcess:  # noqa: ANN001
    # merged at the boundary: a mid-round merge's step depends on the machine's pace; the runs are compared
    # bit for bit
    cmd = worker_argv(shards.addresses, RUN, "--rounds", "3", "--inner-steps", "2", "--overlap-steps", "0", *extra)
    with log.open("w") as err:
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, timeout=300)
    assert done.returncode == 0, log.read_text()[-4000:]
    return done


def test_a_site_with_its_start_on_disk_ends_on_the_same_bits_with_12_bytes_per_parameter(shard_set, tmp_path):
    in_memory, on_disk = shard_set(2, RUN), shard_set(2, RUN)
    _site(in_memory, tmp_path / "memory.log")
    _site(on_disk, tmp_path / "disk.log", "--spill-dir", str(tmp_path / "spill"))
    a = {key: t for shard in in_memory.shards for key, t in shard.snapshot.tensors.items()}
    b = {key: t for shard in on_disk.shards for key, t in shard.snapshot.tensors.items()}
    assert a.keys() == b.keys() and in_memory.shards[0].version == on_disk.shards[0].version == 4
    assert not [key for key in a if not torch.equal(a[key], b[key])]
    assert sum(s.status()["replay_mismatches"] for s in on_disk.shards) == 0
    events = [json.loads(line) for line in (tmp_path / "disk.log").read_text().splitlines() if line.startswith("{")]
    memory = next(e for e in events if e.get("event") == "exchange_memory")
    owned = memory["params_owned"]
    assert memory["spilled_bytes"] == 4 * owned
    steady = (memory["total_bytes"] - memory["own_push_bytes"] - memory["compressor_bytes"]) / owned
    assert steady == 12, memory  # outgoing + replica + momentum; the start is on disk
    assert os.listdir(tmp_path / "spill") == []


def test_page_locked_buffers_are_registered_not_rounded_up():
    """A pinned host buffer is registered with CUDA at its own size, not taken from
    torch's caching host allocator (which rounds each block up to a power of two); without CUDA it is a
    plain pageable buffer."""
    from dilocox.worker.exchange.host_buffers import host_empty

    n = 3 * 2**20 + 5  # not a power of two
    if not torch.cuda.is_available():
        buffer = host_empty(n, pinned=True)
        assert buffer.numel() == n and not buffer.is_pinned()
        return
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    buffer = host_empty(n, pinned=True)
    assert buffer.numel() == n and buffer.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before  # not the caching allocator's
    device = torch.arange(n, dtype=torch.float32, device="cuda")
    buffer.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffer, device.cpu())
