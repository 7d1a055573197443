"""A `RunConfig` from the same TOML (or JSON) file `dilocox worker --config` reads, for Python callers
(`dilocox.load_run_config`): one file serves a run's CLI sites and its own-loop sites alike.

The run's keys (top level, or `[model]`/`[inner]`/... tables, named like the flags) and those of the
`[worker]` table become the RunConfig; keys that belong to other flags of a dilocox command (`servers`,
`checkpoint-dir`, other commands' tables) are theirs and left alone; a key no command knows is an error,
as it is on the command line.
"""

from __future__ import annotations

import argparse
import os

from dilocox.common.config.run import RunConfig
from dilocox.common.config.run_flags import add_config_arguments, config_from_args
from dilocox.common.config.sources import SettingsError, all_command_keys, convert, flatten_file, load_file, option_map


def load_run_config(path: str | os.PathLike, base: RunConfig | None = None) -> RunConfig:
    """The run configuration in `path` over `base` (default: RunConfig's defaults)."""
    from dilocox.common.cli import SUBCOMMANDS  # the command table; imported late (cli imports every command lazily)

    parser = argparse.ArgumentParser(add_help=False)
    add_config_arguments(parser)
    options = option_map([parser])
    shared, own = flatten_file(load_file(path), ["worker"], SUBCOMMANDS)
    values = {**shared, **own}
    foreign = [key for key in values if key not in options]
    if foreign:
        unknown = [key for key in foreign if key not in all_command_keys(SUBCOMMANDS)]
        if unknown:
            raise SettingsError(
                f"{path}: unknown key {unknown[0]!r}: no dilocox command has a flag --{unknown[0].replace('_', '-')}"
            )
    args = argparse.Namespace(**{action.dest: None for _, action in options.values()})
    for key, value in values.items():
        if key in options:
            action = options[key][1]
            setattr(args, action.dest, convert(action, value, f"{path}: key {key!r}"))
    return config_from_args(args, base)
