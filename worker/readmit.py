"""`dilocox readmit`: an operator releases a site the shards' update check quarantined.

A site flagged `--update-check-quarantine-rounds` rounds in a row is left out of every round (under
`exclude` or `clip`) until it passes as many in a row (server/checks/update_check.py). When the operator knows
why it was flagged and that it is fixed — a site restored from the right checkpoint, a data pipeline
repaired — waiting those rounds wastes its work: this asks every shard to release it now. Each shard
checks its operator token (`dilocox server --operator-token`), which the sites do not hold, so a
quarantined site cannot release itself. Every shard is asked (each quarantines on its own slices); the
exit status is 1 if any refused or did not answer, so a script notices a partial release.
"""

from __future__ import annotations

import argparse

import grpc

from dilocox.common.logs import configure_logging
from dilocox.common.security import add_security_arguments, open_channel
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.worker.status import shards_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", required=True, help="comma-separated host:port of the shards (all of them)")
    parser.add_argument("--run-id", required=True, help="the run's id")
    parser.add_argument("--site", required=True, help="the site (cluster name) to release from quarantine")
    parser.add_argument(
        "--operator-token", default=None, help="the shards' --operator-token (default: $DILOCOX_OPERATOR_TOKEN)"
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each shard (default 10)")
    add_security_arguments(parser, "worker")


def readmit_each(
    addresses: list[str],
    run_id: str,
    site: str,
    operator_token: str,
    tls,
    token: str | None,  # noqa: ANN001
    timeout: float,
) -> list[tuple[str, pb.ReadmitReply | grpc.RpcError]]:
    """Each shard's reply (or the error it answered with), in the order given."""
    request = pb.ReadmitRequest(run_id=run_id, cluster=site, operator_token=operator_token)
    answers = []
    for address in addresses:
        with open_channel(address, [], tls, token) as channel:
            try:
                answers.append((address, pb_grpc.AggregatorStub(channel).Readmit(request, timeout=timeout)))
            except grpc.RpcError as error:
                answers.append((address, error))
    return answers


def run(args: argparse.Namespace) -> int:
    configure_logging("kv", "warning")
    addresses, tls, token = shards_of(args, "dilocox readmit")
    if not args.operator_token:  # $DILOCOX_OPERATOR_TOKEN reaches the flag as every DILOCOX_<FLAG> does
        raise SystemExit("dilocox readmit: no operator token: give --operator-token or set $DILOCOX_OPERATOR_TOKEN")
    failed = 0
    for address, answer in readmit_each(
        addresses, args.run_id, args.site, args.operator_token, tls, token, args.timeout
    ):
        if isinstance(answer, grpc.RpcError):
            failed += 1
            print(f"{address}: refused: {answer.code().name}: {answer.details()}")
        else:
            outcome = (
                "released from quarantine" if answer.was_quarantined else "was not quarantined here (nothing changed)"
            )
            print(f"{address}: shard {answer.shard_index}: {args.site} {outcome}")
    return 1 if failed else 0
