"""`dilocox compose check` removes what it made and nothing it found (common/deploy/docker_host.py):
the decisions from fake inventories of a bare machine, a machine with a stopped Docker's leftovers, and
one with a running daemon; and the CLI's clean-up wiring around a check that fails."""

from __future__ import annotations

import pathlib

import pytest
import structlog

from dilocox.common.cli import build_parser
from dilocox.common.deploy import compose_cli, compose_images, docker_host
from dilocox.common.deploy.compose_check import CheckFailed
from dilocox.common.deploy.docker_host import DockerObjects, HostState, host_leftovers, iptables_undo, objects_to_remove

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA, EXEC, KEY = "/var/lib/docker", str(docker_host.EXEC_ROOT), str(docker_host.DAEMON_KEY)
BRIDGE = "br-0123456789ab"

BARE_FILTER = ("-P INPUT ACCEPT", "-P FORWARD ACCEPT", "-P OUTPUT ACCEPT")
DOCKER_FILTER = (
    "-P INPUT ACCEPT",
    "-P FORWARD DROP",
    "-P OUTPUT ACCEPT",
    "-N DOCKER",
    "-N DOCKER-ISOLATION-STAGE-1",
    "-N DOCKER-ISOLATION-STAGE-2",
    "-N DOCKER-USER",
    "-A FORWARD -j DOCKER-USER",
    "-A FORWARD -j DOCKER-ISOLATION-STAGE-1",
    "-A FORWARD -o docker0 -j DOCKER",
    "-A FORWARD -i docker0 ! -o docker0 -j ACCEPT",
    "-A DOCKER-ISOLATION-STAGE-1 -i docker0 ! -o docker0 -j DOCKER-ISOLATION-STAGE-2",
    "-A DOCKER-ISOLATION-STAGE-1 -j RETURN",
    "-A DOCKER-ISOLATION-STAGE-2 -o docker0 -j DROP",
    "-A DOCKER-USER -j RETURN",
)
DOCKER_NAT = (
    "-P PREROUTING ACCEPT",
    "-N DOCKER",
    "-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER",
    "-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE",
    "-A DOCKER -i docker0 -j RETURN",
)
OTHER_RULE = "-A INPUT -p tcp --dport 22 -j ACCEPT"  # someone else's, added meanwhile


def bare() -> HostState:
    return HostState(
        False, frozenset(), frozenset({"lo", "eth0"}), {"filter": BARE_FILTER, "nat": ("-P PREROUTING ACCEPT",)}, "0"
    )


def after_docker(before: HostState) -> HostState:
    """The host once the daemon the check started has stopped: Docker's traces added to `before`."""
    return HostState(
        False,
        before.paths | {DATA, EXEC, KEY},
        before.links | {"docker0", BRIDGE, "veth1a2b3c"},
        {"filter": (*DOCKER_FILTER, OTHER_RULE), "nat": DOCKER_NAT},
        "1",
    )


def test_a_bare_machine_gets_everything_undone():
    before = bare()
    left = host_leftovers(before, after_docker(before))
    assert left.paths == sorted([DATA, EXEC, KEY])
    assert left.links == sorted(["docker0", BRIDGE, "veth1a2b3c"])
    assert left.ip_forward == "0"
    deletes = [" ".join(t[2:]) for t in left.iptables if t[2] == "-D"]
    assert (
        "-D FORWARD -j DOCKER-USER" in deletes
        and "-D POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE" in deletes
    )
    assert not any("dport 22" in d for d in deletes), "a rule that is not Docker's is never touched"
    assert not any("DOCKER-USER -j RETURN" in d for d in deletes), "rules inside a dropped chain go with its flush"
    kinds = [t[2] for t in left.iptables]
    assert kinds == sorted(kinds, key=["-D", "-F", "-X", "-P"].index), (
        "rules out, then every chain flushed, then dropped"
    )
    assert ["-t", "filter", "-P", "FORWARD", "ACCEPT"] in left.iptables, (
        "the FORWARD policy dockerd set to DROP is set back"
    )
    assert {(t[1], t[3]) for t in left.iptables if t[2] == "-X"} == {
        ("filter", c) for c in ("DOCKER", "DOCKER-ISOLATION-STAGE-1", "DOCKER-ISOLATION-STAGE-2", "DOCKER-USER")
    } | {("nat", "DOCKER")}


def test_a_stopped_dockers_leftovers_are_not_ours():
    """Found: a data root, docker0 and the chains of an earlier daemon. The check removes only the
    compose bridge and the rule it added, and the exec root it made."""
    found = HostState(
        False,
        frozenset({DATA, KEY}),
        frozenset({"lo", "eth0", "docker0"}),
        {"filter": DOCKER_FILTER, "nat": DOCKER_NAT},
        "1",
    )
    dnat = "-A DOCKER ! -i docker0 -p tcp -m tcp --dport 57051 -j DNAT --to-destination 172.18.0.2:50051"
    after = HostState(
        False, found.paths | {EXEC}, found.links | {BRIDGE}, {"filter": DOCKER_FILTER, "nat": (*DOCKER_NAT, dnat)}, "1"
    )
    left = host_leftovers(found, after)
    assert left.paths == [EXEC] and left.links == [BRIDGE] and left.ip_forward is None
    assert left.iptables == [["-t", "nat", "-D", *dnat.split()[1:]]], "a new rule in a chain that stays: deleted alone"


def test_nothing_outside_the_engine_is_touched_when_the_daemon_was_running():
    running = HostState(
        True, frozenset({DATA, EXEC, KEY}), frozenset({"lo", "docker0"}), {"filter": DOCKER_FILTER}, "1"
    )
    assert host_leftovers(running, after_docker(running)) == docker_host.Leftovers()


def test_kept_images_keep_their_data_root():
    before = bare()
    left = host_leftovers(before, after_docker(before), keep_data=True)
    assert left.paths == [EXEC] and left.links  # the bridges and rules still go: the daemon is stopped


def test_objects_made_by_the_check_and_only_those():
    before = DockerObjects(
        images=frozenset({"sha256:user"}), containers=frozenset({"c-user"}), tags=frozenset({"dilocox:cpu"})
    )
    now = DockerObjects(
        images=frozenset({"sha256:user", "sha256:base", "sha256:mid", "sha256:check", "sha256:other"}),
        containers=frozenset({"c-user", "c-left"}),
        networks=frozenset({"n"}),
        volumes=frozenset({"v"}),
        tags=frozenset({"dilocox:cpu", "dilocox:check", "dilocox-base:bookworm", "other:1"}),
    )
    ours = objects_to_remove(before, now)  # a daemon the check started: all of it is the check's
    assert ours.images == {"sha256:base", "sha256:mid", "sha256:check", "sha256:other"} and ours.containers == {
        "c-left"
    }
    kept = objects_to_remove(before, now, keep_images=frozenset({"sha256:check", "dilocox:check"}))
    assert "sha256:check" not in kept.images and "dilocox:check" not in kept.tags
    # A daemon that was running before: only the check's own images; others' new objects stay.
    shared = objects_to_remove(before, now, ours=frozenset({"sha256:mid", "sha256:check", "dilocox:check"}))
    assert shared == DockerObjects(images=frozenset({"sha256:mid", "sha256:check"}), tags=frozenset({"dilocox:check"}))


def test_iptables_undo_is_empty_when_nothing_changed():
    assert iptables_undo({"filter": DOCKER_FILTER}, {"filter": DOCKER_FILTER}) == []


@pytest.fixture(autouse=True)
def keep_logging():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


class FakeDaemon:
    pid, returncode = 4242, None

    def poll(self):
        return self.returncode


@pytest.mark.parametrize("daemon_was_running", [False, True])
def test_a_failing_check_still_cleans_up(monkeypatch, capsys, daemon_was_running):
    """The smoke run fails: the images the run made go, the daemon it started stops, the host is restored."""
    calls = []
    started = None if daemon_was_running else FakeDaemon()
    engine = compose_images.Engine(started=started)
    monkeypatch.setattr(compose_images, "engine_answers", lambda: daemon_was_running)
    monkeypatch.setattr(compose_cli, "ensure_engine", lambda: engine)
    monkeypatch.setattr(compose_images.Engine, "stop", lambda self: calls.append("stop"))
    monkeypatch.setattr(
        compose_cli,
        "build_image",
        lambda project, cache, recipe, prune=True: calls.append(("build", recipe.image, prune)),
    )

    def smoke(image, tracking):
        raise CheckFailed("no transformers in the image")

    monkeypatch.setattr(compose_cli, "worker_smoke", smoke)
    states = iter([bare(), after_docker(bare())])
    monkeypatch.setattr(docker_host, "inventory_host", lambda daemon_running: next(states))
    objects = iter(
        [
            DockerObjects(images=frozenset({"sha256:user"})),
            DockerObjects(
                images=frozenset({"sha256:user", "sha256:new", "sha256:x"}), tags=frozenset({"dilocox:check"})
            ),
        ]
    )
    monkeypatch.setattr(docker_host, "inventory_docker", lambda: next(objects))
    monkeypatch.setattr(docker_host, "labelled_images", lambda label: frozenset({"sha256:new"}))
    monkeypatch.setattr(docker_host, "image_id", lambda name: None)
    monkeypatch.setattr(docker_host, "remove_objects", lambda objs: calls.append(("rm", objs)))
    monkeypatch.setattr(docker_host, "remove_leftovers", lambda left: calls.append(("host", left)) or [])
    argv = ["compose", "--project-dir", str(ROOT), "check"]
    assert compose_cli.run(build_parser(argv).parse_args(argv)) == 1
    assert "FAILED: the image's worker smoke run: no transformers" in capsys.readouterr().out
    assert calls[0] == ("build", "dilocox:check", False), "the check builds its own tag and prunes nothing of others'"
    removed = next(c[1] for c in calls if c[0] == "rm")
    if daemon_was_running:
        assert removed.images == {"sha256:new"} and "stop" not in calls and not any(c[0] == "host" for c in calls)
    else:
        assert removed.images == {"sha256:new", "sha256:x"} and "stop" in calls
        left = next(c[1] for c in calls if c[0] == "host")
        assert DATA in left.paths and "docker0" in left.links


def test_a_daemon_that_failed_to_start_leaves_nothing(monkeypatch, capsys):
    """dockerd made its directories, then never answered: the check skips and removes them."""
    removed = []
    monkeypatch.setattr(compose_images, "engine_answers", lambda: False)

    def fails():
        raise compose_images.EngineUnavailable("dockerd exited with 1")

    monkeypatch.setattr(compose_cli, "ensure_engine", fails)
    states = iter([bare(), HostState(False, frozenset({DATA, EXEC}), bare().links, bare().iptables, "0")])
    monkeypatch.setattr(docker_host, "inventory_host", lambda daemon_running: next(states))
    monkeypatch.setattr(docker_host, "remove_leftovers", lambda left: removed.append(left) or [])
    argv = ["compose", "--project-dir", str(ROOT), "check"]
    assert compose_cli.run(build_parser(argv).parse_args(argv)) == 0
    assert capsys.readouterr().out.startswith("SKIPPED: docker compose simulation: dockerd exited with 1")
    assert [left.paths for left in removed] == [sorted([DATA, EXEC])]
