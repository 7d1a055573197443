"""Build the DiLoCoX image on a machine with no registry access: a local Debian base image made with
debootstrap, and a wheelhouse prepared on the host, installed in the image with `--no-index`.

Why: no image can be pulled and containers reach no package index on the machines this project is
tested on, yet the compose simulation must really run there. Each step is cached and idempotent:
the base image is reused when present, the wheelhouse lives in ~/.cache/dilocox and pip skips the
wheels it already has, and docker's layer cache makes an unchanged rebuild quick.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import structlog

from dilocox.common.subprocesses import stop_gracefully

log = structlog.get_logger()

BASE_IMAGE = "dilocox-base:bookworm"
IMAGE = "dilocox:cpu"
BASE_PACKAGES = "python3,python3-venv,python3-pip,iproute2"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
WHEELHOUSE_IN_CONTEXT = ".wheelhouse"


class EngineUnavailable(RuntimeError):
    """Docker cannot be installed or started here, or what the image is made of (a Debian mirror, the
    package index) cannot be reached: the caller reports SKIPPED, not a failure of the system."""


def run(argv: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run a command, failing with its output when it fails (these are build steps, not probes)."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    return done


@dataclass
class Engine:
    """A reachable docker engine; `started` holds the dockerd we launched (stopped by `stop`)."""

    started: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.started is not None and self.started.poll() is None:
            stop_gracefully(self.started, grace_s=30)
            log.info("dockerd_stopped", pid=self.started.pid)


def _engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0


def ensure_engine(install: bool = True, log_path: pathlib.Path | None = None) -> Engine:
    """Use a running engine; else install docker.io/docker-compose/debootstrap (root, apt) and start
    dockerd ourselves (no systemd on these machines)."""
    if _engine_answers():
        return Engine()
    missing = [tool for tool in ("dockerd", "docker", "docker-compose", "debootstrap") if shutil.which(tool) is None]
    if missing and install:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise EngineUnavailable(f"{', '.join(missing)} missing and cannot be installed (needs root and apt-get)")
        log.info("installing_docker", missing=missing)
        try:
            run(["apt-get", "update", "-qq"], timeout=600)
            run(["apt-get", "install", "-y", "-qq", "docker.io", "docker-compose", "debootstrap"], timeout=900,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            raise EngineUnavailable(f"installing docker failed: {str(error)[-500:]}") from None
    if shutil.which("dockerd") is None:
        raise EngineUnavailable("dockerd is not installed")
    log_path = log_path or pathlib.Path(tempfile.gettempdir()) / "dilocox-dockerd.log"
    with open(log_path, "ab") as sink:
        daemon = subprocess.Popen(["dockerd"], stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise EngineUnavailable(f"dockerd exited with {daemon.returncode}; see {log_path}")
        if _engine_answers():
            log.info("dockerd_started", pid=daemon.pid, log=str(log_path))
            return Engine(started=daemon)
        time.sleep(1)
    daemon.terminate()
    raise EngineUnavailable(f"dockerd did not answer within 60 s; see {log_path}")


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True, check=False).returncode == 0


def ensure_base_image(name: str = BASE_IMAGE, mirror: str = DEBIAN_MIRROR) -> None:
    """A minimal Debian bookworm with Python 3.11 and iproute2, imported as a docker image."""
    if image_exists(name):
        log.info("base_image_cached", image=name)
        return
    if shutil.which("debootstrap") is None:
        raise EngineUnavailable("debootstrap is not installed (apt-get install debootstrap)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dilocox-rootfs-") as rootfs:
        try:
            run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", rootfs, mirror], timeout=1200)
        except (RuntimeError, subprocess.TimeoutExpired) as error:  # the mirror is out of reach: the environment's fault
            raise EngineUnavailable(f"debootstrap could not build the base image from {mirror}: {str(error)[-500:]}") from None
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "-", name], stdin=tar.stdout, capture_output=True, text=True, check=False)
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import of the debootstrap rootfs failed: {imported.stderr[-2000:]}")
    log.info("base_image_built", image=name, seconds=round(time.monotonic() - started, 1))


def prepare_wheelhouse(project: pathlib.Path, cache: pathlib.Path) -> pathlib.Path:
    """Wheels for the project and every dependency, the host's torch build included (a CPU wheel on
    these machines), copied into the build context at .wheelhouse/."""
    import torch  # the host's build is the one the image gets: no CUDA wheel sneaks in

    cache.mkdir(parents=True, exist_ok=True)
    for stale in cache.glob("dilocox-*.whl"):
        stale.unlink()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "wheel", "--no-deps", "--wheel-dir", str(cache), str(project)], timeout=600)
    (project_wheel,) = cache.glob("dilocox-*.whl")
    try:
        run([*pip, "download", "--dest", str(cache), str(project_wheel), f"torch=={torch.__version__}"], timeout=1200)
    except (RuntimeError, subprocess.TimeoutExpired) as error:  # no package index reachable
        raise EngineUnavailable(f"the image's wheels could not be downloaded: {str(error)[-500:]}") from None
    target = project / WHEELHOUSE_IN_CONTEXT
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(cache, target)
    size = sum(p.stat().st_size for p in target.iterdir()) / 2**20
    log.info("wheelhouse_ready", path=str(target), wheels=len(list(target.iterdir())), mib=round(size, 1))
    return target


def build_image(project: pathlib.Path, cache: pathlib.Path, image: str = IMAGE, base: str = BASE_IMAGE) -> None:
    """The whole offline path: base image, wheelhouse, docker build (tagged `image`)."""
    ensure_base_image(base)
    wheelhouse = prepare_wheelhouse(project, cache)
    started = time.monotonic()
    try:
        run(["docker", "build", "--tag", image, "--build-arg", f"BASE_IMAGE={base}",
             "--build-arg", f"WHEELHOUSE={WHEELHOUSE_IN_CONTEXT}", str(project)], timeout=1800)  # fmt: skip
    finally:
        shutil.rmtree(wheelhouse, ignore_errors=True)
    # Every rebuild leaves the build stage (sources + wheelhouse) and the previous image dangling: drop ours.
    subprocess.run(["docker", "image", "prune", "--force", "--filter", "label=org.dilocox.stage"],
                   capture_output=True, timeout=300, check=False)  # fmt: skip
    log.info("image_built", image=image, base=base, seconds=round(time.monotonic() - started, 1))
