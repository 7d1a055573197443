"""`dilocox server`'s flags: every option of one aggregation shard, with its help text and default.

Its own module because the table is long (about sixty flags, most with a paragraph of help) and is read on
its own: by `dilocox docs reference`, by the topology file's check that every shard policy key is a flag of
its type (tests/test_topology_file.py), and by anyone looking up a flag; `server/main.py` keeps what a
started shard does with them. The CLI reaches this table through `dilocox.server.main.add_arguments`
(common/cli.py calls a command module's `add_arguments` and `run`).
"""

from __future__ import annotations

import argparse
import pathlib

from dilocox.common.config.run import OuterConfig
from dilocox.common.logs import add_log_format_argument
from dilocox.common.metrics_http import add_metrics_arguments
from dilocox.common.security import add_security_arguments
from dilocox.common.wire.staleness import DEFAULT_MAX_WEIGHT_MULTIPLE
from dilocox.server.checks.robust_mean import AGGREGATES, AggregateConfig
from dilocox.server.checks.update_check import MODES, UpdateCheckConfig
from dilocox.server.serving.health_watch import STALL_S
from dilocox.server.serving.pull_framing import DEFAULT_BUDGET_MB
from dilocox.server.serving.push_intake import PushLimits
from dilocox.server.shard import DEFAULT_KEEP_ROUNDS
from dilocox.server.state.rounds_on_disk import DEFAULT_KEEP_ROUNDS_DISK_GB, DEFAULT_KEEP_ROUNDS_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-shards", type=int, default=1, help="total shards of the aggregation service (default 1)")
    parser.add_argument("--shard-index", type=int, default=0, help="which shard this process is, 0-based (default 0)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on; 0 picks a free one (default 50051)")
    parser.add_argument("--port-file", type=pathlib.Path, help="write the bound port here once serving")
    parser.add_argument("--run-id", default="dilocox-sim", help="run this shard serves; other runs are refused")
    parser.add_argument(
        "--outer-lr",
        type=float,
        default=OuterConfig.lr,
        help=f"outer Nesterov learning rate η (default {OuterConfig.lr})",
    )
    parser.add_argument(
        "--outer-momentum",
        type=float,
        default=OuterConfig.momentum,
        help=f"outer momentum μ (default {OuterConfig.momentum})",
    )
    parser.add_argument(
        "--min-clusters", type=int, default=1, help="contributions a round needs before it may close (default 1)"
    )
    parser.add_argument(
        "--expect-clusters",
        type=int,
        help="the run's sites: its first round does not close before this many have joined (default: --min-clusters). "
        "Give it the number of sites when --min-clusters is lower (a quorum), so a site that starts slower than the "
        "others' first round is not refused as a late joiner; with --round-deadline-s, round 1 closes without a site "
        "that has not joined that long after its first push",
    )
    parser.add_argument(
        "--round-deadline-s",
        type=float,
        default=300.0,
        help="close a round this long after its first contribution with the clusters that completed it "
        "(≥ --min-clusters); the rest are marked inactive and must rejoin (default 300; 0 = wait forever)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=0.0,
        help="close a round on a quorum: once --min-clusters have delivered, wait at most this long for the rest "
        "(adapted to how far apart sites arrive lately), then close without them; a late site stays in the run and its "
        "part goes with its next push. With it, --round-deadline-s only marks a site gone that pushed nothing for that "
        "long (default 0 = off: wait for every site, up to --round-deadline-s)",
    )
    parser.add_argument(
        "--grace-min-s",
        type=float,
        default=0.0,
        help="with --grace-s: the shortest grace window the adaptation may choose (default 0)",
    )
    parser.add_argument(
        "--keep-rounds",
        type=int,
        default=DEFAULT_KEEP_ROUNDS,
        help="keep the contributions of this many newest versions, so a site that comes back up to that many "
        "versions behind (a restart from its checkpoint) pulls those rounds instead of the weights and momentum in "
        f"full; costs their compressed bytes in memory (default {DEFAULT_KEEP_ROUNDS}; 1 = the newest only)",
    )
    parser.add_argument(
        "--keep-rounds-s",
        type=float,
        default=DEFAULT_KEEP_ROUNDS_S,
        help="also keep every version's contributions on disk (--keep-rounds-dir) for this long, so a site back "
        "within it "
        "(a requeue, a reschedule, a night away) resumes by delta, not by pulling the whole model; 0 = memory only "
        f"(--keep-rounds). Default {DEFAULT_KEEP_ROUNDS_S:g} (a day)",
    )
    parser.add_argument(
        "--keep-rounds-dir",
        type=pathlib.Path,
        help="where --keep-rounds-s keeps them (default: <--checkpoint-dir>/recent-rounds; without either, "
        "memory only)",
    )
    parser.add_argument(
        "--keep-rounds-disk-gb",
        type=float,
        help="at most this much disk for them: past it the oldest go first, and the shard says how far back it "
        f"then reaches (recent_rounds_budget_reached). Default: half the folder's free space at start, at most "
        f"{DEFAULT_KEEP_ROUNDS_DISK_GB:g} (84 MB a site and round at 107B), so they never crowd out the "
        "checkpoints on a shared volume",
    )
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, help="write shard-<index>.pt here (atomically)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=1, help="checkpoint every k published versions (default 1)"
    )
    parser.add_argument(
        "--keep-serving",
        action="store_true",
        help="keep serving after the run's end (default: exit once every cluster has pulled the final version)",
    )
    parser.add_argument(
        "--checkpoint-keep", type=int, default=3, help="checkpoints kept: this version and earlier ones (default 3)"
    )
    parser.add_argument("--resume", action="store_true", help="restart from the checkpoint in --checkpoint-dir")
    parser.add_argument(
        "--resume-if-present",
        action="store_true",
        help="--resume when --checkpoint-dir holds a checkpoint of this shard, else start the run: for "
        "orchestrators that start a shard the same way over its volume, first empty (Kubernetes)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="with --resume: raise the run's rounds to this (train a finished run longer, keeping its weights "
        "and outer momentum; then start the sites with --resume --rounds N; docs/deploy.md)",
    )
    parser.add_argument(
        "--checkpoint-sign-key",
        metavar="KEY_PEM",
        help="sign every checkpoint with this private key (PEM: ECDSA as `dilocox certs` makes, Ed25519 or "
        "RSA), so a resume can refuse a changed file even when its digest was recomputed",
    )
    parser.add_argument(
        "--checkpoint-sign-cert",
        metavar="CERT_PEM",
        help="with --checkpoint-sign-key: its certificate (then any intermediates), for --checkpoint-ca",
    )
    trust = parser.add_mutually_exclusive_group()
    trust.add_argument(
        "--checkpoint-verify-key",
        metavar="PUBLIC_PEM",
        help="with --resume: restore only a checkpoint signed by this key (a public key or its certificate); "
        "an unsigned or changed one is refused by name, as a damaged one (an older kept version that "
        "verifies is used instead)",
    )
    trust.add_argument(
        "--checkpoint-ca",
        metavar="CA_PEM",
        help="with --resume: restore only a checkpoint signed with a certificate from this CA (--checkpoint-sign-cert)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start a new run over a --checkpoint-dir that holds one: move the old checkpoints aside first",
    )
    parser.add_argument(
        "--push-idle-timeout-s",
        type=float,
        default=PushLimits.idle_timeout_s,
        help="refuse a push stream that sends nothing for this long (UNAVAILABLE; nothing of it applied, "
        "the site pushes again): well above one chunk's transfer time on the slowest site's link",
    )
    parser.add_argument(
        "--push-streams-per-cluster",
        type=int,
        default=PushLimits.streams_per_cluster,
        help="push streams one cluster identity may hold open at this shard at once (RESOURCE_EXHAUSTED "
        "past it); a site opens one per rank",
    )
    parser.add_argument(
        "--pull-cache-mb",
        type=int,
        default=DEFAULT_BUDGET_MB,
        help="memory for pull chunks framed once per version and sent to every cluster that pulls the same "
        "bytes (other clusters' contributions, the weights); a larger stream is framed per pull; 0: off",
    )
    checks = UpdateCheckConfig()
    parser.add_argument(
        "--update-check",
        default=checks.mode,
        choices=MODES,
        help="look at each site's update before the merge, against the round's peers (its norm against the "
        "other sites' accepted ones, its cosine with the other sites' mean — with two sites, with the other "
        "site, the previous round's update breaking a tie — a replayed payload): warn logs and counts; clip "
        "merges an update flagged only for its size scaled down to the reference norm and leaves any other "
        "flagged one out; exclude leaves every flagged or quarantined site out of the round. Neither acts "
        "on more than --update-check-max-flagged of a round (docs/decisions.md)",
    )
    parser.add_argument(
        "--update-check-norm-ratio",
        type=float,
        default=checks.norm_ratio,
        help="flag an update whose norm exceeds this many times the median of the other sites' norms accepted lately",
    )
    parser.add_argument(
        "--update-check-min-cosine",
        type=float,
        default=checks.min_cosine,
        help="flag an update whose cosine with the other sites' mean (3 or more sites) is below this; of two "
        "sites below it with each other, the one whose cosine with the previous round's update is below "
        "it and the lower",
    )
    parser.add_argument(
        "--update-check-min-agreement",
        type=float,
        default=checks.min_agreement,
        help="judge a site's direction only where the other sites agree among themselves at least this much "
        "(their mean pairwise cosine; with two sites, where the pair's cosine is below minus this): late "
        "in training honest updates are mostly noise and a cosine bound alone flags honest sites",
    )
    parser.add_argument(
        "--update-check-max-flagged",
        type=float,
        default=checks.max_flagged,
        help="act (clip, exclude, quarantine) only while at most this share of a round's sites is flagged; "
        "above it the round merges as usual and the shard logs update_check_overruled (default 0.5: "
        "never a majority)",
    )
    parser.add_argument(
        "--update-check-quarantine-rounds",
        type=int,
        default=checks.quarantine_rounds,
        help="flagged this many rounds in a row, a site is quarantined: with exclude or clip, left out "
        "until it passes as many rounds in a row or an operator readmits it (dilocox readmit)",
    )
    parser.add_argument(
        "--max-weight-multiple",
        type=float,
        default=DEFAULT_MAX_WEIGHT_MULTIPLE,
        help="a site's weight in a round's mean is at most this many times the median of the other sites' "
        "tokens: tokens are a claim, and one site saying 1000x the others' would take over the step "
        "(the round record keeps both; 0: weigh as said)",
    )
    parser.add_argument(
        "--aggregate",
        default="mean",
        choices=AGGREGATES,
        help="a round's step: the sites' weighted mean, or clipped-mean — each site's update scaled down to at "
        "most --aggregate-clip-multiple times the median of the other sites' norms first, so a site under "
        "the update check's bounds still moves the step by a bounded share (server/checks/robust_mean.py)",
    )
    parser.add_argument(
        "--aggregate-clip-multiple",
        type=float,
        default=AggregateConfig().clip_multiple,
        help="clipped-mean: the bound, as a multiple of the median of the other sites' update norms",
    )
    parser.add_argument(
        "--operator-token",
        default=None,
        help="what an operator's request must carry (dilocox readmit: release a site the update check "
        "quarantined); keep it from the sites, which hold the run token only (default: none, such "
        "requests refused; also $DILOCOX_OPERATOR_TOKEN)",
    )
    parser.add_argument(
        "--health-stall-s",
        type=float,
        default=STALL_S,
        help="report NOT_SERVING (grpc.health.v1) while a task has waited this long for one of the shard's "
        "work threads, SERVING again once it ran: orchestrators' probes then act on a wedged shard",
    )
    parser.add_argument(
        "--work-threads",
        type=int,
        default=None,
        help="threads that decode pushes, frame pulls and close rounds (default: the CPUs this process may "
        "use + 2, at most 32; no thread waits on the network, so more only contend for the interpreter)",
    )
    parser.add_argument(
        "--added-latency-ms",
        type=float,
        default=0.0,
        help="delay every push and pull by this much: user-space WAN latency for tests (this kernel has no netem)",
    )
    add_log_format_argument(parser)
    add_metrics_arguments(parser, default_host=None)
    add_security_arguments(parser, "server")
