"""common/heap.py: the shard keeps freed heap memory for the next message's buffers."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import os
from dilocox.common.heap import keep_freed_heap
from dilocox.proto import dilocox_pb2 as pb
taken = keep_freed_heap() if os.environ.get("KEEP") else False
message = pb.PushMessage(chunk=pb.TensorChunk(name="w", zstd_frame=os.urandom(240_000)))
faults = lambda: int(open("/proc/self/stat").read().split(")")[1].split()[7])  # minflt
before = faults()
for _ in range(200):
    message.ByteSize()  # encodes into a fresh 240 KB buffer each time
print(taken, faults() - before)
"""


def _run(keep: bool) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != "KEEP"} | ({"KEEP": "1"} if keep else {})
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    taken, faults = done.stdout.splitlines()[-1].split()  # after the setting's log line
    return taken == "True", int(faults)


def test_a_messages_buffers_are_reused_not_faulted_in_afresh():
    """Without the setting glibc hands a freed 240 KB buffer's pages back at once and the next message
    faults them in again (about 60 page faults a message); with it they are reused (counts of page faults,
    not a clock)."""
    taken, kept = _run(keep=True)
    _, default = _run(keep=False)
    assert taken
    assert kept < 200 <= default, (kept, default)
