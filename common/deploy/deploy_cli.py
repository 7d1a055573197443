"""`dilocox deploy`: render a run's launch files for the schedulers GPU sites use.

    dilocox deploy slurm --out DIR        # an sbatch script for the shards and one per site
    dilocox deploy kubernetes --out DIR   # StatefulSet + Service for the shards, an Indexed Job per site
    dilocox deploy topology --file run.toml --out DIR   # a run across clusters: DIR/<cluster>/… for each

Both start from the same `Topology` (common/deploy/topology.py) the compose file and the plain-process
launch are made from, so the flags every process gets cannot drift between launchers. What differs per
launcher (node counts, GPUs, images, volumes, secrets) is in that launcher's own module.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex

import structlog

from dilocox.common.deploy.topology import Site, Topology
from dilocox.common.logs import add_log_format_argument, configure_logging

log = structlog.get_logger()


def parse_sites(text: str) -> tuple[Site, ...]:
    """`name:PPxDP,name:PPxDP` (`:PPxDP` optional, default 1x1) → the sites."""
    sites = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, layout = item.partition(":")
        pp, dp = 1, 1
        if layout:
            try:
                pp, dp = (int(x) for x in layout.lower().split("x"))
            except ValueError:
                raise argparse.ArgumentTypeError(f"site {item!r}: the layout is PPxDP, e.g. {name}:2x4") from None
        if not name or pp < 1 or dp < 1:
            raise argparse.ArgumentTypeError(f"site {item!r}: give a name and PP, DP ≥ 1 (name:PPxDP)")
        sites.append(Site(name, pp, dp))
    if not sites:
        raise argparse.ArgumentTypeError("no sites given (name:PPxDP,…)")
    if len({s.name for s in sites}) != len(sites):
        raise argparse.ArgumentTypeError(f"site names must differ: {text!r}")
    return tuple(sites)


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Topology()
    parser.add_argument(
        "--out", type=pathlib.Path, required=True, help="folder to write the files into (made if absent)"
    )
    parser.add_argument("--run-id", default="dilocox-run", help="the run's id (default dilocox-run)")
    parser.add_argument(
        "--shards", type=int, default=defaults.num_shards, help=f"aggregation shards (default {defaults.num_shards})"
    )
    parser.add_argument(
        "--sites",
        type=parse_sites,
        default=parse_sites("site-a:1x1,site-b:1x1"),
        help="the sites as name:PPxDP, comma-separated (default site-a:1x1,site-b:1x1)",
    )
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help=f"outer rounds (default {defaults.rounds})")
    parser.add_argument(
        "--inner-steps", type=int, default=defaults.inner_steps, help=f"H (default {defaults.inner_steps})"
    )
    parser.add_argument(
        "--min-clusters",
        type=int,
        help="contributions a round needs (default: every site, so the first site up cannot race ahead)",
    )
    parser.add_argument(
        "--round-deadline-s", type=float, default=300.0, help="the shards' round deadline (default 300)"
    )
    parser.add_argument(
        "--worker-flags",
        default="",
        help="more `dilocox worker` flags for every site, as one shell-quoted string "
        '(model, data, compression: e.g. "--model llama-350m --data /data/tokens")',
    )


def topology_from_args(args: argparse.Namespace) -> Topology:
    return Topology(
        run_id=args.run_id,
        num_shards=args.shards,
        sites=args.sites,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        min_clusters=args.min_clusters or len(args.sites),
        round_deadline_s=args.round_deadline_s,
        extra_worker_flags=tuple(shlex.split(args.worker_flags)),
        simulation=False,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_log_format_argument(parser)
    actions = parser.add_subparsers(dest="action", metavar="launcher", required=True)
    from dilocox.common.deploy import kubernetes, slurm

    for module in (slurm, kubernetes):
        sub = actions.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        add_topology_arguments(sub)
        module.add_arguments(sub)
        sub.set_defaults(_launcher=module)
    from dilocox.common.deploy import topology_render

    sub = actions.add_parser("topology", help=topology_render.HELP, description=topology_render.HELP)
    topology_render.add_arguments(sub)
    sub.set_defaults(_launcher=topology_render)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    if args.action == "topology":
        return args._launcher.run(args)
    topology = topology_from_args(args)
    files = args._launcher.render(topology, args)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = args.out / name
        path.write_text(text)
        if text.startswith("#!"):
            path.chmod(0o755)
    log.info("deploy_rendered", launcher=args.action, out=str(args.out), files=sorted(files))
    print(args._launcher.next_steps(topology, args))
    return 0
