"""The run's teardown check finds a process the tests started, wherever it was re-parented."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.leftovers import MARK, left_behind, marked_processes


def test_a_process_started_by_a_test_carries_the_runs_mark_even_orphaned_and_is_killed_if_left():
    # A mark of this test's own: `left_behind` kills what carries it, and the run's mark is also on the
    # processes of tests running beside this one (xdist).
    mark = f"{os.environ[MARK]}-leftovers-test"
    # A child that starts a grandchild and exits: the grandchild is re-parented (out of our process tree).
    launcher = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; "
            "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], stdout=subprocess.DEVNULL, "
            "stderr=subprocess.DEVNULL).pid)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={**os.environ, MARK: mark},
    )
    orphan = int(launcher.stdout.strip())
    try:
        assert orphan in marked_processes(mark) and os.getppid() != orphan
        assert orphan in left_behind(mark, grace_s=0.5)  # reported, then killed
        deadline = time.monotonic() + 10  # a SIGKILL is delivered asynchronously
        while orphan in marked_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orphan not in marked_processes(mark)
    finally:
        try:
            os.kill(orphan, 9)
        except ProcessLookupError:
            pass
