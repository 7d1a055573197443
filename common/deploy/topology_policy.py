"""[shards.policy]: the shards' own `dilocox server` settings a topology file may give, typed, and their flags.

Its own module because this table mirrors the server's parser, not the file's layout: a key is a server
flag's name with its type and choices (tests/test_topology_file.py holds each against `dilocox server`'s
parser), so it changes when the server's flags do. What the file sets elsewhere is refused here, naming
where it belongs, and no secret is a policy key.
"""

from __future__ import annotations

import difflib

from dilocox.common.deploy.topology_values import TopologyFileError, choice, shown, typed_value

SHARD_POLICY = {
    "outer_lr": float,
    "outer_momentum": float,
    "expect_clusters": int,
    "grace_s": float,
    "grace_min_s": float,
    "keep_rounds": int,
    "keep_rounds_s": float,
    "keep_rounds_disk_gb": float,
    "checkpoint_every": int,
    "checkpoint_keep": int,
    "keep_serving": bool,
    "push_idle_timeout_s": float,
    "push_streams_per_cluster": int,
    "pull_cache_mb": int,
    "update_check": str,
    "update_check_norm_ratio": float,
    "update_check_min_cosine": float,
    "update_check_quarantine_rounds": int,
    "update_check_max_flagged": float,
    "update_check_min_agreement": float,
    "max_weight_multiple": float,
    "aggregate": str,
    "aggregate_clip_multiple": float,
    "health_stall_s": float,
    "work_threads": int,
    "checkpoint_sign_key": str,
    "checkpoint_sign_cert": str,
    "checkpoint_verify_key": str,
    "checkpoint_ca": str,
}
UPDATE_CHECKS = ("off", "warn", "clip", "exclude")
CHOICES = {
    "update_check": UPDATE_CHECKS,
    "aggregate": ("mean", "clipped-mean"),
}  # the server's own choices (tests hold them)
POLICY_ELSEWHERE = {  # a shard flag the file sets another way, and where
    "min_clusters": "min_clusters (top level)",
    "round_deadline_s": "round_deadline_s (top level)",
    "run_id": "run_id",
    "num_shards": "shards.count",
    "port": "shards.port",
    "checkpoint_dir": "shards.checkpoint_dir / state_dir",
    "keep_rounds_dir": "shards.checkpoint_dir / state_dir (kept in its recent-rounds folder)",
    "operator_token": "the shards' environment, DILOCOX_OPERATOR_TOKEN (a secret: not in a file several organisations "
    "read)",
    "token": "shards.token_file / token_secret (a secret)",
}


def policy_flags(table: object) -> tuple[str, ...]:
    """[shards.policy] → `dilocox server` flags, each key a flag name, typed and checked."""
    if not isinstance(table, dict):
        raise TopologyFileError(f"shards.policy: expected a table, got {shown(table)}")
    flags: list[str] = []
    for key, value in table.items():
        where = f"shards.policy.{key}"
        if key in POLICY_ELSEWHERE:
            raise TopologyFileError(f"{where}: set by {POLICY_ELSEWHERE[key]}, not here")
        if key not in SHARD_POLICY:
            close = difflib.get_close_matches(key, list(SHARD_POLICY), n=1, cutoff=0.5)
            hint = f"; did you mean 'shards.policy.{close[0]}'?" if close else ""
            raise TopologyFileError(f"{where}: not a shard setting{hint} (valid: {', '.join(sorted(SHARD_POLICY))})")
        value = typed_value(value, SHARD_POLICY[key], where)
        if key in CHOICES:
            choice(value, CHOICES[key], where)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise TopologyFileError(f"{where}: must be ≥ 0, got {value}")
        flag = "--" + key.replace("_", "-")
        flags += (
            ([flag] if value else [])
            if isinstance(value, bool)
            else [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        )
    return tuple(flags)
