"""`dilocox compose`: the docker-compose multi-site simulation.

    dilocox compose render            # write docker-compose.yml from common/deploy/topology.py
    dilocox compose build             # build the image offline (debootstrap base + host wheelhouse)
    dilocox compose build --variant cuda --print   # the CUDA image's `docker build` (needs a registry)
    dilocox compose check             # engine up → build → worker smoke run → compose up → checks →
                                      # everything it made removed (images, networks, daemon, data)

All three run from the repository root (they need the Dockerfile and the compose file).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import structlog

from dilocox.common.deploy import compose_images, docker_host
from dilocox.common.deploy.compose_check import CheckFailed, ComposeRun, check, worker_smoke
from dilocox.common.deploy.compose_file import render
from dilocox.common.deploy.compose_images import (
    BASE_IMAGE,
    DEFAULT_EXTRAS,
    VARIANTS,
    Engine,
    EngineUnavailable,
    build_image,
    ensure_engine,
    recipe_for,
)
from dilocox.common.deploy.topology import Topology
from dilocox.common.logs import add_log_format_argument, configure_logging

log = structlog.get_logger()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--project-dir",
        type=pathlib.Path,
        default=pathlib.Path.cwd(),
        help="repository root holding Dockerfile and docker-compose.yml (default: .)",
    )
    add_log_format_argument(parser)
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)
    render_cmd = actions.add_parser("render", help="write docker-compose.yml from the topology")
    render_cmd.add_argument("--check", action="store_true", help="only verify the file is current (exit 1 if not)")
    for name, help_text in (
        ("build", "build the image without registry access"),
        ("check", "run the compose simulation and check it"),
    ):
        cmd = actions.add_parser(name, help=help_text)
        cmd.add_argument(
            "--image",
            help="tag of the image to build (default dilocox:cpu, dilocox:cuda with --variant cuda; "
            "check: dilocox:check, removed afterwards unless --keep-image)",
        )
        cmd.add_argument(
            "--base-image",
            help=f"base image (default {BASE_IMAGE}, made by debootstrap if absent; "
            "the CUDA variant's: NVIDIA's runtime image)",
        )
        cmd.add_argument(
            "--extras",
            default=DEFAULT_EXTRAS,
            help=f"dilocox extras installed in the image, comma-separated (default {DEFAULT_EXTRAS}; add data "
            "for .parquet input; empty: none)",
        )
        cmd.add_argument(
            "--cache-dir",
            type=pathlib.Path,
            default=pathlib.Path.home() / ".cache" / "dilocox" / "wheelhouse",
            help="where host wheels are kept between builds (default ~/.cache/dilocox/wheelhouse)",
        )
    build_cmd = actions.choices["build"]
    build_cmd.add_argument(
        "--variant",
        choices=VARIANTS,
        default="cpu",
        help="cpu: offline recipe, the host's CPU torch; cuda: the registry recipe, torch from a "
        'CUDA index (print it with --print; docs/deploy.md, "Image variants") (default cpu)',
    )
    build_cmd.add_argument("--torch-index", help="cuda: the index torch comes from (default PyTorch's cu130 index)")
    build_cmd.add_argument("--torch-version", help="cuda: the torch version (default the host's, the one CI tests)")
    build_cmd.add_argument(
        "--print",
        action="store_true",
        dest="print_only",
        help="print the steps and the `docker build` command; build nothing",
    )
    check_cmd = actions.choices["check"]
    check_cmd.add_argument("--no-kill", action="store_true", help="skip the kill-a-site-and-rejoin step")
    check_cmd.add_argument(
        "--keep",
        action="store_true",
        help="leave the containers running afterwards (for debugging): nothing is cleaned up",
    )
    check_cmd.add_argument(
        "--keep-image",
        action="store_true",
        help="keep the image built (and a base image made) and the data directory they live in",
    )
    check_cmd.add_argument("--report", type=pathlib.Path, help="also write the measured figures here as JSON")


def _compose_file(project: pathlib.Path) -> pathlib.Path:
    path = project / "docker-compose.yml"
    if not (project / "Dockerfile").is_file():
        raise SystemExit(
            f"dilocox compose: no Dockerfile in {project} (run from the repository root or pass --project-dir)"
        )
    return path


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    project = args.project_dir.resolve()
    path = _compose_file(project)
    if args.action == "render":
        text = render(Topology())
        if args.check:
            if not path.is_file() or path.read_text() != text:
                print(f"{path} is stale: run `dilocox compose render`", file=sys.stderr)
                return 1
            return 0
        path.write_text(text)
        log.info("compose_rendered", path=str(path))
        return 0
    recipe = recipe_for(
        getattr(args, "variant", "cpu"),
        args.image or ("dilocox:check" if args.action == "check" else None),
        args.base_image,
        args.extras,
        getattr(args, "torch_index", None),
        getattr(args, "torch_version", None),
    )
    if args.action == "build" and (args.print_only or not recipe.offline):
        print(recipe.describe(project), flush=True)
        if not recipe.offline and not args.print_only:
            print(
                "# not built here: run it where the base image's registry and the torch index are reachable",
                file=sys.stderr,
                flush=True,
            )
        return 0
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a CI timeout still runs the clean-up below
    try:
        return _with_engine(args, project, recipe)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _with_engine(args: argparse.Namespace, project: pathlib.Path, recipe) -> int:
    host_before = docker_host.inventory_host(daemon_running=compose_images.engine_answers())
    try:
        engine = ensure_engine()
    except EngineUnavailable as error:  # a dockerd that failed to start may still have made its directories
        if not host_before.daemon_running:
            leftovers = docker_host.host_leftovers(host_before, docker_host.inventory_host(daemon_running=False))
            if leftovers != docker_host.Leftovers():
                docker_host.remove_leftovers(leftovers)
        return _unavailable(args, error)
    objects_before = docker_host.inventory_docker()
    try:
        if args.action == "build":
            build_image(project, args.cache_dir, recipe)
            return 0
        return _check(args, project, recipe)
    except EngineUnavailable as error:
        return _unavailable(args, error)
    finally:
        if not getattr(args, "keep", False):
            keep = args.action == "build" or args.keep_image
            _clean_up(
                engine,
                host_before,
                objects_before,
                {recipe.image, recipe.base_image} if keep else set(),
                args.action == "check",
                {recipe.image, recipe.base_image},
            )


def _clean_up(
    engine: Engine,
    host_before: docker_host.HostState,
    objects_before: docker_host.DockerObjects,
    keep_images: set[str],
    remove_objects: bool,
    our_tags: set[str],
) -> None:
    """Remove what this run made (`check`: its images too, unless kept), stop the daemon if it started it,
    then undo the daemon's traces on the host that were not there before (docker_host). On a daemon
    that was running before, only images of ours go (the Dockerfile's label, our tags)."""
    if remove_objects:
        kept = frozenset(keep_images) | frozenset(filter(None, map(docker_host.image_id, keep_images)))
        ours = None
        if engine.started is None:
            ours = docker_host.labelled_images(Engine.LABEL) | frozenset(our_tags)
            ours |= frozenset(filter(None, map(docker_host.image_id, our_tags)))
        docker_host.remove_objects(
            docker_host.objects_to_remove(objects_before, docker_host.inventory_docker(), kept, ours)
        )
    if engine.started is None:
        return
    engine.stop()
    after = docker_host.inventory_host(daemon_running=False)
    leftovers = docker_host.host_leftovers(host_before, after, keep_data=bool(keep_images))
    failed = docker_host.remove_leftovers(leftovers)
    if failed:
        print(f"WARNING: could not undo: {'; '.join(failed)}", file=sys.stderr, flush=True)


def _unavailable(args: argparse.Namespace, error: EngineUnavailable) -> int:
    """`check` (run by CI) skips loudly where docker or the image's sources cannot be had; `build`,
    asked for by a person, fails with the reason."""
    if args.action == "check":
        print(f"SKIPPED: docker compose simulation: {error}", flush=True)
        return 0
    print(f"dilocox compose build: {error}", file=sys.stderr, flush=True)
    return 1


def _check(args: argparse.Namespace, project: pathlib.Path, recipe) -> int:
    started = time.monotonic()
    build_image(project, args.cache_dir, recipe, prune=False)  # the clean-up removes exactly what this run made
    try:
        smoke = worker_smoke(recipe.image, tracking="tracking" in recipe.extras.split(","))
    except (CheckFailed, subprocess.TimeoutExpired) as error:
        print(f"FAILED: the image's worker smoke run: {error}", flush=True)
        return 1
    compose_run = ComposeRun(project, Topology(), env={**os.environ, "DILOCOX_IMAGE": recipe.image})
    try:
        report = {**smoke, **check(compose_run, kill_site=not args.no_kill)}
    except (CheckFailed, subprocess.TimeoutExpired) as error:
        print(f"FAILED: docker compose simulation: {error}", flush=True)
        for service in compose_run.compose("ps", "--services", check=False).stdout.split():
            logs = compose_run.compose("logs", "--no-color", "--tail", "30", service, check=False)
            print(f"--- last log lines of {service} ---\n{logs.stdout[-3000:]}", flush=True)
        return 1
    finally:
        if not args.keep:
            compose_run.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=300, check=False)
    report["total_s"] = round(time.monotonic() - started, 1)
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))
    print("PASSED: docker compose simulation " + " ".join(f"{k}={v}" for k, v in report.items()), flush=True)
    return 0
