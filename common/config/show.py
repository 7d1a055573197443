"""`dilocox config show`: print the run configuration a worker would use, as TOML.

With flags, DILOCOX_<FLAG> variables and a `--config` file all able to set a value, an operator needs
to see what wins before starting a multi-site run. `show` resolves them exactly as `dilocox worker`
does (flags > environment > file > defaults) and prints the result; the output is itself a valid
`--config` file, so it is also how to write one.
"""

from __future__ import annotations

import argparse
import os
import sys

from dilocox.common.config.run import RunConfig, to_toml, toml_value
from dilocox.common.config.run_flags import add_config_arguments, config_from_args, flag_dests
from dilocox.common.config.sources import SettingsError, subparsers_of
from dilocox.common.config.waits import refusal

COMMANDS_WITH_TABLES = ("worker", "server", "sim", "export", "status")
SECRETS = ("token", "operator-token")  # never printed: the output is meant to be shared and pasted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)
    show = actions.add_parser(
        "show", help="print the effective RunConfig (flags > DILOCOX_* env > --config file > defaults)"
    )
    show.add_argument(
        "--command",
        choices=COMMANDS_WITH_TABLES,
        help="as this command would run: its own [<command>] table and DILOCOX_* variables applied, and its "
        "other flags printed in a [<command>] table",
    )
    add_config_arguments(show)


def command_settings(command: str, config_file: str | None, environ) -> tuple[RunConfig | None, dict]:
    """What `dilocox <command>` would run with, from its config file table, the environment and its
    defaults: (its run configuration, if it takes one; {flag: value} of its other flags)."""
    from dilocox.common.cli import build_parser  # the dispatcher resolves sources exactly as a real start does

    argv = [command, *(["--config", config_file] if config_file else [])]
    sub = subparsers_of(build_parser(argv, environ))[command]
    values = {a.dest: sub.get_default(a.dest) for a in sub._actions if a.option_strings and a.dest != "help"}
    run_dests = flag_dests()
    config = (
        config_from_args(argparse.Namespace(**values, _config_applied=True)) if run_dests <= values.keys() else None
    )
    others = {
        a.option_strings[-1].lstrip("-"): values[a.dest]
        for a in sub._actions
        if a.option_strings and a.dest not in run_dests and a.dest not in ("help", "config")
    }
    return config, others


def _line(key: str, value: object) -> str:
    if value is None:
        return f"# {key}: not set\n"
    if key in SECRETS:
        return f"# {key}: set (not printed)\n"
    return f"{key} = {toml_value(value)}\n"


def run(args: argparse.Namespace) -> int:
    try:
        if args.command:
            config, others = command_settings(args.command, args.config, os.environ)
            refused = (
                refusal(others.get("round-deadline-s"), others.get("grace-s") or 0.0)
                if args.command == "server"
                else None
            )
            if refused:
                print(f"dilocox config show: {refused}", file=sys.stderr)
                return 1
            text = (to_toml(config, only_in_use=True) + "\n") if config is not None else ""
            text += f"[{args.command}]\n" + "".join(_line(key, value) for key, value in others.items())
            sys.stdout.write(text)
            return 0
        config = config_from_args(args)
    except (ValueError, TypeError, SettingsError) as error:
        print(f"dilocox config show: bad configuration: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(to_toml(config, only_in_use=True))
    return 0
