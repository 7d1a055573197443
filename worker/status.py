"""`dilocox status`: ask every shard what it is doing."""

from __future__ import annotations

import argparse
import json

from google.protobuf.json_format import MessageToDict

from dilocox.common.security import add_security_arguments, security_from_args
from dilocox.worker.aggregator_client import AggregatorClient, AggregatorError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", required=True, help="comma-separated host:port of the shards")
    parser.add_argument("--json", action="store_true", help="one JSON object per shard instead of key=value")
    add_security_arguments(parser, "worker")


def run(args: argparse.Namespace) -> int:
    addresses = [a.strip() for a in args.servers.split(",") if a.strip()]
    try:
        tls, token = security_from_args(args, "worker")
    except ValueError as error:
        raise SystemExit(f"dilocox status: {error}") from None
    code = 0
    with AggregatorClient(addresses, run_id="", cluster="status", tls=tls, token=token, retry_s=0) as client:
        for address, reply in zip(addresses, client.status_each()):
            if isinstance(reply, AggregatorError):
                error = reply
                print(f"address={address} error={error.code.name} details={error.details!r}")
                code = 1
                continue
            fields = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
            if args.json:
                print(json.dumps({"address": address, **fields}))
            else:
                print(" ".join([f"address={address}"] + [f"{k}={v}" for k, v in fields.items()]))
    return code
