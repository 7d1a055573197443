"""`dilocox compose`: the docker-compose multi-site simulation.

    dilocox compose render            # write docker-compose.yml from common/deploy/topology.py
    dilocox compose build             # build the image offline (debootstrap base + host wheelhouse)
    dilocox compose check             # engine up → build → compose up → checks → everything removed

All three run from the repository root (they need the Dockerfile and the compose file).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import structlog

from dilocox.common.deploy.compose_check import CheckFailed, ComposeRun, check
from dilocox.common.deploy.compose_file import render
from dilocox.common.deploy.compose_images import BASE_IMAGE, IMAGE, EngineUnavailable, build_image, ensure_engine
from dilocox.common.logs import add_log_format_argument, configure_logging
from dilocox.common.deploy.topology import Topology

log = structlog.get_logger()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--project-dir", type=pathlib.Path, default=pathlib.Path.cwd(),
                        help="repository root holding Dockerfile and docker-compose.yml (default: .)")  # fmt: skip
    add_log_format_argument(parser)
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)
    render_cmd = actions.add_parser("render", help="write docker-compose.yml from the topology")
    render_cmd.add_argument("--check", action="store_true", help="only verify the file is current (exit 1 if not)")
    for name, help_text in (("build", "build the image without registry access"), ("check", "run the compose simulation and check it")):
        cmd = actions.add_parser(name, help=help_text)
        cmd.add_argument("--image", default=IMAGE, help=f"tag of the image to build (default {IMAGE})")
        cmd.add_argument("--base-image", default=BASE_IMAGE, help=f"local base image, made by debootstrap if absent (default {BASE_IMAGE})")
        cmd.add_argument("--cache-dir", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "dilocox" / "wheelhouse",
                         help="where host wheels are kept between builds (default ~/.cache/dilocox/wheelhouse)")  # fmt: skip
    check_cmd = actions.choices["check"]
    check_cmd.add_argument("--no-kill", action="store_true", help="skip the kill-a-site-and-rejoin step")
    check_cmd.add_argument("--keep", action="store_true", help="leave the containers running afterwards (for debugging)")
    check_cmd.add_argument("--report", type=pathlib.Path, help="also write the measured figures here as JSON")


def _compose_file(project: pathlib.Path) -> pathlib.Path:
    path = project / "docker-compose.yml"
    if not (project / "Dockerfile").is_file():
        raise SystemExit(f"dilocox compose: no Dockerfile in {project} (run from the repository root or pass --project-dir)")
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
    try:
        engine = ensure_engine()
    except EngineUnavailable as error:
        return _unavailable(args, error)
    try:
        if args.action == "build":
            build_image(project, args.cache_dir, args.image, args.base_image)
            return 0
        return _check(args, project)
    except EngineUnavailable as error:
        return _unavailable(args, error)
    finally:
        engine.stop()


def _unavailable(args: argparse.Namespace, error: EngineUnavailable) -> int:
    """`check` (run by CI) skips loudly where docker or the image's sources cannot be had; `build`,
    asked for by a person, fails with the reason."""
    if args.action == "check":
        print(f"SKIPPED: docker compose simulation: {error}", flush=True)
        return 0
    print(f"dilocox compose build: {error}", file=sys.stderr, flush=True)
    return 1


def _check(args: argparse.Namespace, project: pathlib.Path) -> int:
    started = time.monotonic()
    build_image(project, args.cache_dir, args.image, args.base_image)
    compose_run = ComposeRun(project, Topology(), env={**os.environ, "DILOCOX_IMAGE": args.image})
    try:
        report = check(compose_run, kill_site=not args.no_kill)
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
