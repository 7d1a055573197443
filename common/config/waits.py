"""The site's waits, from the shortest to the longest, in one place (docs/deploy.md, "Waits and timeouts").

One rank can legitimately be inside an exchange for a long time: the communicator waits for a round's
result up to `PULL_WAIT_S` (re-pushing its part meanwhile), and each call to a shard that is down waits up
to the site's `--shard-wait-s` more. Its peers, meanwhile, wait for it in the boundary's next collective —
always an agreement, on a gloo group of its own (`SiteMesh.agreement_group`) — so the agreements' timeout
must outlast both: `collective_timeout_for`. The training collectives (NCCL on GPUs) never wait for an
exchange and time out after `STEP_TIMEOUT_S`, so a hung NCCL collective surfaces in minutes. A site sets all three
(`dilocox worker --shard-wait-s,
--pull-wait-s, --boundary-margin-s`); the collective timeout is never a setting of its own, so it cannot be set
below the waits it has to outlast.
"""

from __future__ import annotations

SHARD_WAIT_S = 1800.0  # an unreachable shard (restarting, link down)
PULL_WAIT_S = 3600.0  # a round's result, after the push
MARGIN_S = 600.0  # a boundary's own work on top (reshard, checkpoint staging, eval)
RPC_TIMEOUT_S = 600.0  # one push or pull call's own limit (a stalled stream), beyond the waits above
# What a stopping site is given before its launcher kills it: an eighth of a round's steps, the exchange's
# grace (`--stop-grace-s`, 30 s) and the checkpoint write in flight. torchrun's own default is 30 s, which
# SIGKILLed a 2-rank site 24.6 s into its stop: every launcher the project starts or renders gives torchrun
# this (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, read by torch ≥ 2.9, ignored before) and a Kubernetes site pod this
# and 30 s more (`terminationGracePeriodSeconds`).
STOP_TIMEOUT_S = 300
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
# A training collective (FSDP's all-gather and reduce-scatter, a pipeline send, a reshard's all-to-all): how
# long a rank waits in one for its peers before the site fails (NCCL's watchdog on GPUs). Never an exchange
# wait — those end in an agreement on the host (`collective_timeout_for`) — so a step plus a margin: torch's
# own NCCL default. `dilocox worker --step-timeout-s`.
STEP_TIMEOUT_S = 600.0


def collective_timeout_for(shard_wait_s: float, pull_wait_s: float = PULL_WAIT_S, margin_s: float = MARGIN_S) -> float:
    """The timeout of the site's agreements (gloo, on the host): longer than the longest legitimate exchange
    of one rank, which the communicator bounds by construction — every wait for an unreachable shard and
    for the round's result inside `shard_wait_s + pull_wait_s` from the exchange's start
    (worker/exchange/communicator.py), plus one call's own `RPC_TIMEOUT_S` in flight at that moment — and
    the boundary's own work."""
    problems = site_wait_problems(shard_wait_s, pull_wait_s, margin_s)
    if problems:
        raise ValueError("waits must be positive: " + "; ".join(problems))
    return pull_wait_s + shard_wait_s + RPC_TIMEOUT_S + margin_s


def site_wait_problems(shard_wait_s: float, pull_wait_s: float, margin_s: float) -> list[str]:
    """What `dilocox worker` refuses in its waits, and `collective_timeout_for` with them: each a sentence
    naming the flag."""
    problems = []
    if not shard_wait_s >= 0:
        problems.append(f"--shard-wait-s must be ≥ 0, got {shard_wait_s:g}")
    if not pull_wait_s > 0:
        problems.append(f"--pull-wait-s must be > 0, got {pull_wait_s:g}")
    if not margin_s >= 0:
        problems.append(f"--boundary-margin-s must be ≥ 0, got {margin_s:g}")
    return problems


def refusal(round_deadline_s: float | None, grace_s: float = 0.0) -> str | None:
    """The sentence `dilocox server` and `dilocox config show --command server` refuse with, or None."""
    problems = contradictions(round_deadline_s, grace_s)
    if not problems:
        return None
    return 'the waits contradict each other (docs/deploy.md, "Waits and timeouts"): ' + "; ".join(problems)


def contradictions(round_deadline_s: float | None, grace_s: float = 0.0, pull_wait_s: float = PULL_WAIT_S) -> list[str]:
    """What in a shard's settings breaks the order of the waits (shard round deadline and grace below the
    sites' pull wait): each a sentence naming the flags. Empty when they hold. `dilocox server` refuses to
    start on any, and `dilocox config show --command server` says them."""
    problems = []
    deadline = round_deadline_s or None  # 0: wait forever
    if deadline is not None and deadline > pull_wait_s:
        problems.append(
            f"--round-deadline-s {deadline:g} is longer than a site's wait for a round's result ({pull_wait_s:g} s): "
            "sites would give up on rounds the shard still holds open; keep it below"
        )
    if grace_s > 0 and deadline is not None and grace_s >= deadline:
        problems.append(
            f"--grace-s {grace_s:g} is not shorter than --round-deadline-s {deadline:g}: with a grace window the "
            "deadline marks a silent site gone, and it would do so before the grace that waits for it ends"
        )
    if grace_s > pull_wait_s:
        problems.append(f"--grace-s {grace_s:g} is longer than a site's wait for a round's result ({pull_wait_s:g} s)")
    return problems
