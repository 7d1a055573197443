"""Throw-away PKI for signing tests: two CAs as `dilocox certs` makes them, each with one issued key."""

from __future__ import annotations

import pathlib

from dilocox.common.deploy.certs import issue, load_ca, make_dev_certificates


def two_authorities(root: pathlib.Path, role: str, host: str, usage: str = "client") -> dict[str, pathlib.Path]:
    """The run's CA and another, each with a `role` certificate for `host` of `usage` ("client", "server",
    "signer": `dilocox certs --role`): {run,other}-{ca,cert,key}."""
    paths = {}
    for name in ("run", "other"):
        made = make_dev_certificates(root / name)
        issued = issue(load_ca(root / name), root / name, role, usage, (host,))
        paths |= {f"{name}-ca": made["ca"], f"{name}-cert": issued[role], f"{name}-key": issued[f"{role}-key"]}
    return paths
