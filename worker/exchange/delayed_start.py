"""Where a cluster starts its next round under the one-step delay.

At the end of round t the cluster holds θ_{t-1} (the merged model that travelled while round t computed)
and its own fresh pseudo-gradient Δ_t; the shards will make θ_t = θ_{t-1} − η·(ḡ_t + μ·v_t) with
v_t = μ·v_{t-1} + ḡ_t and ḡ_t the mean of all clusters' Δ_t — but only a round later. The next round
starts from an estimate of θ_t. Two rules:

* ``own`` (DESIGN.md §3): s_{t+1} = θ_{t-1} − Δ_t. The cluster's own progress at full weight, nobody
  else's: with M clusters its start leans towards its own data shard by (1 − η(1+μ)/M)·Δ_t, and the
  others' rounds reach it a round late.
* ``eager``: Eager updates as Kale, Douillard & Donchev define them (arXiv 2502.12996): each worker
  steps its own copy of the outer optimiser with g̃_t = ḡ_{t-1} + (Δ_t − Δ_{t-1})/M — the last merged
  mean with this cluster's stale part in it replaced by its fresh one — and trains the next round from
  there. The outer step is linear in its gradients, so that trajectory is the shards' θ_{t-1} less the
  same step driven by the differences Δ_t − Δ_{t-1}, which telescopes to one Nesterov step on Δ_t with
  a momentum W of the cluster's own (4 bytes per parameter, `OutgoingFold.own_momentum`):

      W_t     = μ·W_{t-1} + Δ_t
      s_{t+1} = θ_{t-1} − (η/M)·(Δ_t + μ·W_t)

  So the cluster's own fresh progress counts at the weight the shards will give it (η/M, with momentum),
  not in full as `own` keeps it. With compression Δ is the cluster's own, uncompressed (the paper has no
  compression); the undelivered residual stays in the weights as for `own`.
* ``estimate``: the shards' own step applied locally to an estimate of ḡ_t. The estimate is the cluster's
  fresh Δ_t at its share 1/M, and for the other clusters' share their recent mean, which the replicated
  outer momentum already holds: (1 − μ)·v_{t-1} is an exponential average of the last rounds' ḡ (exactly
  ḡ when it does not change):

      ĝ     = Δ_t / M + (1 − 1/M)·(1 − μ)·v_{t-1}
      s_{t+1} = θ_{t-1} − η·((1 + μ)·ĝ + μ²·v_{t-1})

  It needs no state beyond what the cluster's replica of the outer step holds (θ and v). Where the
  cluster has no momentum yet (its first rounds) v counts as 0. (This was `eager` before the paper's
  rule took the name; it counts the others' progress twice — once estimated here, once when θ_t arrives
  with it — and measured worse than `own`: docs/decisions.md.)

Either way the next adoption is unchanged: Δ_{t+1} = s_{t+1} − θ_local, θ_local ← θ_t − Δ_{t+1} for
`own`; for the others the same rule again, from θ_t (and v_t). Measured in docs/performance.md, "The loss gap".
"""

from __future__ import annotations

import torch

from dilocox.common.config.run import DELAYED_STARTS
from dilocox.common.wire.outer_optimizer import OuterNesterov

RULES = DELAYED_STARTS


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"delayed start must be one of {', '.join(RULES)}, got {rule!r}")
    return rule


def estimate_start(
    base: torch.Tensor, delta: torch.Tensor, momentum: torch.Tensor | None, lr: float, mu: float, share: float
) -> torch.Tensor:
    """s_{t+1} for one tensor: the outer step from `base` (θ_{t-1}) on the estimate of this round's mean
    pseudo-gradient; `share` is this cluster's weight in the mean (1/M for equal token counts)."""
    estimate = delta * share
    if momentum is not None:
        estimate = estimate + momentum * ((1.0 - share) * (1.0 - mu))
    step = estimate * (1.0 + mu)
    if momentum is not None:
        step = step + momentum * (mu * mu)
    return base - step * lr


def eager_updates_start(
    out: torch.Tensor,
    base: torch.Tensor,
    delta: torch.Tensor,
    own_momentum: torch.Tensor,
    lr: float,
    mu: float,
    share: float,
) -> None:
    """s_{t+1} = θ_{t-1} − η·share·(Δ_t + μ·W_t) into `out`, with W_t = μ·W_{t-1} + Δ_t updated in place."""
    own_momentum.mul_(mu).add_(delta)
    step = own_momentum * mu
    step.add_(delta)
    torch.sub(base, step, alpha=lr * share, out=out)


def next_start(
    rule: str,
    out: torch.Tensor,
    base: torch.Tensor,
    delta: torch.Tensor,
    momentum: torch.Tensor | None,
    outer: OuterNesterov | None,
    share: float,
    own_momentum: torch.Tensor | None = None,
) -> None:
    """s_{t+1} of one slice into `out` (which may be `base` itself) from θ_{t-1} = `base`, by `rule`.
    `momentum`: the slice's v_{t-1} in the cluster's replica of the outer step (None before it has one);
    `own_momentum`: the cluster's own W (rule `eager`)."""
    if check_rule(rule) == "own":  # s_{t+1} = θ_{t-1} − Δ_t: the merged model, this round's progress on top
        torch.sub(base, delta, out=out)
        return
    if rule == "eager":
        assert own_momentum is not None and outer is not None, "the eager rule needs the outer step and W"
        eager_updates_start(out, base, delta, own_momentum, outer.lr, outer.momentum, share)
        return
    lr, mu = (outer.lr, outer.momentum) if outer is not None else (1.0, 0.0)
    out.copy_(estimate_start(base, delta, momentum, lr, mu, share))
