"""What `dilocox compose check` leaves on the host: nothing it made, everything it found.

Why recorded rather than assumed: the check may find a running daemon with a user's images, a stopped
one with a data directory, or a bare machine; it must undo exactly its own part. So it records the host
before it touches the engine (`HostState`: daemon, data and exec roots, the daemon's key, network links,
Docker's iptables rules, ip_forward) and the engine's objects once it answers (`DockerObjects`), and
afterwards removes the difference: new containers, networks, volumes and images while the engine runs,
then, if the check started the daemon and has stopped it, the bridges, iptables chains and rules, files
and directories dockerd created. What existed before is never touched, even if it looks like Docker's.

The decisions (`objects_to_remove`, `host_leftovers`) are pure functions of the inventories, tested
with fake ones (tests/test_docker_host.py); `inventory_*` and `remove_*` do the reading and removing.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger()

IPTABLES_TABLES = ("filter", "nat")
DOCKER_RULE = re.compile(r"DOCKER|docker0|br-[0-9a-f]{12}")
DOCKER_CHAIN = re.compile(r"^-N (DOCKER\S*)$")
DOCKER_LINK = re.compile(r"^(docker0|br-[0-9a-f]{12}|veth[0-9a-f]+)$")
DAEMON_KEY = pathlib.Path("/etc/docker/key.json")  # written by dockerd 20.10 on its first start
EXEC_ROOT = pathlib.Path("/var/run/docker")
IP_FORWARD = pathlib.Path("/proc/sys/net/ipv4/ip_forward")


@dataclass(frozen=True)
class HostState:
    """The host's Docker-related state outside the engine (readable with no daemon running)."""

    daemon_running: bool
    paths: frozenset[str] = frozenset()  # which of the data root, exec root and daemon key exist
    links: frozenset[str] = frozenset()
    iptables: dict[str, tuple[str, ...]] = field(default_factory=dict)  # table -> `iptables -S` lines
    ip_forward: str | None = None


@dataclass(frozen=True)
class DockerObjects:
    """Ids of the engine's objects."""

    images: frozenset[str] = frozenset()
    containers: frozenset[str] = frozenset()
    networks: frozenset[str] = frozenset()
    volumes: frozenset[str] = frozenset()
    tags: frozenset[str] = frozenset()  # repository:tag


@dataclass
class Leftovers:
    """What the check created outside the engine and removes after stopping the daemon it started."""

    links: list[str] = field(default_factory=list)
    iptables: list[list[str]] = field(default_factory=list)  # argv tails: ["-t", "nat", "-D", ...]
    paths: list[str] = field(default_factory=list)
    ip_forward: str | None = None  # the value to write back, if dockerd changed it


def objects_to_remove(
    before: DockerObjects,
    now: DockerObjects,
    keep_images: frozenset[str] = frozenset(),
    ours: frozenset[str] | None = None,
) -> DockerObjects:
    """Every object that is there now and was not before, but the images (ids or tags) asked to be
    kept. `ours`: on a daemon that was running before (others may use it meanwhile), only these images
    (the ids carrying the Dockerfile's label or the check's tags) and no other kind of object: compose
    down and `docker run --rm` remove the check's containers, networks and volumes there."""
    images, tags = now.images - before.images - keep_images, now.tags - before.tags - keep_images
    if ours is None:
        return DockerObjects(
            images=images,
            containers=now.containers - before.containers,
            networks=now.networks - before.networks,
            volumes=now.volumes - before.volumes,
            tags=tags,
        )
    return DockerObjects(images=images & ours, tags=tags & ours)


def iptables_undo(before: dict[str, tuple[str, ...]], after: dict[str, tuple[str, ...]]) -> list[list[str]]:
    """Commands removing the Docker rules and chains that appeared: new rules in chains that stay are
    deleted one by one, new DOCKER* chains are flushed (all of them first: they jump to each other),
    then deleted; a built-in chain's policy dockerd changed (FORWARD to DROP) is set back. A rule or
    chain present before stays, even if it is Docker's."""
    undo, flush, drop, policies = [], [], [], []
    for table, lines in after.items():
        old = set(before.get(table, ()))
        now_policy = {line.split()[1]: line.split()[2] for line in lines if line.startswith("-P ")}
        for line in before.get(table, ()):
            if line.startswith("-P ") and now_policy.get(line.split()[1], line.split()[2]) != line.split()[2]:
                policies.append(["-t", table, *line.split()])
        new_chains = {m.group(1) for line in lines if line not in old and (m := DOCKER_CHAIN.match(line))}
        for line in lines:
            if line in old or not line.startswith("-A ") or not DOCKER_RULE.search(line):
                continue
            chain = line.split()[1]
            if chain not in new_chains:
                undo.append(["-t", table, "-D", *line.split()[1:]])
        flush += [["-t", table, "-F", chain] for chain in sorted(new_chains)]
        drop += [["-t", table, "-X", chain] for chain in sorted(new_chains)]
    return undo + flush + drop + policies


def host_leftovers(before: HostState, after: HostState, keep_data: bool = False) -> Leftovers:
    """What to remove once the daemon the check started has stopped; nothing when it was running
    before (the daemon owns its bridges and rules). `keep_data`: images were kept, so the data root
    (and the key that goes with it) stays."""
    if before.daemon_running:
        return Leftovers()
    created = sorted(after.paths - before.paths)
    if keep_data:
        created = [path for path in created if path == str(EXEC_ROOT)]
    restore = before.ip_forward if before.ip_forward is not None and before.ip_forward != after.ip_forward else None
    return Leftovers(
        links=sorted(link for link in after.links - before.links if DOCKER_LINK.match(link)),
        iptables=iptables_undo(before.iptables, after.iptables),
        paths=created,
        ip_forward=restore,
    )


# --- reading the host ---------------------------------------------------------------------------


def data_root() -> pathlib.Path:
    """dockerd's data root: daemon.json's `data-root` if set, else /var/lib/docker."""
    try:
        configured = json.loads(pathlib.Path("/etc/docker/daemon.json").read_text()).get("data-root")
    except (OSError, ValueError, AttributeError):
        configured = None
    return pathlib.Path(configured or "/var/lib/docker")


def _lines(argv: list[str]) -> list[str]:
    if shutil.which(argv[0]) is None:
        return []
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.splitlines() if done.returncode == 0 else []


def inventory_host(daemon_running: bool) -> HostState:
    paths = frozenset(str(p) for p in (data_root(), EXEC_ROOT, DAEMON_KEY) if p.exists())
    links = frozenset(
        line.split(": ")[1].split("@")[0] for line in _lines(["ip", "-o", "link", "show"]) if ": " in line
    )
    iptables = {table: tuple(_lines(["iptables", "-t", table, "-S"])) for table in IPTABLES_TABLES}
    try:
        forward = IP_FORWARD.read_text().strip()
    except OSError:
        forward = None
    return HostState(daemon_running, paths, links, iptables, forward)


def inventory_docker() -> DockerObjects:
    return DockerObjects(
        images=frozenset(_lines(["docker", "images", "--all", "--quiet", "--no-trunc"])),
        containers=frozenset(_lines(["docker", "ps", "--all", "--quiet", "--no-trunc"])),
        networks=frozenset(_lines(["docker", "network", "ls", "--quiet", "--no-trunc"])),
        volumes=frozenset(_lines(["docker", "volume", "ls", "--quiet"])),
        tags=frozenset(
            t for t in _lines(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"]) if "<none>" not in t
        ),
    )


def _tags_of(iid: str) -> list[str]:
    lines = _lines(["docker", "image", "inspect", "--format", "{{json .RepoTags}}", iid])
    return json.loads(lines[0]) if lines else []


def labelled_images(label: str) -> frozenset[str]:
    return frozenset(_lines(["docker", "images", "--all", "--quiet", "--no-trunc", "--filter", f"label={label}"]))


def image_id(name: str) -> str | None:
    lines = _lines(["docker", "image", "inspect", "--format", "{{.Id}}", name])
    return lines[0] if lines else None


# --- removing -----------------------------------------------------------------------------------


def _quiet(argv: list[str], timeout: float = 300) -> bool:
    return subprocess.run(argv, capture_output=True, timeout=timeout, check=False).returncode == 0


def remove_objects(objects: DockerObjects) -> None:
    """Containers first (they hold networks, volumes and images), images newest-first by retrying."""
    for cid in objects.containers:
        _quiet(["docker", "rm", "--force", "--volumes", cid])
    for nid in objects.networks:
        _quiet(["docker", "network", "rm", nid])
    for vid in objects.volumes:
        _quiet(["docker", "volume", "rm", "--force", vid])
    for tag in sorted(objects.tags):  # a new tag on an image that was there before (a cached build): untag only
        iid = image_id(tag)
        if iid and iid not in objects.images and len(_tags_of(iid)) > 1:
            _quiet(["docker", "rmi", "--no-prune", tag])
    pending = set(objects.images)
    for _ in range(3):  # a child image must go before its parent; ids already gone with a child fail harmlessly
        pending &= set(_lines(["docker", "images", "--all", "--quiet", "--no-trunc"]))
        for iid in sorted(pending):
            _quiet(["docker", "rmi", "--force", iid])
    log.info(
        "docker_objects_removed",
        images=len(objects.images),
        containers=len(objects.containers),
        networks=len(objects.networks),
        volumes=len(objects.volumes),
    )


def _mounts_under(root: pathlib.Path) -> list[str]:
    try:
        mounts = [line.split()[1] for line in pathlib.Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return []
    return [m for m in mounts if m == str(root) or m.startswith(f"{root}/")]


def remove_leftovers(leftovers: Leftovers) -> list[str]:
    """Undo the host changes; returns what could not be undone (reported, not raised)."""
    failed = []
    for link in leftovers.links:
        if not _quiet(["ip", "link", "delete", link], timeout=30):
            failed.append(f"link {link}")
    for tail in leftovers.iptables:
        if not _quiet(["iptables", *tail], timeout=30):
            failed.append(f"iptables {' '.join(tail)}")
    for raw in leftovers.paths:
        path = pathlib.Path(raw)
        for mount in sorted(_mounts_under(path), reverse=True):
            _quiet(["umount", mount], timeout=60)
        if _mounts_under(path):  # never rm -rf across a mount
            failed.append(f"{path} (still mounted)")
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if leftovers.ip_forward is not None:
        try:
            IP_FORWARD.write_text(leftovers.ip_forward)
        except OSError:
            failed.append("net.ipv4.ip_forward")
    log.info(
        "docker_host_restored",
        links=leftovers.links,
        iptables=len(leftovers.iptables),
        paths=leftovers.paths,
        ip_forward=leftovers.ip_forward,
        failed=failed,
    )
    return failed
