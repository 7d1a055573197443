"""`dilocox config show`: print the run configuration a worker would use, as TOML.

With flags, DILOCOX_<FLAG> variables and a `--config` file all able to set a value, an operator needs
to see what wins before starting a multi-site run. `show` resolves them exactly as `dilocox worker`
does (flags > environment > file > defaults) and prints the result; the output is itself a valid
`--config` file, so it is also how to write one.
"""

from __future__ import annotations

import argparse
import sys

from dilocox.common.config.run import add_config_arguments, config_from_args, to_toml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)
    show = actions.add_parser("show", help="print the effective RunConfig (flags > DILOCOX_* env > --config file > defaults)")
    add_config_arguments(show)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as error:
        print(f"dilocox config show: bad configuration: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(to_toml(config))
    return 0
