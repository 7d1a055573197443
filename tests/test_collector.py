"""common/collector.py: a started shard's objects are out of later collections, and cycles are still collected."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc, weakref
import torch  # what a shard imports: the objects a full collection walked every few rounds
from dilocox.common.collector import YOUNG_THRESHOLD, settle_collector
from dilocox.server import main  # noqa: F401
walked_before = len(gc.get_objects())
frozen = settle_collector()
walked_after = len(gc.get_objects())

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle made after: only the collector frees it
gone = weakref.ref(a)
del a, b
held = [[] for _ in range(3 * YOUNG_THRESHOLD)]  # enough net allocations for a young collection on its own
print(walked_before, walked_after, frozen, gc.get_threshold()[0], gone() is None)
"""


def test_start_ups_objects_leave_later_collections_and_cycles_are_still_collected():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    walked_before, walked_after, frozen, young, collected = done.stdout.splitlines()[-1].split()  # after any log line
    assert int(walked_before) > 100_000 and int(frozen) >= int(walked_before) * 9 // 10, (walked_before, frozen)
    assert int(walked_after) < int(walked_before) // 20, (
        walked_before,
        walked_after,
    )  # objects a full collection walks
    assert int(young) == 5_000
    assert collected == "True"  # the collector is not switched off: a cycle made later is freed without gc.collect()
