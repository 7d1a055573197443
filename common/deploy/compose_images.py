"""Build the DiLoCoX image on a machine with no registry access: a local Debian base image made with
debootstrap, and a wheelhouse prepared on the host, installed in the image with `--no-index`.

Why: no image can be pulled and containers reach no package index on the machines this project is
tested on, yet the compose simulation must really run there. Each step is cached and idempotent:
the base image is reused when present, the wheelhouse lives in ~/.cache/dilocox and pip skips the
wheels it already has, and docker's layer cache makes an unchanged rebuild quick.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shlex
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
# What the documented examples need in the image: --model llama-* and bpe: tokenizers (models), the
# sites' TensorBoard events (tracking, ~20 MB of wheels). Not data (pyarrow, ~55 MB of wheel, ~170 MB
# installed): only .parquet input needs it, and `dilocox data prepare` can run outside the image.
DEFAULT_EXTRAS = "models,tracking"
VARIANTS = ("cpu", "cuda")
# The CUDA variant (registry recipe, never built on the offline CI machines): PyTorch's CUDA 13.0 index
# (driver >= 580) on NVIDIA's runtime image; both can be overridden (--base-image, --torch-index).
CUDA_BASE_IMAGE = "nvidia/cuda:13.0.0-runtime-ubuntu24.04"
CUDA_TORCH_INDEX = "https://download.pytorch.org/whl/cu130"


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

    LABEL = "org.dilocox.stage"  # on every layer the Dockerfile makes (both stages)

    started: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.started is not None and self.started.poll() is None:
            stop_gracefully(self.started, grace_s=30)
            log.info("dockerd_stopped", pid=self.started.pid)


def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0


def ensure_engine(install: bool = True, log_path: pathlib.Path | None = None) -> Engine:
    """Use a running engine; else install docker.io/docker-compose/debootstrap (root, apt) and start
    dockerd ourselves (no systemd on these machines)."""
    if engine_answers():
        return Engine()
    missing = [tool for tool in ("dockerd", "docker", "docker-compose", "debootstrap") if shutil.which(tool) is None]
    if missing and install:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise EngineUnavailable(f"{', '.join(missing)} missing and cannot be installed (needs root and apt-get)")
        log.info("installing_docker", missing=missing)
        try:
            run(["apt-get", "update", "-qq"], timeout=600)
            run(
                ["apt-get", "install", "-y", "-qq", "docker.io", "docker-compose", "debootstrap"],
                timeout=900,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
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
        if engine_answers():
            log.info("dockerd_started", pid=daemon.pid, log=str(log_path))
            return Engine(started=daemon)
        time.sleep(1)
    stop_gracefully(daemon, grace_s=30)  # gone before the caller removes what it made
    raise EngineUnavailable(f"dockerd did not answer within 60 s; see {log_path}")


def host_torch_version() -> str:
    """The host's torch release without its local label (2.13.0+cpu -> 2.13.0): the version CI tests."""
    return importlib.metadata.version("torch").split("+")[0]


@dataclass(frozen=True)
class Recipe:
    """One `docker build` of the Dockerfile: which base, where torch comes from, which extras.

    cpu (offline): the debootstrap base and a host wheelhouse installed with --no-index, torch being the
    host's own CPU wheel. cuda (needs a registry and the PyTorch index): NVIDIA's runtime image, torch
    of the host's version from a CUDA index. Same Dockerfile, different build arguments."""

    variant: str
    image: str
    base_image: str
    extras: str = DEFAULT_EXTRAS
    torch_index_url: str = ""
    torch_version: str = ""

    @property
    def offline(self) -> bool:
        return self.variant == "cpu"

    def build_args(self) -> dict[str, str]:
        args = {"BASE_IMAGE": self.base_image, "EXTRAS": self.extras}
        if self.offline:
            args["WHEELHOUSE"] = WHEELHOUSE_IN_CONTEXT
        else:
            args.update(TORCH_INDEX_URL=self.torch_index_url, TORCH_VERSION=self.torch_version)
        return args

    def docker_build_argv(self, project: pathlib.Path) -> list[str]:
        argv = ["docker", "build", "--tag", self.image]
        for key, value in self.build_args().items():
            argv += ["--build-arg", f"{key}={value}"]
        return [*argv, str(project)]

    def describe(self, project: pathlib.Path) -> str:
        """What `build` does for this recipe, as shell lines a person can run by hand."""
        lines = [f"# dilocox image, variant {self.variant}: {self.image}"]
        if self.offline:
            lines += [
                f"# 1. base image {self.base_image}: debootstrap --variant=minbase --include={BASE_PACKAGES} "
                f"bookworm ROOTFS {DEBIAN_MIRROR} | docker import (skipped when present)",
                f"# 2. wheelhouse {project / WHEELHOUSE_IN_CONTEXT}: dilocox[{self.extras}] and the host's "
                f"torch {importlib.metadata.version('torch')}, pinned to the host's versions",
            ]
        else:
            lines += [
                f"# needs registry access (FROM {self.base_image}) and {self.torch_index_url or 'PyPI'} "
                f"(torch {self.torch_version or 'newest'})"
            ]
        return "\n".join([*lines, shlex.join(self.docker_build_argv(project))])


def recipe_for(
    variant: str = "cpu",
    image: str | None = None,
    base_image: str | None = None,
    extras: str = DEFAULT_EXTRAS,
    torch_index_url: str | None = None,
    torch_version: str | None = None,
) -> Recipe:
    """The recipe of `variant` with the caller's overrides (None: the variant's default)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown image variant {variant!r} (one of {', '.join(VARIANTS)})")
    extras = ",".join(e.strip() for e in extras.split(",") if e.strip())
    if variant == "cpu":
        return Recipe("cpu", image or IMAGE, base_image or BASE_IMAGE, extras)
    return Recipe(
        "cuda",
        image or "dilocox:cuda",
        base_image or CUDA_BASE_IMAGE,
        extras,
        CUDA_TORCH_INDEX if torch_index_url is None else torch_index_url,
        host_torch_version() if torch_version is None else torch_version,
    )


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
            run(
                ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", rootfs, mirror],
                timeout=1200,
            )
        except (
            RuntimeError,
            subprocess.TimeoutExpired,
        ) as error:  # the mirror is out of reach: the environment's fault
            raise EngineUnavailable(
                f"debootstrap could not build the base image from {mirror}: {str(error)[-500:]}"
            ) from None
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(
            ["docker", "import", "-", name], stdin=tar.stdout, capture_output=True, text=True, check=False
        )
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import of the debootstrap rootfs failed: {imported.stderr[-2000:]}")
    log.info("base_image_built", image=name, seconds=round(time.monotonic() - started, 1))


def host_constraints() -> list[str]:
    """`name==version` of every distribution installed here but dilocox: the image gets the versions
    the host runs (and CI tests), not whatever the index has newest."""
    pins = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() != "dilocox":
            pins.setdefault(name.lower(), f"{name}=={dist.version}")
    return sorted(pins.values())


def prepare_wheelhouse(project: pathlib.Path, cache: pathlib.Path, extras: str = DEFAULT_EXTRAS) -> pathlib.Path:
    """Exactly the wheels `dilocox[extras]` resolves to, at the host's versions, the host's torch build
    included (a CPU wheel on these machines), in the build context at .wheelhouse/. Wheels are kept in
    `cache`: a repeat resolves from it alone (--no-index) and reaches an index only for what is missing."""
    import torch  # the host's build is the one the image gets: no CUDA wheel sneaks in

    cache.mkdir(parents=True, exist_ok=True)
    for stale in cache.glob("dilocox-*.whl"):
        stale.unlink()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "wheel", "--no-deps", "--wheel-dir", str(cache), str(project)], timeout=600)
    (project_wheel,) = cache.glob("dilocox-*.whl")
    target = project / WHEELHOUSE_IN_CONTEXT
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="dilocox-pins-") as pins:
        pins.write("\n".join(host_constraints()) + "\n")
        pins.flush()
        wanted = [f"{project_wheel}[{extras}]" if extras else str(project_wheel), f"torch=={torch.__version__}"]
        download = [*pip, "download", "--dest", str(target), "--find-links", str(cache), "--constraint", pins.name]
        try:
            run([*download, "--no-index", *wanted], timeout=600)
        except (RuntimeError, subprocess.TimeoutExpired):
            try:  # some wheel is not in the cache yet: the package index has it
                run([*download, *wanted], timeout=1200)
            except (RuntimeError, subprocess.TimeoutExpired) as error:  # no package index reachable
                raise EngineUnavailable(f"the image's wheels could not be downloaded: {str(error)[-500:]}") from None
    for wheel in target.iterdir():
        if not (cache / wheel.name).exists():
            shutil.copy2(wheel, cache / wheel.name)
    size = sum(p.stat().st_size for p in target.iterdir()) / 2**20
    log.info(
        "wheelhouse_ready", path=str(target), wheels=len(list(target.iterdir())), mib=round(size, 1), extras=extras
    )
    return target


def build_image(project: pathlib.Path, cache: pathlib.Path, recipe: Recipe, prune: bool = True) -> None:
    """The whole offline path: base image, wheelhouse, docker build (tagged `recipe.image`). `prune`:
    drop every dangling image of ours afterwards (`compose check` instead removes exactly what it made)."""
    if not recipe.offline:
        raise ValueError(f"the {recipe.variant} variant is built with a registry: {recipe.describe(project)}")
    ensure_base_image(recipe.base_image)
    started = time.monotonic()
    try:
        prepare_wheelhouse(project, cache, recipe.extras)
        run(recipe.docker_build_argv(project), timeout=1800)
    finally:
        shutil.rmtree(project / WHEELHOUSE_IN_CONTEXT, ignore_errors=True)
    # Every rebuild leaves the build stage (sources + wheelhouse) and the previous image dangling: drop ours.
    if prune:
        subprocess.run(
            ["docker", "image", "prune", "--force", "--filter", f"label={Engine.LABEL}"],
            capture_output=True,
            timeout=300,
            check=False,
        )
    log.info(
        "image_built",
        image=recipe.image,
        base=recipe.base_image,
        extras=recipe.extras,
        seconds=round(time.monotonic() - started, 1),
    )
