"""A real single-node Slurm on this machine for tests: Debian's slurm-wlm (munged, slurmctld, slurmd)
started in a temporary folder with its own config, ports and munge key, stopped afterwards.

`LocalSlurm.start` installs slurm-wlm with apt-get where it is missing and this is root, and raises
`SlurmUnavailable` with the reason where that cannot be done (the test then says SKIPPED and why)."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import time

from tests.debian_packages import PackageUnavailable, ensure
from tests.ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmUnavailable(RuntimeError):
    pass


def ensure_installed() -> None:
    try:
        ensure("slurm-wlm", (*DAEMONS, "sbatch"))
    except PackageUnavailable as error:
        raise SlurmUnavailable(str(error)) from None


class LocalSlurm:
    """One node (this host, under its own hostname) in one partition; jobs may share its cores."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.node = socket.gethostname()

    def start(self, timeout: float = 60.0) -> LocalSlurm:
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root to start jobs as the submitting user")
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge = self.root / "munge"
        munge.chmod(0o700)
        (munge / "munge.key").write_bytes(os.urandom(1024))
        (munge / "munge.key").chmod(0o600)
        subprocess.run(
            [
                "munged",
                "--force",
                f"--key-file={munge}/munge.key",
                f"--socket={munge}/sock",
                f"--pid-file={munge}/pid",
                f"--log-file={munge}/log",
                f"--seed-file={munge}/seed",
            ],
            check=True,
            timeout=30,
        )
        cpus = os.cpu_count() or 1
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=dilocoxtest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    # cred_expire: a requeued job waits this long before it may start again (default 120 s)
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={munge}/sock,cred_expire=5",
                    "CredType=cred/munge",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={self.root}/state",
                    f"SlurmdSpoolDir={self.root}/spool",
                    f"SlurmctldPidFile={self.root}/slurmctld.pid",
                    f"SlurmdPidFile={self.root}/slurmd.pid",
                    f"SlurmctldLogFile={self.root}/log/slurmctld.log",
                    f"SlurmdLogFile={self.root}/log/slurmd.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "MpiDefault=none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "JobRequeue=1",
                    "ReturnToService=2",
                    "SchedulerParameters=sched_interval=1,bf_interval=1",
                    "KillWait=10",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN",
                    # every job of the test on one small machine: cores are shared (the test's jobs are light)
                    f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP "
                    "OverSubscribe=FORCE:16",
                ]
            )
            + "\n"
        )
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, timeout=30, env=self.env)
        subprocess.run(["slurmd", "-f", str(self.conf), "-N", self.node], check=True, timeout=30, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.5)
        self.stop()
        raise SlurmUnavailable(f"the node did not come up within {timeout:g}s (sinfo: {state!r}); see {self.root}/log")

    def run(self, *argv: str, check: bool = True, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv), capture_output=True, text=True, env=self.env, cwd=cwd, check=check, timeout=60
        )

    def sbatch(self, script: pathlib.Path, *flags: str) -> str:
        return self.run("sbatch", "--parsable", *flags, str(script), cwd=script.parent).stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, …), '' once Slurm forgot it."""
        shown = self.run("scontrol", "show", "job", job, check=False).stdout
        return next((w.split("=", 1)[1] for w in shown.split() if w.startswith("JobState=")), "")

    def stop(self) -> None:
        """Cancel every job and end the daemons: SIGTERM by their pid files, then SIGKILL any process still
        running from this cluster's folder (a slurmd busy with a failed job's steps outlived the SIGTERM and
        was left behind, parentless, after a failing run)."""
        self.run("scancel", "--full", "--user", "root", check=False)
        for pid_file in (self.root / "slurmd.pid", self.root / "slurmctld.pid", self.root / "munge" / "pid"):
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        while (left := self._own_processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _own_processes(self) -> list[int]:
        """Processes whose command line or environment names this cluster's folder: its daemons, and the
        job steps (slurmstepd and what it runs carry SLURM_CONF)."""
        mine, root = [], str(self.root).encode()
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f, open(f"/proc/{entry}/environ", "rb") as g:
                        if root in f.read() or root in g.read():
                            mine.append(int(entry))
                except OSError:
                    continue
        return mine
