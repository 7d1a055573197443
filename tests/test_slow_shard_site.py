"""A shard slower than the site's old collective timeout does not kill the site.

The old timeout was `--shard-wait-s` + a margin: it forgot that one rank may wait for a round's result
(up to the pull wait) while its peers already sit in the boundary's next collective. Here a pp 1 × dp 2
site runs against four shards, one of which answers every push and pull `LATENCY_S` late and holds only
slices that *one* rank owns: that rank's exchange takes ≥ 2 × `LATENCY_S` a round, while its peer's is done
at once and waits for it in the boundary's first agreement. The waits are scaled down so the old value is
`SHARD_WAIT_S + MARGIN_S` = 2 s, well under that gap; the site's timeout now counts the pull wait too
(`common/config/waits.collective_timeout_for`: 30 + 1 + 1 s, and one call's own 600 s limit), and the site
finishes.
"""

from __future__ import annotations

import json
import math
import subprocess

from dilocox.common.config.run import ModelConfig
from dilocox.common.wire.assignment import assign_slices
from dilocox.worker.models.build import model_param_specs
from dilocox.worker.site.reshard import owners_by_size
from tests.tiny_worker import worker_argv

RUN = "slow-shard"
SHARDS = 4
LATENCY_S = 2.5
SHARD_WAIT_S, PULL_WAIT_S, MARGIN_S = 1.0, 30.0, 1.0
BYTE_VOCAB = 256  # the bundled corpus's default tokenizer: bytes


def _one_owner_shard(dp: int) -> tuple[int, int]:
    """(shard, rank): a shard all of whose slices one rank of the dp site owns, for the test's model."""
    specs = model_param_specs(ModelConfig(n_layer=1, n_embd=32, block_size=32), BYTE_VOCAB)
    owner = owners_by_size({name: math.prod(shape) for name, shape in specs}, dp)
    ranks: dict[int, set[int]] = {}
    for s in assign_slices(specs, SHARDS):
        ranks.setdefault(s.shard, set()).add(owner[s.name])
    single = sorted((shard, next(iter(r))) for shard, r in ranks.items() if len(r) == 1)
    assert single, f"no shard is one rank's alone: {ranks} (change SHARDS or the model)"
    return single[0]


def test_a_shard_slower_than_the_old_collective_timeout_does_not_kill_the_site(shard_set, tmp_path):
    slow, slow_rank = _one_owner_shard(dp=2)
    latencies = [LATENCY_S if i == slow else 0.0 for i in range(SHARDS)]
    shards = shard_set(SHARDS, RUN, added_latency_s=latencies)
    log_path = tmp_path / "site.log"
    cmd = worker_argv(
        shards.addresses,
        RUN,
        "--rounds",
        "3",
        "--inner-steps",
        "2",
        "--dp",
        "2",
        "--shard-wait-s",
        str(SHARD_WAIT_S),
        "--pull-wait-s",
        str(PULL_WAIT_S),
        "--boundary-margin-s",
        str(MARGIN_S),
    )
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            from tests.test_checkpoint import kill_tree

            kill_tree(proc.pid)
            raise AssertionError("the site still ran after 300 s: " + log_path.read_text()[-4000:]) from None
    text = log_path.read_text()
    assert proc.returncode == 0, text[-4000:]
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    done = {e["rank"]: e for e in events if e.get("event") == "cluster_done"}
    assert sorted(done) == [0, 1], sorted(done)
    assert all(s.version == 4 for s in shards.shards)  # 3 rounds and the flush, on every shard
    # The slow shard's rank really waited at a boundary longer than the old timeout, its peer far less.
    idle = {
        rank: max(e["idle_s"] for e in events if e.get("event") == "round_done" and e.get("rank") == rank)
        for rank in (0, 1)
    }
    assert idle[slow_rank] > SHARD_WAIT_S + MARGIN_S, idle
